# Copyright (c) DeepSpeed Team.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""The optimizer memory of the kept fp32 groups per rank, against their theoretical share, in ZeRO-1, ZeRO-2 and the
BF16 optimizer (and ZeRO-3 for reference), at data-parallel sizes 2 and 4.

ZeRO-1/2 and the BF16 optimizer split each param group by dtype into flat groups; the groups of parameters kept in
fp32 are partitioned over the data-parallel ranks like the others, so each rank should hold its share of their fp32
masters and Adam states: 4 + 4 + 4 = 12 bytes per kept element, divided by dp (ZeRO-2 and ZeRO-3 also hold the
fp32 gradient partition: 16 bytes / dp). For each stage and dp it trains (bf16, torch AdamW, a few steps; one
torchrun per job, gloo on the CPU) pristine DeepSpeed 0.19.8, the series with ``keep_in_fp32_modules: []`` and the
series keeping the listed parameters, and reads on every rank, group by group, what the optimizer holds: the flat
fp32 master partitions (ZeRO-1/2 ``single_partition_of_fp32_groups``, the BF16 optimizer
``fp32_groups_flat_partition``, ZeRO-3 ``fp32_partitioned_groups_flat``), the torch optimizer's states of each
(exp_avg, exp_avg_sq), and the fp32 gradient each held when the torch optimizer stepped (the gradient partition),
with the groups the series marks as kept (``is_kept_in_fp32`` of a group's first parameter, the BF16 optimizer's
``group_kept_in_fp32``).

Models (``--models``): ``lm_head`` (default), a small language model whose output projection ``lm_head``
(64 x 8192, 524,288 of its 545,152 elements; models.make_lm_head_net) is listed (``["lm_head"]``), as in the issue;
``synthetic``, the run.py synthetic model with ``--share`` of its elements listed (``["keep"]``).

    .venv/bin/python benchmarks/kept_memory.py --out out/kept-memory
    .venv/bin/python benchmarks/kept_memory.py --stages 2 --world-sizes 2 --out out/kept-memory-z2

Writes OUT/results.md (the tables, the command) and OUT/results.json (every rank's groups).
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
DEFAULT_STAGES = ("1", "2", "1-bf16opt", "3")
STAGE_LABELS = {"1": "ZeRO-1", "2": "ZeRO-2", "1-bf16opt": "BF16 optimizer", "3": "ZeRO-3 (reference)"}


def bytes_per_kept_element(stage):
    """The theoretical optimizer bytes per kept element, before dividing by dp: fp32 master 4, exp_avg 4,
    exp_avg_sq 4; ZeRO-2 and ZeRO-3 also hold the fp32 gradient partition (4)."""
    return 16 if stage in ("2", "3") else 12


def counts_gradient(stage):
    return bytes_per_kept_element(stage) == 16


def model_spec(args, model):
    """(spec fields, keep list of `series kept`, description) of a model."""
    if model == "lm_head":
        return (dict(model="lm_head_net", dim=64, vocab_out=8192, layers=1), ["lm_head"],
                "lm_head_net: embedding 256 x 64, one block (Linear 64 x 64, LayerNorm), LayerNorm, lm_head "
                "Linear(64, 8192); listed: [\"lm_head\"]")
    if model == "synthetic":
        keep = models.keep_elements_for_share(args.share, args.synthetic_dim, args.synthetic_layers)
        return (dict(model="tiny_net", dim=args.synthetic_dim, layers=args.synthetic_layers, keep_per_block=keep),
                ["keep"], f"synthetic (run.py's), hidden {args.synthetic_dim}, {args.synthetic_layers} blocks, "
                f"{100 * args.share:g} % of the elements listed: [\"keep\"]")
    raise ValueError(model)


def run_job(args, model, stage, ws, variant):
    fields, keep_list, _ = model_spec(args, model)
    build = "pristine" if variant == "pristine" else "patched"
    keep = configs.UNSET if variant == "pristine" else ([] if variant == "series []" else keep_list)
    config = configs.ds_config(args.micro_batch, ws, keep=keep, dtype="bf16", stage=stage)
    spec = dict(dtype="bf16",
                micro_batch=args.micro_batch,
                seq=args.seq,
                seed=args.seed,
                warmup=0,
                steps=args.steps,
                config=config,
                kept_memory=True,
                **fields)
    job_dir = Path(args.workdir) / model / f"zero{stage}" / f"ws{ws}" / variant.replace(" ", "_").replace(
        "[]", "empty")
    start = time.time()
    ranks = launch.launch(spec, build, ws, job_dir)
    print(f"  {model:<10} stage {stage:<10} dp={ws} {variant:<12} {time.time() - start:6.1f} s", flush=True)
    return ranks


def rank_totals(rank, stage, kept_only):
    """Bytes one rank holds for the kept groups (``kept_only``) or all groups: masters, Adam states, the fp32
    gradient partition at the step; and the master elements."""
    groups = [g for g in rank["optimizer_partitions"]["groups"] if g["kept"] or not kept_only]
    return {
        "groups": len(groups),
        "master_numel": sum(g["master_numel"] for g in groups),
        "masters": sum(g["master_bytes"] for g in groups),
        "states": sum(g["state_bytes"] for g in groups),
        "grads": sum(g["grad_bytes"] for g in groups),
        "full_grad_buffers": sum(g.get("full_grad_buffer_bytes", 0) for g in groups),
        "group_full_numel": sum(g["group_full_numel"] for g in groups),
        "master_is_param": [g.get("master_is_param_partition") for g in groups],
    }


def mib(x):
    return f"{x / 2**20:.3f}"


def partition_check(kept_totals_by_rank, kept_elements, ws):
    """Whether the kept groups are partitioned: each rank's master elements are about kept / dp (at most one
    alignment unit of padding per group and rank more), and the ranks' partitions add up to the group, not dp times
    it."""
    per_rank = [t["master_numel"] for t in kept_totals_by_rank]
    total = sum(per_rank)
    groups = max(t["groups"] for t in kept_totals_by_rank)
    slack = 64 * max(1, groups)  # alignment padding per group (nccl_start_alignment_factor x dp, and param alignment)
    ok = all(n <= -(-kept_elements // ws) + slack for n in per_rank) and total < kept_elements + ws * slack
    whole = all(n >= kept_elements for n in per_rank)
    if ok:
        return f"yes (sum over ranks {total:,} for {kept_elements:,})"
    return ("NO: held whole on every rank" if whole else "NO") + f" (per rank {per_rank}, sum {total:,})"


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=str(launch.ROOT / "out" / "kept-memory"))
    parser.add_argument("--workdir", default=None, help="folder for the jobs (default: OUT/jobs)")
    parser.add_argument("--stages", default=",".join(DEFAULT_STAGES), help="comma-separated (default: %(default)s)")
    parser.add_argument("--world-sizes", default="2,4", help="data-parallel sizes (default: %(default)s)")
    parser.add_argument("--models", default="lm_head", help="lm_head, synthetic (default: %(default)s)")
    parser.add_argument("--share", type=float, default=0.1, help="listed share of the synthetic model")
    parser.add_argument("--synthetic-dim", type=int, default=256)
    parser.add_argument("--synthetic-layers", type=int, default=4)
    parser.add_argument("--steps", type=int, default=2, help="training steps (default %(default)s)")
    parser.add_argument("--micro-batch", type=int, default=2)
    parser.add_argument("--seq", type=int, default=16)
    parser.add_argument("--seed", type=int, default=1234)
    args = parser.parse_args()
    stages = configs.parse_stages(args.stages)
    world_sizes = [int(w) for w in args.world_sizes.split(",") if w]
    model_names = [m for m in args.models.split(",") if m]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    args.workdir = args.workdir or str(out / "jobs")
    command = " ".join(shlex.quote(a) for a in [Path(sys.executable).name, *sys.argv])
    machine = report.machine_description()
    series = launch.dev_tree_state()
    print(f"command: {command}\nmachine: {report.machine_line(machine)}\nseries: build/deepspeed at {series}",
          flush=True)
    started = time.time()

    results, failures = {}, []
    for model in model_names:
        for stage in stages:
            for ws in world_sizes:
                for variant in VARIANTS:
                    try:
                        results[(model, stage, ws, variant)] = run_job(args, model, stage, ws, variant)
                    except RuntimeError as err:
                        lines = [line.strip() for line in str(err).splitlines() if "Error" in line]
                        reason = (lines[-1] if lines else str(err).splitlines()[0])[:400]
                        print(f"  FAILED: {model} stage {stage} dp {ws} {variant}: {reason}", flush=True)
                        failures.append(f"{model}, stage {stage}, dp {ws}, {variant}: {reason}")

    kept_rows, total_rows, checks = [], [], []
    for model in model_names:
        for stage in stages:
            for ws in world_sizes:
                ranks = results.get((model, stage, ws, "series kept"))
                if not ranks:
                    continue
                kept_elements = ranks[0]["kept_elements"]
                per_elem = bytes_per_kept_element(stage)
                theory = kept_elements * per_elem / ws
                kept_totals = [rank_totals(r, stage, kept_only=True) for r in ranks]
                for r, t in zip(ranks, kept_totals):
                    measured = t["masters"] + t["states"] + (t["grads"] if counts_gradient(stage) else 0)
                    kept_rows.append([
                        model, STAGE_LABELS.get(stage, stage), ws, r["rank"], r["optimizer_class"],
                        f"{kept_elements:,}", f"{t['master_numel']:,}",
                        mib(t["masters"]),
                        mib(t["states"]),
                        mib(t["grads"]) + ("" if counts_gradient(stage) else " (not counted)"),
                        mib(measured), f"{mib(theory)} ({per_elem} B x {kept_elements:,} / {ws})",
                        f"{measured / theory:.4f}",
                        mib(kept_elements * per_elem)
                    ])
                check = partition_check(kept_totals, kept_elements, ws)
                extra = ""
                if stage.startswith("3"):
                    extra = ("; the kept masters are the fp32 parameter partitions themselves"
                             if all(all(t["master_is_param"]) for t in kept_totals) else
                             "; the kept masters are copies")
                if stage == "1-bf16opt":
                    extra = (f"; besides, every group's full flat fp32 gradient buffer (not partitioned, as for every "
                             f"group of the BF16 optimizer): kept groups {mib(kept_totals[0]['full_grad_buffers'])} "
                             "MiB per rank")
                if stage == "1":
                    extra = ("; besides, ZeRO-1 keeps the full fp32 gradients of the kept parameters until the step "
                             f"({mib(4 * kept_elements)} MiB per rank, as it keeps full bf16 gradients of the others)")
                checks.append(f"- {model}, {STAGE_LABELS.get(stage, stage)}, dp {ws}: kept groups partitioned: "
                              f"{check}{extra}")
                for variant in VARIANTS:
                    vr = results.get((model, stage, ws, variant))
                    if not vr:
                        continue
                    totals = [rank_totals(r, stage, kept_only=False) for r in vr]
                    kept_part = [rank_totals(r, stage, kept_only=True) for r in vr]
                    for r, t, k in zip(vr, totals, kept_part):
                        total = t["masters"] + t["states"] + (t["grads"] if counts_gradient(stage) else 0)
                        total_rows.append([
                            model, STAGE_LABELS.get(stage, stage), ws, variant, r["rank"], t["groups"],
                            f"{t['master_numel']:,}",
                            mib(t["masters"]),
                            mib(t["states"]),
                            mib(t["grads"]),
                            mib(total),
                            mib(k["masters"] + k["states"] + (k["grads"] if counts_gradient(stage) else 0))
                        ])
    elapsed = time.time() - started
    series_end = launch.dev_tree_state()
    descriptions = "; ".join(f"`{m}`: {model_spec(args, m)[2]}" for m in model_names)
    md = [
        "# Kept fp32 groups: optimizer memory per rank against the theoretical share", "",
        f"Command: `{command}`  ", f"Machine: {report.machine_line(machine)}  ",
        f"Series: the dev tree `build/deepspeed` at {series}"
        f"{'' if series_end == series else f' (changed during the run: {series_end})'}; pristine: DeepSpeed 0.19.8 "
        "from `build/pristine`  ", f"Date: {datetime.datetime.now().isoformat(timespec='seconds')}; "
        f"the run took {elapsed / 60:.1f} min", "",
        f"Models: {descriptions}. bf16, torch AdamW, gradient clipping 1.0, micro batch {args.micro_batch} x "
        f"{args.seq} tokens, {args.steps} steps, one process per rank (torchrun, gloo on the CPU). ZeRO-1/2: reduce "
        "and all-gather buckets of 50,000 elements; the BF16 optimizer: ZeRO-1 with `data_types.grad_accum_dtype: "
        "fp32`; ZeRO-3: `stage3_param_persistence_threshold: 0`.", "",
        "Theoretical share per rank: kept elements x bytes / dp, with 12 bytes per kept element (fp32 master 4, "
        "Adam exp_avg 4, exp_avg_sq 4) for ZeRO-1 and the BF16 optimizer, 16 for ZeRO-2 and ZeRO-3 (also the fp32 "
        "gradient partition). Measured: what the rank's optimizer holds for the groups the series marks as kept: "
        "the flat fp32 master partitions (elements and bytes), the torch optimizer's states of them, and the fp32 "
        "gradient each held when the torch optimizer stepped (counted where the theory counts it). The masters "
        "include each flat group's alignment padding. `held whole` is what a rank held before the kept groups were "
        "partitioned (the theory's bytes x kept elements, on every rank).", "",
        "## Kept groups, per rank (series kept)", "",
        report.markdown_table([
            "model", "optimizer", "dp", "rank", "class", "kept elements", "kept master elements on the rank",
            "masters (MiB)", "Adam states (MiB)", "fp32 grad partition at the step (MiB)", "measured (MiB)",
            "theoretical share (MiB)", "measured / theoretical", "held whole (MiB)"
        ], kept_rows), ""
    ] + checks + [
        "", "## All groups, per rank: pristine 0.19.8, series [], series kept", "",
        "Every flat group of the optimizer; `total` = masters + Adam states (+ the fp32 gradient partition at the "
        "step for ZeRO-2 and ZeRO-3), `kept part` = the same for the kept groups only.", "",
        report.markdown_table([
            "model", "optimizer", "dp", "variant", "rank", "flat groups", "master elements", "masters (MiB)",
            "Adam states (MiB)", "fp32 grad partitions at the step (MiB)", "total (MiB)", "kept part (MiB)"
        ], total_rows), ""
    ]
    if failures:
        md += ["## Jobs that failed", ""] + [f"- {f}" for f in failures] + [""]
    (out / "results.md").write_text("\n".join(md) + "\n")
    (out / "results.json").write_text(
        json.dumps(
            {
                "command": command,
                "series": series,
                "series_end": series_end,
                "machine": machine,
                "jobs": [{
                    "model": k[0],
                    "stage": k[1],
                    "world_size": k[2],
                    "variant": k[3],
                    "ranks": [{
                        key: r.get(key)
                        for key in ("rank", "build", "optimizer_class", "kept_elements", "n_elements", "fp32_params",
                                    "optimizer_partitions", "losses")
                    } for r in v]
                } for k, v in results.items()]
            },
            indent=1))
    print("\n".join(md))
    print(f"\nwritten: {out / 'results.md'}, {out / 'results.json'} ({elapsed / 60:.1f} min)")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
