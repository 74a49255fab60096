# Copyright (c) DeepSpeed Team.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""No regression, shown: the series with nothing kept in fp32 trains bit for bit like pristine DeepSpeed 0.19.8,
in every ZeRO stage (0, 1, 2, 3, 3 with parameter and optimizer offload) and every precision it trains in.

Runs each case twice, side by side, with the same weights, data and config: once with pristine DeepSpeed 0.19.8
(``PYTHONPATH=build/pristine``, unpacked from the sdist ``make setup`` cached on first use) and once with the
patched dev tree (the venv's editable install). Each run is ``--steps`` training steps (torch AdamW, gradient
clipping) with ``--world-size`` ranks, one process per rank (torchrun; gloo on the CPU, NCCL on CUDA), in each
stage of ``--stages`` (configs.py: ``0`` no ZeRO, the engine's fp16/bf16 optimizer (fp16: the unfused one, with
torch Adam); ``1``, ``2``; ``3``; ``3-offload``: ``offload_param`` and ``offload_optimizer`` to the CPU; also
``1-bf16opt``, ``2-offload``, ``3-offload-param``, ``0-fusedadam``: stage 0 with the config's Adam, FusedAdam in
the engine's ``FP16_Optimizer``; ``3-hpz``: ZeRO++'s hierarchical partitioning in groups of 2 ranks) and each
precision of ``--precisions`` (default all four):

* ``bf16``: ``"bf16": {"enabled": true}``, bf16 weights and fp32 masters;
* ``fp16``: ``"fp16": {"enabled": true}`` with dynamic loss scaling (initial scale 2^8, window 100); on a CPU
  whose DeepSpeed accelerator reports fp16 unsupported, the workers declare it supported (as the tests'
  ``_allow_fp16_on_cpu`` does);
* ``fp32``: no bf16/fp16 section, fp32 weights;
* ``autocast``: no bf16/fp16 section, ``"torch_autocast": {"enabled": true, "dtype": "bfloat16"}``: fp32 weights,
  forward under ``torch.autocast`` (the Linear layers' parameters communicated in bf16).

A stage and precision that pristine 0.19.8 itself cannot run (its job fails) is reported as not supported and not
compared. The cases, in each stage and precision:

* tiny DeepSeek-V4 (random init, seeded, ``save_pretrained`` once, ``from_pretrained`` under ``HfDeepSpeedConfig``,
  so that ``zero.Init`` runs under ZeRO-3), ``data_types.keep_in_fp32_modules: []``;
* a small plain torch model that lists nothing, ``keep_in_fp32_modules`` left at its default (``"auto"``);
* at stage 3 only, a small torch MoE model whose MoE blocks AutoEP replaces (``expert_parallel``, 2 experts over
  the ``--world-size`` ranks, which must be 2), listing nothing: AutoEP's router as stock;

and once, in bf16 (fp16 if bf16 is not among ``--precisions``; neither: no control) at stage 3 (or the first of
``--stages``), a control that is not part of the verdict (``--no-control`` skips it): the tiny DeepSeek-V4 with the
default ``"auto"``, where the series keeps its 32 listed parameters in fp32 and must differ from pristine; it shows
the comparison can see a difference.

Recorded: every step's loss on every rank, and after the last step every parameter twice: its fp32 master
(``safe_get_full_fp32_param``; without ZeRO, the fp32 copy of the engine's fp16/bf16 optimizer, or the parameter
itself in fp32) and its full training-dtype value (``zero.GatheredParameters`` under ZeRO-3). Compared bitwise.
In fp32 and under autocast, comparing the masters bitwise covers whether the series' master is a separate copy or
the partition itself only through the values it ends with. Exit status 1 if a case other than the control
differs, 2 if a run of the series fails.

Most of a job's time is starting its ranks, so each run is 10 steps (``--steps``). One stage is 16 jobs (8 cases,
each with both builds), about 12 s each on 2 idle cores: ``--stages 3`` (the former default) took 3-4 minutes
there; the default, five stages and the control, is 82 jobs: about 16-20 minutes on 2 idle cores (estimated from
that; not measured on an idle machine).

    .venv/bin/python benchmarks/compare_pristine.py                         # five stages, four precisions
    .venv/bin/python benchmarks/compare_pristine.py --stages 3 --precisions fp32,autocast
"""

import argparse
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

PRECISIONS = {
    # name: what the config says about the precision
    "bf16": '"bf16": {"enabled": true}',
    "fp16": '"fp16": {"enabled": true}, dynamic loss scaling',
    "fp32": "no bf16/fp16 section",
    "autocast": '"torch_autocast": {"enabled": true, "dtype": "bfloat16"}, fp32 weights',
}

CASES = [
    # name, model, keep_in_fp32_modules, control
    ("DeepSeek-V4 (tiny), keep_in_fp32_modules: []", "deepseek_v4", [], False),
    ("torch model listing nothing, default (\"auto\")", "tiny_net", configs.UNSET, False),
    # at ZeRO-3 only (AUTOEP_STAGES): AutoEP's router, with nothing listed
    ("AutoEP MoE (torch), default (\"auto\")", "autoep_net", configs.UNSET, False),
]
AUTOEP_STAGES = ("3", )
CONTROL = ("control: DeepSeek-V4 (tiny), default (\"auto\")", "deepseek_v4", configs.UNSET, True)


def parse_precisions(text):
    precisions = [p.strip() for p in text.split(",") if p.strip()]
    unknown = [p for p in precisions if p not in PRECISIONS]
    if unknown or not precisions:
        raise argparse.ArgumentTypeError(f"precisions are a comma-separated subset of {','.join(PRECISIONS)}, "
                                         f"got {text!r}")
    return list(dict.fromkeys(precisions))


def compare_runs(pristine, patched, params_pristine, params_patched):
    """Per-step losses (all ranks) and final parameters (fp32 masters and gathered values), bitwise."""
    steps = len(pristine[0]["losses"])
    # steps counted from 1; a step differs when its loss differs on any rank
    differing_steps = [
        s + 1 for s in range(steps) if not all(a["loss_hex"][s] == b["loss_hex"][s] for a, b in zip(pristine, patched))
    ]
    loss_diff = max(abs(x - y) for a, b in zip(pristine, patched) for x, y in zip(a["losses"], b["losses"]))
    out = {
        "steps": steps,
        "same_steps": steps - len(differing_steps),
        "differing_steps": differing_steps,
        "loss_max_abs_diff": loss_diff
    }
    for kind in ("master", "gathered"):
        a, b = params_pristine[kind], params_patched[kind]
        names = sorted(set(a) | set(b))
        same, max_diff, differing, dtypes = 0, 0.0, [], set()
        for name in names:
            if name not in a or name not in b:
                differing.append(name)
                max_diff = float("nan")
                continue
            identical, diff = report.compare_tensors(a[name], b[name])
            same += identical
            if not identical:
                differing.append(name)
                if a[name].dtype != b[name].dtype:
                    dtypes.add(f"{a[name].dtype}->{b[name].dtype}")
            max_diff = max(max_diff, diff) if diff == diff else diff
        out[kind] = {
            "tensors": len(names),
            "same": same,
            "max_abs_diff": max_diff,
            "differing": differing,
            "dtype_changes": sorted(dtypes)
        }
    return out


def _last_error(text):
    """The last line of a failed job's logs that names an error."""
    lines = [line.strip() for line in text.splitlines() if "Error" in line or "error" in line]
    return (lines[-1] if lines else text.strip().splitlines()[-1])[:300]


def fmt_diff(x):
    return "0" if x == 0 else f"{x:.3g}"


def fmt_steps(steps):
    """1, 2, 3, 5 -> "1-3, 5"."""
    ranges = []
    for s in steps:
        if ranges and s == ranges[-1][1] + 1:
            ranges[-1][1] = s
        else:
            ranges.append([s, s])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in ranges)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--precisions",
                        type=parse_precisions,
                        default=list(PRECISIONS),
                        help=f"comma-separated, of {','.join(PRECISIONS)} (default: all four)")
    parser.add_argument("--stages",
                        default=",".join(configs.DEFAULT_STAGES),
                        help="comma-separated, of %s (default: %%(default)s); also %s" %
                        (", ".join(configs.STAGES), ", ".join(configs.MORE_STAGES)))
    parser.add_argument("--steps", type=int, default=10, help="training steps per run (default 10)")
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--workdir", default=str(launch.ROOT / "out" / "compare_pristine"))
    parser.add_argument("--no-control", action="store_true", help="skip the control case")
    args = parser.parse_args()
    args.stages = configs.parse_stages(args.stages)
    import torch

    workdir = Path(args.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    machine = report.machine_description()
    command = " ".join(shlex.quote(a) for a in [Path(sys.executable).name, *sys.argv])
    print(f"command: {command}")
    print(f"machine: {report.machine_line(machine)}")
    series = launch.dev_tree_state()
    print(f"series: build/deepspeed at {series}")
    print(f"runs: {args.steps} steps, world size {args.world_size}, AdamW lr 1e-3 (torch; 0-fusedadam: the "
          f"config's Adam, fused), gradient clipping 1.0, micro batch 4 x 16 tokens; ZeRO-1/2: buckets of 50,000 "
          f"elements; ZeRO-3: stage3_param_persistence_threshold 0; one process per rank (torchrun)")
    print("stages: " + "; ".join(f"{s} ({configs.STAGES.get(s) or configs.MORE_STAGES[s]})" for s in args.stages))
    print("precisions: " + "; ".join(f"{p} ({PRECISIONS[p]})" for p in args.precisions))

    jobs = [(stage, precision, case) for stage in args.stages for precision in args.precisions for case in CASES
            if case[1] != "autoep_net" or stage in AUTOEP_STAGES]
    control_precision = next((p for p in ("bf16", "fp16") if p in args.precisions), None)
    control_stage = "3" if "3" in args.stages else args.stages[0]
    if not args.no_control and control_precision:
        jobs.append((control_stage, control_precision, CONTROL))
    elif not args.no_control:
        print("control: skipped (it needs bf16 or fp16 among --precisions)")
    print()

    run_start = time.time()
    model_dir = models.save_hf_model("deepseek_v4", workdir / "models" / "deepseek_v4", seed=args.seed)
    results, failed, unsupported = [], [], []
    for stage, precision, (name, model, keep, control) in jobs:
        tag = f"[stage {stage}, {precision}]"
        config = configs.ds_config(4, args.world_size, keep=keep, dtype=precision, stage=stage)
        if model == "autoep_net":
            config["expert_parallel"] = dict(models.AUTOEP_CONFIG, autoep_size=args.world_size)
        spec = dict(model=model,
                    model_dir=str(model_dir),
                    # under 3-offload-nvme, matrices whose partitions reach the swapper's 1 MiB, so that they swap
                    dim=1024 if stage == "3-offload-nvme" else 64,
                    layers=2,
                    keep_per_block=0,
                    dtype=precision,
                    micro_batch=4,
                    seq=16,
                    seed=args.seed,
                    warmup=0,
                    steps=args.steps,
                    config=config,
                    dump_params=True)
        runs, params = {}, {}
        slug = f"zero{stage}/{precision}/{model}_{'default' if keep == configs.UNSET else 'empty'}"
        start = time.time()
        try:
            for build in launch.BUILDS:
                job = workdir / slug / build
                runs[build] = launch.launch(spec, build, args.world_size, job)
                params[build] = torch.load(job / "params.pt")
        except RuntimeError as err:
            if "pristine" not in runs:
                # pristine 0.19.8 does not run this stage in this precision: nothing to compare with
                reason = _last_error(str(err))
                print(f"{tag} {name}: not supported by pristine 0.19.8 ({reason})", flush=True)
                unsupported.append({"stage": stage, "precision": precision, "name": name, "reason": reason})
                continue
            print(f"{tag} {name}: FAILED\n{err}")
            failed.append(f"{tag} {name}")
            continue
        cmp = compare_runs(runs["pristine"], runs["patched"], params["pristine"], params["patched"])
        cmp.update(name=name,
                   stage=stage,
                   precision=precision,
                   keep=configs.describe_keep(keep),
                   control=control,
                   seconds=round(time.time() - start, 1),
                   fp32_params={b: len(runs[b][0]["fp32_params"])
                                for b in launch.BUILDS},
                   param_dtypes={b: runs[b][0]["param_dtypes"]
                                 for b in launch.BUILDS},
                   deepspeed={b: runs[b][0]["deepspeed_path"]
                              for b in launch.BUILDS})
        cmp["identical"] = (cmp["same_steps"] == cmp["steps"] and cmp["master"]["same"] == cmp["master"]["tensors"]
                            and cmp["gathered"]["same"] == cmp["gathered"]["tensors"])
        print(f"{tag} {name}: {'IDENTICAL' if cmp['identical'] else 'DIFFERENT'} ({cmp['seconds']} s)", flush=True)
        results.append(cmp)
    seconds = round(time.time() - run_start, 1)
    print()

    rows = []
    for r in results:
        m, g = r["master"], r["gathered"]
        yes = lambda ok: "yes" if ok else "no"  # noqa: E731
        rows.append([
            r["stage"], r["precision"], r["name"],
            f"{yes(r['same_steps'] == r['steps'])} ({r['same_steps']}/{r['steps']})",
            fmt_diff(r["loss_max_abs_diff"]), f"{yes(m['same'] == m['tensors'])} ({m['same']}/{m['tensors']})",
            fmt_diff(m["max_abs_diff"]), f"{yes(g['same'] == g['tensors'])} ({g['same']}/{g['tensors']})",
            fmt_diff(g["max_abs_diff"]), f"{r['fp32_params']['pristine']} / {r['fp32_params']['patched']}",
            "IDENTICAL" if r["identical"] else "DIFFERENT"
        ])
    header = [
        "stage", "precision", "case (pristine 0.19.8 vs series)", "losses identical", "max diff",
        "fp32 masters identical", "max diff", "gathered params identical", "max diff", "fp32 params", "verdict"
    ]
    print(report.text_table(header, rows))
    print("(identical = bitwise; fp32 params = parameters stored in fp32, pristine / series: all of them in fp32 "
          "and under autocast)\n")
    for r in results:
        verdict = "IDENTICAL" if r["identical"] else "DIFFERENT"
        if r["control"]:
            verdict += " (control: expected DIFFERENT)" + ("" if not r["identical"] else " -- UNEXPECTED")
        print(f"[stage {r['stage']}, {r['precision']}] {r['name']}: {verdict}")
        print(f"  losses bitwise identical: {'yes' if r['same_steps'] == r['steps'] else 'no'} "
              f"({r['same_steps']}/{r['steps']} steps, all {args.world_size} ranks), "
              f"max abs diff {fmt_diff(r['loss_max_abs_diff'])}")
        if r["differing_steps"] and not r["control"]:
            print(f"    differing steps: {fmt_steps(r['differing_steps'])}")
        for kind, label in (("master", "fp32 masters (safe_get_full_fp32_param)"),
                            ("gathered", "gathered params (zero.GatheredParameters)")):
            c = r[kind]
            print(f"  parameters bitwise identical, {label}: {'yes' if c['same'] == c['tensors'] else 'no'} "
                  f"({c['same']}/{c['tensors']} tensors), max abs diff {fmt_diff(c['max_abs_diff'])}")
            if c["differing"] and r["control"]:
                print(f"    differing: {len(c['differing'])} tensors"
                      f"{', dtype ' + ', '.join(c['dtype_changes']) if c['dtype_changes'] else ''}")
            elif c["differing"]:
                print(f"    differing ({len(c['differing'])}): {', '.join(c['differing'][:10])}"
                      f"{' ...' if len(c['differing']) > 10 else ''}"
                      f"{'; dtype ' + ', '.join(c['dtype_changes']) if c['dtype_changes'] else ''}")
        print(f"  ({r['seconds']} s; pristine: {r['deepspeed']['pristine']}; series: {r['deepspeed']['patched']})")
    series_end = launch.dev_tree_state()
    if series_end != series:
        print(f"WARNING: the dev tree changed during the run ({series} -> {series_end}); rerun for a clean result")
    (workdir / "results.json").write_text(
        json.dumps(
            {
                "command": command,
                "machine": machine,
                "series": series,
                "series_end": series_end,
                "stages": args.stages,
                "precisions": args.precisions,
                "unsupported": unsupported,
                "steps": args.steps,
                "seconds": seconds,
                "failed": failed,
                "cases": results
            },
            indent=1))
    print(f"\nresults: {workdir / 'results.json'} ({seconds} s in all)")
    for stage in args.stages:
        verdicts = []
        for precision in args.precisions:
            tag = f"[stage {stage}, {precision}]"
            cases = [r for r in results if r["stage"] == stage and r["precision"] == precision and not r["control"]]
            skipped = [u for u in unsupported if u["stage"] == stage and u["precision"] == precision]
            if any(f.startswith(tag) for f in failed):
                state = "a run FAILED"
            elif not cases and skipped:
                state = "not supported by 0.19.8"
            elif all(r["identical"] for r in cases):
                state = "identical" + (f" ({len(skipped)} case(s) not supported by 0.19.8)" if skipped else "")
            else:
                state = "DIFFERENT: " + ", ".join(r["name"] for r in cases if not r["identical"])
            verdicts.append(f"{precision}: {state}")
        print(f"stage {stage}: " + "; ".join(verdicts))
    regressions = [r for r in results if not r["control"] and not r["identical"]]
    if failed:
        print(f"verdict: {len(failed)} run(s) FAILED")
        return 2
    if regressions:
        print(f"verdict: {len(regressions)} case(s) DIFFER from pristine 0.19.8")
        return 1
    print(f"verdict: with nothing kept in fp32 the series is bitwise identical to pristine 0.19.8 "
          f"(stages {', '.join(args.stages)}; {', '.join(args.precisions)})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
