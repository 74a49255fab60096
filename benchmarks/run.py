# Copyright (c) DeepSpeed Team.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""The cost of keeping the listed parameters in fp32, in every ZeRO stage, side by side with pristine DeepSpeed 0.19.8.

One command, one machine, one run. For every stage of ``--stages`` (configs.py: ``0`` no ZeRO, ``1``, ``2``, ``3``,
``3-offload`` with parameter and optimizer offload to the CPU; also ``1-bf16opt``, ``2-offload``,
``3-offload-param``, ``0-fusedadam``, ``3-hpz``), model and world size it trains three times with the same weights,
data and config (bf16, AdamW, gradient clipping, one process per rank, started by torchrun):

* ``pristine``: pristine DeepSpeed 0.19.8 (``PYTHONPATH=build/pristine``), its default config;
* ``series []``: the patch series with ``data_types.keep_in_fp32_modules: []`` (nothing kept);
* ``series kept``: the series keeping the listed parameters in fp32: ``"auto"`` (the default) for DeepSeek-V4;
  for gpt-oss, which lists only ``_keep_in_fp32_modules`` (kept under fp16 only), the explicit list
  ``["sinks", "norm"]`` under bf16 (``--gpt-oss-mode fp16`` uses fp16 with ``"auto"`` instead).

Measured: step time (min/median/max over the steps after warm-up; a step's time is its slowest rank's), peak
memory (peak RSS of each rank on the CPU; the allocator's peak on a GPU), the bytes the parameters and the optimizer
hold (by component) and, on the CPU, a census of all live tensor storages, against the theoretical extra of the
stage; and the collectives per step by kind and dtype (counted at DeepSpeed's communication backend; DeepSpeed's
comms logger, switched on for one extra step, gives the same counts by op name). Then a synthetic model whose listed
parameters (``keep_in_fp32_modules: ["keep"]``) are 0.1 %, 1 % and 10 % of all elements, and the same synthetic
model at hidden 1024 (``--compute-dim``), whose step is compute-bound. Paired timings (``series []`` and
``series kept`` in the same processes, alternating steps) at world size 2 (or the first of ``--world-sizes`` when
2 is not in it), and a table of the targets per stage. ``--communication-data-type fp32`` sets
``communication_data_type`` in every config of the run (pristine, [] and kept alike); the output says which.

    .venv/bin/python benchmarks/run.py --out out/bench
    .venv/bin/python benchmarks/run.py --quick --stages 3 --out out/bench-quick
    .venv/bin/python benchmarks/run.py --world-sizes 1 --out out/bench-gpu   # one CUDA GPU (NCCL)
    .venv/bin/python benchmarks/run.py --communication-data-type fp32 --out out/bench-comm-fp32

Writes DIR/results.json (everything, per rank) and DIR/results.md (the tables, the command, the machine).
"""

import argparse
import datetime
import json
import shlex
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import configs  # noqa: E402
import launch  # noqa: E402
import models  # noqa: E402
import report  # noqa: E402

VARIANTS = ("pristine", "series []", "series kept")

MODEL_LABELS = {"deepseek_v4": "DeepSeek-V4 (tiny)", "gpt_oss": "gpt-oss (tiny)", "tiny_net": "synthetic"}


def variant_setup(model, variant, gpt_oss_mode):
    """(build, keep_in_fp32_modules, dtype) of one variant."""
    dtype = "fp16" if (model == "gpt_oss" and gpt_oss_mode == "fp16") else "bf16"
    if variant == "pristine":
        return "pristine", configs.UNSET, dtype
    if variant == "series []":
        return "patched", [], dtype
    if model == "gpt_oss" and gpt_oss_mode == "list":
        return "patched", ["sinks", "norm"], dtype
    if model == "tiny_net":
        return "patched", ["keep"], dtype
    return "patched", configs.UNSET, dtype


def kept_description(model, gpt_oss_mode):
    if model == "gpt_oss":
        return ('explicit list ["sinks", "norm"] under bf16 (gpt-oss lists only _keep_in_fp32_modules, which '
                'apply under fp16)' if gpt_oss_mode == "list" else '"auto" under fp16')
    if model == "tiny_net":
        return 'explicit list ["keep"]'
    return '"auto" (the default: the model\'s _keep_in_fp32_modules_strict)'


def run_group(args, model, world_size, extra_spec, label, stage):
    """The three variants back to back, ``--rounds`` times (pristine, [], kept, pristine, ...); step times pooled."""
    group = {}
    for rnd in range(args.rounds):
        for variant in VARIANTS:
            try:
                job = run_job(args, model, variant, world_size, extra_spec, label, stage, rnd)
            except RuntimeError as err:
                failed(args, f"stage {stage}, {label}, world size {world_size}, {variant}", err)
                continue
            if variant in group:
                group[variant]["rounds"].append(job["ranks"])
            else:
                job["rounds"] = [job["ranks"]]
                group[variant] = job
    for job in group.values():
        job["summary"] = summarize(job["ranks"], job["rounds"])
    return group


def failed(args, what, err):
    """Note a job that failed (its rows are left out) and go on with the others."""
    lines = [line.strip() for line in str(err).splitlines() if "Error" in line]
    reason = (lines[-1] if lines else str(err).splitlines()[0])[:400]
    print(f"  FAILED: {what}: {reason}", flush=True)
    args.failures.append(f"{what}: {reason}")


def job_spec(args, model, dtype, steps, config, **extra):
    """What a rank of one job runs (benchmarks/worker.py reads it from spec.json)."""
    return dict(dict(model=model,
                     dtype=dtype,
                     micro_batch=args.micro_batch,
                     seq=args.seq,
                     seed=args.seed,
                     warmup=args.warmup,
                     steps=steps,
                     config=config),
                **extra)


def run_job(args, model, variant, world_size, extra_spec, label, stage, rnd=0):
    build, keep, dtype = variant_setup(model, variant, args.gpt_oss_mode)
    config = configs.ds_config(args.micro_batch, world_size, keep=keep, dtype=dtype, stage=stage,
                               overrides=args.config_overrides)
    spec = job_spec(args, model, dtype, args.steps, config, measure=True, **extra_spec)
    job_dir = (Path(args.workdir) / f"zero{stage}" / label / f"ws{world_size}" /
               variant.replace(" ", "_").replace("[]", "empty"))
    if args.rounds > 1:
        job_dir = job_dir / f"round{rnd}"
    start = time.time()
    ranks = launch.launch(spec, build, world_size, job_dir)
    summary = summarize(ranks)
    print(
        f"  stage {stage:<10} {label:<20} ws={world_size} {variant:<12} {time.time() - start:6.1f} s  "
        f"median step {summary['time']['median'] * 1e3:7.2f} ms",
        flush=True)
    return {
        "model": model,
        "variant": variant,
        "stage": stage,
        "world_size": world_size,
        "keep": configs.describe_keep(keep),
        "dtype": dtype,
        "build": build,
        "ranks": ranks,
        "summary": summary
    }


# glibc's malloc thresholds for the paired timing on the CPU (run.py --paired-malloc steady): see run_paired
STEADY_MALLOC = {"MALLOC_MMAP_THRESHOLD_": "4000000000", "MALLOC_TRIM_THRESHOLD_": "4000000000"}


def run_paired(args, model, world_size, extra_spec, label, stage):
    """`series []` and `series kept` as two engines in the same processes, alternating steps (a paired timing),
    in ``args.paired_launches`` launches of ``args.paired_steps`` step pairs each.

    On the CPU, PyTorch allocates each tensor with glibc's malloc, whose dynamic mmap threshold returns some large
    temporaries to the OS and maps them again on the next step, depending on the sizes and order of the frees so
    far: one engine of a pair can then fault in thousands of fresh pages per step more than the other, by chance
    of its tensor sizes, and a launch's ratio moves with it. ``--paired-malloc steady`` (the default on the CPU)
    fixes the thresholds for both engines (``STEADY_MALLOC``), as a caching allocator (CUDA's, jemalloc's) keeps
    freed memory; ``default`` leaves glibc as it is. The minor page faults per step are recorded either way.
    """
    _, keep_empty, dtype = variant_setup(model, "series []", args.gpt_oss_mode)
    _, keep_kept, _ = variant_setup(model, "series kept", args.gpt_oss_mode)
    paired_configs = [
        configs.ds_config(args.micro_batch, world_size, keep=keep, dtype=dtype, stage=stage,
                          overrides=args.config_overrides) for keep in (keep_empty, keep_kept)
    ]
    spec = job_spec(args, model, dtype, args.paired_steps, paired_configs[0], paired=paired_configs, **extra_spec)
    extra_env = STEADY_MALLOC if args.paired_malloc == "steady" else None
    start = time.time()
    launches = []
    for n in range(args.paired_launches):
        job_dir = Path(args.workdir) / f"zero{stage}" / label / f"ws{world_size}" / "paired"
        if args.paired_launches > 1:
            job_dir = job_dir / f"launch{n}"
        launches.append(launch.launch(dict(spec, seed=args.seed + n), "patched", world_size, job_dir,
                                      extra_env=extra_env))
    # per launch: each step's time (its slowest rank's) and CPU time (all ranks), per engine
    wall, cpu, faults = [], [], []
    for ranks in launches:
        steps = len(ranks[0]["step_times"][0])
        wall.append([[max(r["step_times"][i][s] for r in ranks) for s in range(steps)] for i in range(2)])
        cpu.append([[sum(r["cpu_times"][i][s] for r in ranks) for s in range(steps)] for i in range(2)])
        faults.append([[sum(r["minor_faults"][i][s] for r in ranks) for s in range(steps)] for i in range(2)])
    ratios = [[b / a for a, b in zip(*w)] for w in wall]
    pooled = [[t for w in wall for t in w[i]] for i in range(2)]
    pooled_cpu = [[t for c in cpu for t in c[i]] for i in range(2)]
    summary = {
        "steps": len(pooled[0]),
        "launches": len(launches),
        "malloc": args.paired_malloc,
        "empty_median": report.stats(pooled[0])["median"],
        "kept_median": report.stats(pooled[1])["median"],
        "median_step_ratio": report.stats([r for rs in ratios for r in rs])["median"],
        "median_step_ratio_ci95": bootstrap_median_ci(ratios),
        "launch_median_step_ratios": [report.stats(rs)["median"] for rs in ratios],
        "median_step_difference": report.stats([b - a for w in wall for a, b in zip(*w)])["median"],
        "total_ratio": ratio(sum(pooled[1]), sum(pooled[0])),
        "cpu_total_ratio": ratio(sum(pooled_cpu[1]), sum(pooled_cpu[0])),
        "cpu_median_step_ratio": report.stats([b / a for a, b in zip(*pooled_cpu)])["median"],
        # minor page faults per step, summed over the ranks (memory the allocator returned and touches again)
        "minor_faults_median": [report.stats([f for fs in faults for f in fs[i]])["median"] for i in range(2)],
        "fp32_params": launches[0][0]["fp32_params"],
    }
    print(
        f"  stage {stage:<10} {label:<20} ws={world_size} paired       {time.time() - start:6.1f} s  "
        f"kept / [] {summary['median_step_ratio']:.3f} (median of step ratios; per launch "
        f"{', '.join(f'{r:.3f}' for r in summary['launch_median_step_ratios'])})",
        flush=True)
    return {
        "model": model,
        "variant": "paired: series [] | series kept",
        "stage": stage,
        "world_size": world_size,
        "keep": [configs.describe_keep(keep_empty),
                 configs.describe_keep(keep_kept)],
        "dtype": dtype,
        "build": "patched",
        "ranks": launches[0],
        "launch_ranks": launches,
        "summary": summary
    }


def bootstrap_median_ci(groups, resamples=2000, seed=0):
    """95 % bootstrap confidence interval of the median of the values in ``groups`` (lists, one per launch;
    percentile method, seeded). Two-level: each resample draws the launches with replacement, then the values
    within each drawn launch, so that the interval covers what moves from one launch to the next as well as from
    one step to the next (with one launch, the plain bootstrap over its values)."""
    import random
    groups = [g for g in groups if g]
    if sum(len(g) for g in groups) < 2:
        return [float("nan"), float("nan")]
    rng = random.Random(seed)
    medians = []
    for _ in range(resamples):
        drawn = groups if len(groups) == 1 else [rng.choice(groups) for _ in groups]
        medians.append(report.stats([rng.choice(g) for g in drawn for _ in g])["median"])
    medians.sort()
    return [medians[int(0.025 * resamples)], medians[int(0.975 * resamples) - 1]]


def paired_table(paired):
    rows = []
    for (label, ws, stage), job in paired.items():
        s = job["summary"]
        rows.append([
            label, ws, stage, f"{s['launches']} x {s['steps'] // s['launches']}",
            f"{s['fp32_params'][0]} / {s['fp32_params'][1]}",
            f"{s['empty_median'] * 1e3:.2f}", f"{s['kept_median'] * 1e3:.2f}",
            f"{fmt_ratio(s['median_step_ratio'])} [{fmt_ratio(s['median_step_ratio_ci95'][0])}, "
            f"{fmt_ratio(s['median_step_ratio_ci95'][1])}]",
            ", ".join(fmt_ratio(r) for r in s["launch_median_step_ratios"]),
            f"{s['median_step_difference'] * 1e3:+.2f}",
            fmt_ratio(s["total_ratio"]),
            fmt_ratio(s["cpu_median_step_ratio"]),
            fmt_ratio(s["cpu_total_ratio"]), f"{s['minor_faults_median'][0]:.0f} / {s['minor_faults_median'][1]:.0f}"
        ])
    return report.markdown_table([
        "model", "world", "stage", "launches x step pairs", "fp32 params ([] / kept)", "[] step ms (median)",
        "kept step ms (median)", "kept / []: median of step ratios [95 % CI]", "kept / []: each launch's median",
        "kept - []: median of step differences, ms", "kept / []: total time",
        "CPU: median of step ratios", "CPU: total", "minor page faults per step, all ranks ([] / kept, median)"
    ], rows)


def step_times(ranks):
    """Each timed step's time: that of its slowest rank."""
    return [max(r["step_times"][s] for r in ranks) for s in range(len(ranks[0]["step_times"]))]


def cpu_times(ranks):
    """Each timed step's CPU time, summed over the ranks."""
    return [sum(r["cpu_times"][s] for r in ranks) for s in range(len(ranks[0]["cpu_times"]))]


def summarize(ranks, rounds=None):
    """Summary of a job; step times pooled over ``rounds`` (lists of ranks), the rest from the first round."""
    per_step = [t for rnd in (rounds or [ranks]) for t in step_times(rnd)]
    cpu_per_step = [t for rnd in (rounds or [ranks]) for t in cpu_times(rnd)]
    s = {"time": report.stats(per_step), "cpu": report.stats(cpu_per_step), "timed_steps": len(per_step)}
    s["peak_rss_sum"] = sum(r["peak_rss_bytes"] for r in ranks)
    s["peak_rss_max"] = max(r["peak_rss_bytes"] for r in ranks)
    if "live_tensor_bytes" in ranks[0]:
        s["live_sum"] = sum(r["live_tensor_bytes"] for r in ranks)
        s["live_peak_sum"] = sum(r["live_tensor_peak_bytes"] for r in ranks)
    if "allocator_peak_bytes" in ranks[0]:
        s["alloc_peak_sum"] = sum(r["allocator_peak_bytes"] for r in ranks)
        s["alloc_peak_max"] = max(r["allocator_peak_bytes"] for r in ranks)
        s["allocated_sum"] = sum(r["allocated_bytes"] for r in ranks)
    s["optimizer_bytes_rank_mean"] = sum(sum(r["optimizer_bytes"].values()) for r in ranks) / len(ranks)
    s["optimizer_components_rank_mean"] = {
        k: sum(r["optimizer_bytes"][k] for r in ranks) / len(ranks)
        for k in ranks[0]["optimizer_bytes"]
    }
    s["kept_elements"] = ranks[0]["kept_elements"]
    s["optimizer_class"] = ranks[0].get("optimizer_class", "?")
    s["loss_hex"] = [r["loss_hex"] for r in ranks]
    s["kept_partition_elements"] = ranks[0]["kept_partition_elements"]
    s["n_elements"] = ranks[0]["n_elements"]
    s["fp32_params"] = len(ranks[0]["fp32_params"])
    s["comm"] = {k: v[0] for k, v in ranks[0]["comm_per_step"].items()}
    s["comm_bytes"] = {k: v[1] for k, v in ranks[0]["comm_per_step"].items()}
    s["comms_logger"] = ranks[0].get("comms_logger", {})
    s["final_loss"] = sum(r["losses"][-1] for r in ranks) / len(ranks)
    return s


def theoretical_extra(stage, kept):
    """The issue's theoretical extra per rank of keeping, in bytes: a kept element's parameter and gradient are fp32
    (4 bytes) instead of bf16/fp16 (2) where the stage holds them; its fp32 master and Adam states are as large as
    before (a design may alias the master with the fp32 parameter and save them: the measured column says). Under
    ZeRO-1/2 and the BF16 optimizer the series partitions the groups of kept parameters over the data-parallel ranks
    like the others, so their masters and Adam moments take the rank's share (kept_memory.py measures it); only the
    alignment padding of the extra flat group differs.

    * parameters: +2 per kept element on every rank under ZeRO-0/1/2 (full parameters), +2 per element of the
      rank's partition under ZeRO-3 (with offload_param: in CPU memory);
    * gradients: +2 per kept element under ZeRO-0 and ZeRO-1 (full gradients until the step), +2 per element of the
      rank's partition under ZeRO-2 and ZeRO-3; none where every gradient is already accumulated in fp32 (the BF16
      optimizer, grad_accum_dtype fp32) or copied into fp32 CPU buffers (offload_optimizer).
    """
    n, part = kept["kept_elements"], kept["kept_partition_elements"]
    level = int(stage[0])
    param = 2 * (n if level < 3 else part)
    if stage in ("1-bf16opt", "2-offload", "3-offload"):
        grad = 0
    else:
        grad = 2 * (n if level < 2 else part)
    return param + grad


def design_extra_bytes(kept):
    """The extra per rank the series' ZeRO-3 design implies, held for the whole run.

    Per kept element of the rank's partition: +2 bytes in the parameter partition (fp32, not bf16), +2 in the gradient
    partition (fp32 accumulation), -4 for the fp32 master copy, which the series does not make for fp32 sub-groups (the
    optimizer updates their partitions in place). The fp32 gradients' reduce bucket holds no buffer of its own: they
    wait for their reduction in the tensors autograd made (transient, during backward).
    """
    return (2 + 2 - 4) * kept["kept_partition_elements"]


def ratio(a, b):
    return a / b if b else float("nan")


def fmt_ratio(x):
    return "n/a" if x != x else f"{x:.3f}"


def fmt_count(x):
    return str(int(x)) if float(x).is_integer() else f"{x:.2f}"


def mib(x):
    return f"{x / 2**20:.1f}"


def kib(x):
    return f"{x / 2**10:.1f}"


def section_tables(jobs, gpu):
    """Markdown tables for a list of jobs grouped as (label, world_size) -> {variant: job}."""
    out = {}
    time_rows, mem_rows, theory_rows, comm_rows, logger_rows = [], [], [], [], []
    comm_keys = sorted({k for group in jobs.values() for j in group.values() for k in j["summary"]["comm"]})
    for (label, ws, stage), group in jobs.items():
        if "pristine" not in group:
            continue
        base = group["pristine"]["summary"]
        for variant in VARIANTS:
            if variant not in group:
                continue
            j = group[variant]
            s = j["summary"]
            t = s["time"]
            share = 100.0 * s["kept_elements"] / s["n_elements"] if s["n_elements"] else 0
            time_rows.append([
                label, ws, stage, variant, j["keep"], f"{s['fp32_params']} ({share:.2f} %)",
                f"{t['min'] * 1e3:.2f} / {t['median'] * 1e3:.2f} / {t['max'] * 1e3:.2f}",
                fmt_ratio(ratio(t["median"], base["time"]["median"])),
                fmt_ratio(ratio(t["min"], base["time"]["min"])), f"{s['cpu']['median'] * 1e3:.2f}",
                fmt_ratio(ratio(s["cpu"]["median"], base["cpu"]["median"]))
            ])
            if gpu:
                mem_rows.append([
                    label, ws, stage, variant,
                    mib(s["alloc_peak_sum"]),
                    mib(s["alloc_peak_max"]),
                    fmt_ratio(ratio(s["alloc_peak_sum"], base["alloc_peak_sum"])),
                    kib(s["optimizer_bytes_rank_mean"])
                ])
            else:
                mem_rows.append([
                    label, ws, stage, variant,
                    mib(s["peak_rss_sum"]),
                    mib(s["peak_rss_max"]),
                    fmt_ratio(ratio(s["peak_rss_sum"], base["peak_rss_sum"])),
                    kib(s["live_peak_sum"]),
                    fmt_ratio(ratio(s["live_peak_sum"], base["live_peak_sum"])),
                    kib(s["optimizer_bytes_rank_mean"])
                ])
            comm_rows.append([label, ws, stage, variant] + [fmt_count(s["comm"].get(k, 0)) for k in comm_keys])
            logger_rows.append([
                label, ws, stage, variant, ", ".join(f"{k} {v}" for k, v in sorted(s["comms_logger"].items())) or "-"
            ])
        if "series kept" in group and "series []" in group:
            kept, empty = group["series kept"]["summary"], group["series []"]["summary"]
            theory = theoretical_extra(stage, kept)
            design = design_extra_bytes(kept) if stage == "3" else None
            opt_extra = kept["optimizer_bytes_rank_mean"] - empty["optimizer_bytes_rank_mean"]
            row = [
                label, ws, stage, kept["optimizer_class"], kept["kept_elements"], kept["kept_partition_elements"],
                kib(theory), "-" if design is None else kib(design),
                kib(opt_extra),
                fmt_ratio(ratio(opt_extra, theory)), "-" if design is None else
                ("yes" if opt_extra == design else f"no ({opt_extra - design:+.0f} bytes)")
            ]
            if gpu:
                extra = (kept["alloc_peak_sum"] - empty["alloc_peak_sum"]) / ws
            else:
                extra = (kept["live_peak_sum"] - empty["live_peak_sum"]) / ws
            row += [kib(extra), fmt_ratio(ratio(extra, theory)), kib(4 * kept["kept_elements"])]
            comps = kept["optimizer_components_rank_mean"]
            comps0 = empty["optimizer_components_rank_mean"]
            row.append("; ".join(f"{k} {'+' if comps[k] - comps0.get(k, 0) >= 0 else ''}"
                                 f"{kib(comps[k] - comps0.get(k, 0))}"
                                 for k in comps if comps[k] != comps0.get(k, 0)) or "-")
            theory_rows.append(row)
    out["time"] = report.markdown_table([
        "model", "world", "stage", "variant", "keep_in_fp32_modules", "fp32 params (share of elements)",
        "step ms min / median / max", "median ratio to pristine", "min ratio to pristine",
        "CPU ms per step, all ranks (median)", "CPU ratio to pristine"
    ], time_rows)
    if gpu:
        out["memory"] = report.markdown_table([
            "model", "world", "stage", "variant", "allocator peak, sum of ranks (MiB)", "max rank (MiB)",
            "ratio to pristine", "parameters and optimizer held per rank (KiB)"
        ], mem_rows)
    else:
        out["memory"] = report.markdown_table([
            "model", "world", "stage", "variant", "peak RSS, sum of ranks (MiB)", "max rank (MiB)",
            "RSS ratio to pristine", "live tensors at peak, sum of ranks (KiB)", "live tensors ratio",
            "parameters and optimizer held per rank (KiB)"
        ], mem_rows)
    out["theory"] = report.markdown_table([
        "model", "world", "stage", "optimizer", "kept elements", "kept elements per rank partition",
        "theoretical extra per rank (KiB)", "extra by the series' ZeRO-3 design (KiB)",
        "held extra per rank: parameters and optimizer (KiB)", "measured / theoretical", "held = design",
        ("allocator peak" if gpu else "live-tensor peak") + " extra per rank (KiB)", "measured / theoretical",
        "fp32 gradients in flight during backward, at most (KiB)", "held extra by component (KiB per rank)"
    ], theory_rows)
    out["comm"] = report.markdown_table(["model", "world", "stage", "variant"] +
                                        [k.replace("|", " ") for k in comm_keys], comm_rows)
    out["logger"] = report.markdown_table(["model", "world", "stage", "variant", "comms logger, one step: op count"],
                                          logger_rows)
    return out


def comm_check(jobs):
    """Lines checking the collectives rule: at most one more collective per fetch or reduce bucket that holds fp32
    parameters. A fetch of partitions of both dtypes is one all-gather of their bytes (uint8) in place of the
    training dtype's; a reduce bucket of fp32 gradients is one fp32 reduce-scatter."""
    lines = []
    for (label, ws, stage), group in jobs.items():
        if any(v not in group for v in VARIANTS) or not stage.startswith("3"):
            continue
        kept, empty, base = (group[v]["summary"]["comm"] for v in ("series kept", "series []", "pristine"))
        same_base = empty == base
        extra = {
            k: kept.get(k, 0) - empty.get(k, 0)
            for k in set(kept) | set(empty) if kept.get(k, 0) != empty.get(k, 0)
        }
        total, total_empty = ({
            kind: sum(v for k, v in c.items() if k.startswith(kind))
            for kind in ("all-gather", "reduce-scatter")
        } for c in (kept, empty))
        changes = ", ".join(f"{k.replace('|', ' ')} {v:+g}" for k, v in sorted(extra.items())) or "no change"
        line = (f"- {label}, world size {ws}, stage {stage}: series [] vs pristine: "
                f"{'identical counts' if same_base else 'DIFFERENT counts'}; kept vs []: {changes}: "
                f"{fmt_count(total['all-gather'])} all-gathers for {fmt_count(total_empty['all-gather'])} fetches "
                f"({fmt_count(kept.get('all-gather|uint8', 0))} of both dtypes, as bytes), "
                f"{fmt_count(total['reduce-scatter'])} reduce-scatters for {fmt_count(total_empty['reduce-scatter'])} "
                f"reduce buckets of the training dtype ({fmt_count(extra.get('reduce-scatter|float32', 0))} more, "
                "fp32)")
        norm = extra.get("all-reduce|float64")
        if norm:
            line += (f"; {fmt_count(norm)} more fp64 all-reduce: the gradient norm of the fp32 sub-group "
                     "(ZeRO-3 all-reduces one norm per sub-group)")
        lines.append(line)
    return lines


def extra_collectives(group):
    """Collectives per step of `series kept` minus those of `series []` (all kinds and dtypes together)."""
    if "series kept" not in group or "series []" not in group:
        return float("nan")
    kept, empty = (sum(group[v]["summary"]["comm"].values()) for v in ("series kept", "series []"))
    return kept - empty


def targets(model_jobs, share_jobs, compute_jobs, paired, stages, comm_dtype=None):
    """One line per stage and target: `[]` equals pristine (losses bitwise, same collectives), kept costs at most
    3 % per step on the compute-bound model (paired; the upper bound of the 95 % interval of the median step ratio at
    most 1.03), and the collectives it adds per step (with ``comm_dtype``, the run's communication_data_type): kept
    groups are partitioned as the others are, so that their all-gather after the step stays."""
    all_jobs = {**model_jobs, **share_jobs, **compute_jobs}
    comm = f", communication_data_type {comm_dtype}" if comm_dtype else ", default communication_data_type"
    lines = [
        "| stage | `[]` equals pristine: losses bitwise, same collectives (groups) | kept / [] on the compute-bound "
        "model, paired: median of step ratios [95 % CI] (target: upper bound <= 1.03) | extra collectives per step"
        f"{comm}, kept - [], by group |", "|---|---|---|---|"
    ]
    for stage in stages:
        groups = {key: g for key, g in all_jobs.items() if key[2] == stage}
        same = [
            g["series []"]["summary"]["loss_hex"] == g["pristine"]["summary"]["loss_hex"]
            and g["series []"]["summary"]["comm"] == g["pristine"]["summary"]["comm"] for g in groups.values()
            if "series []" in g and "pristine" in g
        ]
        equal = f"{'yes' if same and all(same) else 'NO'} ({sum(same)}/{len(same)})"
        cost = "-"
        for key, job in paired.items():
            if key[2] == stage and key in compute_jobs:
                r = job["summary"]
                upper = r["median_step_ratio_ci95"][1]
                verdict = "yes" if upper <= 1.03 else ("NO" if upper == upper else "n/a")
                cost = (f"{fmt_ratio(r['median_step_ratio'])} [{fmt_ratio(r['median_step_ratio_ci95'][0])}, "
                        f"{fmt_ratio(r['median_step_ratio_ci95'][1])}]: {verdict}")
        extras = [(key[0], key[1], extra_collectives(g)) for key, g in groups.items()]
        extra = "; ".join(f"{label} ws {ws}: " +
                          ("failed" if x != x else fmt_count(x))
                          for label, ws, x in extras)
        lines.append(f"| {stage} | {equal} | {cost} | {extra or '-'} |")
    return lines


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="few steps, world size 2, one share: a smoke run")
    parser.add_argument("--out", default=str(launch.ROOT / "out" / "bench"), help="folder for results.{json,md}")
    parser.add_argument("--workdir", default=None, help="folder for the jobs (default: OUT/jobs)")
    parser.add_argument("--stages",
                        default=",".join(configs.DEFAULT_STAGES),
                        help="comma-separated, of %s (default: %%(default)s); also %s" %
                        (", ".join(configs.STAGES), ", ".join(configs.MORE_STAGES)))
    parser.add_argument("--world-sizes", default="2", help="comma-separated (default: %(default)s)")
    parser.add_argument("--models", default="deepseek_v4,gpt_oss")
    parser.add_argument("--shares",
                        default=None,
                        help='listed shares of the synthetic model (default 0.001,0.01,0.1; "" for none)')
    parser.add_argument("--gpt-oss-mode", choices=("list", "fp16"), default="list")
    parser.add_argument("--steps", type=int, default=None, help="timed steps (default 20; --quick: 4)")
    parser.add_argument("--warmup", type=int, default=None, help="untimed steps first (default 3; --quick: 1)")
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=32)
    parser.add_argument("--synthetic-dim", type=int, default=256)
    parser.add_argument("--synthetic-layers", type=int, default=4)
    parser.add_argument("--compute-dim",
                        type=int,
                        default=None,
                        help="width of the compute-bound synthetic model (1 %% listed, world size 2, or the first of "
                        "--world-sizes without 2; default 1024, --quick: 0; 0: none)")
    parser.add_argument("--compute-seq",
                        type=int,
                        default=128,
                        help="tokens per sample of the compute-bound model (default %(default)s: with the micro batch "
                        "of 4, its forward and backward outweigh the optimizer step and the gradients' reduction)")
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--communication-data-type",
                        choices=("fp32", "bf16", "fp16"),
                        default=None,
                        help="set communication_data_type in every config of the run (pristine, [] and kept "
                        "alike; default: left out, DeepSpeed's default: the training dtype)")
    parser.add_argument("--no-paired",
                        action="store_true",
                        help="skip the paired timing (series [] and kept as two engines in the same processes)")
    parser.add_argument("--paired-steps",
                        type=int,
                        default=None,
                        help="timed step pairs of the paired timing (default 100; --quick: 4), in each launch")
    parser.add_argument("--paired-launches",
                        type=int,
                        default=1,
                        help="launches of the paired timing per row group (default 1); the interval then covers "
                        "what moves from one launch to the next (a two-level bootstrap)")
    parser.add_argument("--paired-malloc",
                        choices=("steady", "default"),
                        default=None,
                        help="glibc's malloc in the paired timing on the CPU: steady (fixed mmap and trim thresholds, "
                        "the default on the CPU; run_paired says why) or default (as glibc sets them; on a GPU)")
    parser.add_argument("--rounds",
                        type=int,
                        default=1,
                        help="run each row group's three variants this many times, interleaved; step times pooled")
    args = parser.parse_args()
    args.stages = configs.parse_stages(args.stages)
    args.failures = []
    args.config_overrides = ({
        "communication_data_type": args.communication_data_type
    } if args.communication_data_type else None)
    if args.compute_dim is None:
        args.compute_dim = 0 if args.quick else 1024
    if args.shares is None:
        args.shares = "0.01" if args.quick else "0.001,0.01,0.1"
    args.world_sizes = [int(w) for w in args.world_sizes.split(",") if w]
    args.shares = [float(s) for s in args.shares.split(",") if s]
    args.steps = args.steps if args.steps is not None else (4 if args.quick else 20)
    args.warmup = args.warmup if args.warmup is not None else (1 if args.quick else 3)
    if args.paired_steps is None:
        args.paired_steps = 4 if args.quick else 100
    if args.paired_malloc is None:
        args.paired_malloc = "default" if launch.on_gpu() else "steady"
    hf_models = [m for m in args.models.split(",") if m]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    args.workdir = args.workdir or str(out / "jobs")

    machine = report.machine_description()
    gpu = launch.on_gpu()
    command = " ".join(shlex.quote(a) for a in [Path(sys.executable).name, *sys.argv])
    started = time.time()
    notes = []
    if not gpu:
        over = [ws for ws in args.world_sizes if ws > machine["cores_usable"]]
        if over:
            notes.append(f"World size {', '.join(map(str, over))} oversubscribes this machine's "
                         f"{machine['cores_usable']} usable cores (one process per rank, OMP_NUM_THREADS=1): ranks "
                         "time-share cores, so those step times measure scheduling as much as DeepSpeed.")
    notes.append("Step times on a shared machine carry noise from other processes; compare the ratios of one "
                 "row group (its variants run back to back) rather than absolute times. The min ratio and the CPU "
                 "time per step (CPU seconds of all ranks' processes, which other processes' load and waiting in "
                 "collectives do not add to) are the least noise-sensitive.")
    series = launch.dev_tree_state()
    comm_dtype = (f"communication_data_type: {args.communication_data_type} (set in every config: pristine, [] "
                  "and kept)" if args.communication_data_type else
                  "communication_data_type: left out (DeepSpeed's default: the training dtype)")
    print(f"command: {command}\nmachine: {report.machine_line(machine)}\nseries: build/deepspeed at {series}\n"
          f"{comm_dtype}")
    for n in notes:
        print(f"note: {n}")

    model_jobs, share_jobs, compute_jobs, paired = {}, {}, {}, {}
    ws2 = 2 if 2 in args.world_sizes else args.world_sizes[0]
    # (key, model, world size, what the ranks need, job folder name) of each row group
    groups = {"models": [], "shares": [], "compute": []}
    for model in hf_models:
        model_dir = models.save_hf_model(model, Path(args.workdir) / "models" / model, seed=args.seed)
        for ws in args.world_sizes:
            groups["models"].append((MODEL_LABELS[model], model, ws, {"model_dir": str(model_dir)}, model))
    for share in args.shares:
        keep = models.keep_elements_for_share(share, args.synthetic_dim, args.synthetic_layers)
        extra = dict(dim=args.synthetic_dim, layers=args.synthetic_layers, keep_per_block=keep)
        groups["shares"].append(
            (f"synthetic, {100 * share:g} % listed", "tiny_net", ws2, extra, f"synthetic_{share:g}"))
    if args.compute_dim:
        keep = models.keep_elements_for_share(0.01, args.compute_dim, args.synthetic_layers)
        extra = dict(dim=args.compute_dim, layers=args.synthetic_layers, keep_per_block=keep, seq=args.compute_seq)
        # at world size 2 by default; at the first of --world-sizes when 2 is not among them (e.g. 1 on one GPU)
        groups["compute"].append((f"synthetic hidden {args.compute_dim}, 1 % listed", "tiny_net", ws2, extra,
                                  f"synthetic_{args.compute_dim}"))
    for stage in args.stages:
        for kind, jobs in (("models", model_jobs), ("shares", share_jobs), ("compute", compute_jobs)):
            for label, model, ws, extra, name in groups[kind]:
                jobs[(label, ws, stage)] = run_group(args, model, ws, extra, name, stage)
        # Paired timing at one world size: [] and kept in the same processes, alternating steps.
        if not args.no_paired:
            for label, model, ws, extra, name in groups["models"] + groups["shares"] + groups["compute"]:
                if ws == ws2 and (label, ws, stage) not in paired:
                    try:
                        paired[(label, ws, stage)] = run_paired(args, model, ws, extra, name, stage)
                    except RuntimeError as err:
                        failed(args, f"stage {stage}, {label}, world size {ws}, paired", err)

    elapsed = time.time() - started
    series_end = launch.dev_tree_state()
    if series_end != series:
        notes.append(f"The dev tree changed during the run ({series} -> {series_end}): the series rows may mix two "
                     "versions; rerun for clean numbers.")
    md = [
        "# keep_in_fp32_modules in every ZeRO stage: cost against pristine DeepSpeed 0.19.8", "",
        f"Command: `{command}`  ", f"Machine: {report.machine_line(machine)}  ",
        f"Series: the dev tree `build/deepspeed` at {series}; pristine: DeepSpeed 0.19.8 from `build/pristine`  ",
        f"Device: {'CUDA GPU, NCCL, allocator peak' if gpu else 'CPU (DS_ACCELERATOR=cpu), gloo, peak RSS'}  ",
        f"Collectives: {comm_dtype}  ",
        f"Date: {datetime.datetime.now().isoformat(timespec='seconds')}; the whole run took {elapsed / 60:.1f} min",
        "", "Stages: " + "; ".join(f"`{st}`: {configs.STAGES.get(st) or configs.MORE_STAGES[st]}"
                                   for st in args.stages) + ".", "",
        f"Each row: {'bf16' if args.gpt_oss_mode == 'list' else 'bf16 (gpt-oss: fp16)'}, AdamW (torch), gradient "
        f"clipping 1.0, micro batch {args.micro_batch} x {args.seq} tokens per rank"
        f"{f' ({args.micro_batch} x {args.compute_seq} for the compute-bound model)' if args.compute_dim else ''}; "
        "ZeRO-1/2: reduce and all-gather "
        "buckets of 50,000 elements; ZeRO-3: stage3_param_persistence_threshold 0 (every parameter is fetched), "
        f"reduce and prefetch buckets of 50,000 elements; {args.warmup} warm-up steps, then {args.steps} timed steps"
        f"{f', in each of {args.rounds} interleaved rounds (pooled)' if args.rounds > 1 else ''}; a step's time is "
        "its slowest rank's. " + (f"`communication_data_type: {args.communication_data_type}` in every config. "
                                  if args.communication_data_type else "") +
        "One process per rank (torchrun). The variants: `pristine` = DeepSpeed 0.19.8 with its default config; "
        "`series []` = the patch series with `keep_in_fp32_modules: []`; `series kept` = the series keeping the "
        "listed parameters in fp32, with: " + "; ".join(f"{MODEL_LABELS[m]}: {kept_description(m, args.gpt_oss_mode)}"
                                                        for m in hf_models + ["tiny_net"]) + ".", ""
    ]
    md += [f"Note: {n}" for n in notes] + [""]
    results = {
        "command": command,
        "machine": machine,
        "series": series,
        "series_end": series_end,
        "gpu": gpu,
        "args": vars(args),
        "communication_data_type": args.communication_data_type,
        "notes": notes,
        "jobs": []
    }
    for title, jobs in (("Models", model_jobs), ("Listed share (synthetic model)", share_jobs),
                        ("Compute-bound (synthetic model, hidden %d)" % args.compute_dim, compute_jobs)):
        if not jobs:
            continue
        tables = section_tables(jobs, gpu)
        md += [f"## {title}", "", "### Step time", "", tables["time"], ""]
        md += ["### Peak memory", "", tables["memory"], ""]
        md += [
            "### Memory against the theoretical extra", "",
            "Theoretical extra per rank (the issue's accounting; `theoretical_extra` in run.py): a kept element's "
            "parameter and gradient take 4 bytes instead of 2 where the stage holds them, its fp32 master and Adam "
            "states are as large as before. Parameters: +2 bytes per kept element under ZeRO-0/1/2 (full parameters "
            "on every rank), +2 per element of the rank's partition under ZeRO-3 (CPU memory with offload_param). "
            "Gradients: +2 per kept element under ZeRO-0/1 (full gradients until the step), +2 per partition element "
            "under ZeRO-2/3, none where every gradient is already fp32 (the BF16 optimizer, offload_optimizer). "
            "A design that makes the fp32 parameter its own master saves 4 bytes per master element. "
            "Measured: `series kept` minus `series []`, per rank; the held bytes count each storage once: the "
            "parameters (ZeRO-3: their partitions), the torch optimizer's states, then every buffer of DeepSpeed's "
            "optimizer wrapper, by attribute name (`counters.held_bytes`); " +
            ("the allocator peak is the GPU allocator's."
             if gpu else "the live-tensor peak is a census of all tensor storages Python reaches, during backward "
             "(ZeRO-1/2/3: each time a gradient is about to enter its reduce bucket), after backward and after the "
             "step of one measured step (peak RSS is too coarse for a few KiB)."), "",
            "ZeRO-3, the series' design (stage3.py): the fp32 sub-groups need no fp32 master copy (-4 bytes per kept "
            "partition element), which pays for the 2 + 2 more bytes of their parameter and gradient partitions, so "
            "`extra by the series' ZeRO-3 design` = (2 + 2 - 4) x partition elements = 0, and `held = design` "
            "checks it to the byte. Their reduce bucket holds no buffer of its own: during backward, their full fp32 "
            "gradients wait for their bucket's reduction in the tensors autograd made, at most 4 bytes per kept "
            "element of the full size (the `in flight` column), and are freed once reduce-scattered into the fp32 "
            "partitions; the training dtype's gradients wait in pristine's own bucket, which the series leaves as "
            "it is. With `communication_data_type: fp32` the kept gradients wait in that bucket too, which is "
            "fp32 then.", "", tables["theory"], ""
        ]
        md += [
            "### Collectives per step, by kind and dtype", "",
            "Counted at DeepSpeed's communication backend over the timed steps, per rank (rank 0).", "",
            tables["comm"], ""
        ]
        md += comm_check(jobs) + [""]
        md += ["DeepSpeed's comms logger (by op name, no dtype), one extra step:", "", tables["logger"], ""]
        for (label, ws, stage), group in jobs.items():
            for variant, job in group.items():
                job_rec = {k: v for k, v in job.items() if k not in ("ranks", "rounds")}
                job_rec["label"] = label
                job_rec["ranks"] = job["ranks"]
                job_rec["step_times_by_round"] = [step_times(r) for r in job["rounds"]]
                results["jobs"].append(job_rec)
    if paired:
        md += [
            "## Paired timing: series kept against series []", "",
            "The step-time tables above compare separate jobs, one after another, so the machine's load in each "
            "job's minute is part of the ratio. Here `series []` and `series kept` are two engines in the same "
            "processes, built from the same weights, trained on the same batches in alternating steps ([] then kept, "
            "then kept then [] ...), so the load falls on both alike. Pristine cannot share a process with the "
            "series; with `[]` the series runs the same collectives and gives bitwise identical results "
            f"(compare_pristine.py), so `kept / []` is the cost of keeping. {args.warmup} warm-up steps, then "
            f"{args.paired_steps} timed steps per engine, in each of {args.paired_launches} launch"
            f"{'es (each its own seed)' if args.paired_launches > 1 else ''}; the interval is a bootstrap over the "
            f"{'launches, then the step pairs of each drawn launch' if args.paired_launches > 1 else 'step pairs'}. "
            + ("glibc's malloc: `MALLOC_MMAP_THRESHOLD_=4000000000 MALLOC_TRIM_THRESHOLD_=4000000000` for both "
               "engines (`--paired-malloc steady`): on the CPU, PyTorch allocates every tensor with glibc's malloc, "
               "whose dynamic threshold returns some large temporaries to the OS and maps them again on the next "
               "step, as the sizes and order of the frees happen to fall, so that one engine of a pair can fault "
               "thousands of pages per step more than the other; fixed thresholds keep freed memory in the process, "
               "as a caching allocator does (CUDA's). `--paired-malloc default` leaves glibc as it is; the page "
               "faults column shows what each engine faulted." if args.paired_malloc == "steady" else
               "glibc's malloc as it is (`--paired-malloc default`)."), "",
            paired_table(paired), ""
        ]
        for (label, ws, stage), job in paired.items():
            rec = {k: v for k, v in job.items()}
            rec["label"] = label
            results["jobs"].append(rec)
    md += ["## Targets", ""] + targets(model_jobs, share_jobs, compute_jobs, paired, args.stages,
                                       args.communication_data_type) + [""]
    if args.failures:
        md += ["## Jobs that failed (left out of the tables)", ""] + [f"- {f}" for f in args.failures] + [""]
    (out / "results.md").write_text("\n".join(md) + "\n")
    (out / "results.json").write_text(json.dumps(results, indent=1, default=str))
    print("\n".join(md))
    print(f"\nwritten: {out / 'results.md'}, {out / 'results.json'} ({elapsed / 60:.1f} min)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
