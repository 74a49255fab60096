# Copyright (c) DeepSpeed Team.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""No regression, shown: the series with nothing kept in fp32 trains bit for bit like pristine DeepSpeed 0.19.8.

Runs each case twice, side by side, with the same weights, data and config: once with pristine DeepSpeed 0.19.8
(``PYTHONPATH=build/pristine``) and once with the patched dev tree (the venv's editable install). Each run is
``--steps`` ZeRO-3 bf16 training steps (AdamW, gradient clipping) with ``--world-size`` ranks, one subprocess per
rank (gloo on the CPU, NCCL on CUDA). The cases:

* tiny DeepSeek-V4 (random init, seeded, ``save_pretrained`` once, ``from_pretrained`` under ``HfDeepSpeedConfig``
  so that ``zero.Init`` runs), ``data_types.keep_in_fp32_modules: []``;
* a small plain torch model that lists nothing, ``keep_in_fp32_modules`` left at its default (``"auto"``);
* a control (not part of the verdict, ``--no-control`` skips it): the tiny DeepSeek-V4 with the default
  ``"auto"``, where the series keeps 32 parameters in fp32 and must differ from pristine; it shows the
  comparison can see a difference.

Recorded: every step's loss on every rank, and after the last step every parameter twice: its fp32 master
(``safe_get_full_fp32_param``) and its gathered training-dtype value (``zero.GatheredParameters``). Compared
bitwise. Exit status 1 if a case other than the control differs, 2 if a run fails.

    .venv/bin/python benchmarks/compare_pristine.py            # about 2 minutes on 2 cores
"""

import argparse
import json
import shlex
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

CASES = [
    # name, model, keep_in_fp32_modules, control
    ("DeepSeek-V4 (tiny), keep_in_fp32_modules: []", "deepseek_v4", [], False),
    ("torch model listing nothing, default (\"auto\")", "tiny_net", common.UNSET, False),
    ("control: DeepSeek-V4 (tiny), default (\"auto\")", "deepseek_v4", common.UNSET, True),
]


def compare_runs(pristine, patched, params_pristine, params_patched):
    """Per-step losses (all ranks) and final parameters (fp32 masters and gathered values), bitwise."""
    steps = len(pristine[0]["losses"])
    same_steps = sum(
        all(a["loss_hex"][s] == b["loss_hex"][s] for a, b in zip(pristine, patched)) for s in range(steps))
    loss_diff = max(abs(x - y) for a, b in zip(pristine, patched) for x, y in zip(a["losses"], b["losses"]))
    out = {"steps": steps, "same_steps": same_steps, "loss_max_abs_diff": loss_diff}
    for kind in ("master", "gathered"):
        a, b = params_pristine[kind], params_patched[kind]
        names = sorted(set(a) | set(b))
        same, max_diff, differing, dtypes = 0, 0.0, [], set()
        for name in names:
            if name not in a or name not in b:
                differing.append(name)
                max_diff = float("nan")
                continue
            identical, diff = common.compare_tensors(a[name], b[name])
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


def fmt_diff(x):
    return "0" if x == 0 else f"{x:.3g}"


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--workdir", default=str(common.ROOT / "out" / "compare_pristine"))
    parser.add_argument("--no-control", action="store_true", help="skip the control case")
    args = parser.parse_args()
    import torch

    workdir = Path(args.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    machine = common.machine_description()
    command = " ".join(shlex.quote(a) for a in [Path(sys.executable).name, *sys.argv])
    print(f"command: {command}")
    print(f"machine: {common.machine_line(machine)}")
    series = common.dev_tree_state()
    print(f"series: build/deepspeed at {series}")
    print(f"runs: {args.steps} ZeRO-3 bf16 steps, world size {args.world_size}, AdamW lr 1e-3, gradient clipping 1.0, "
          f"micro batch 4 x 16 tokens, stage3_param_persistence_threshold 0; one subprocess per rank\n")

    model_dir = common.save_hf_model("deepseek_v4", workdir / "models" / "deepseek_v4", seed=args.seed)
    results, failed = [], False
    for name, model, keep, control in CASES:
        if control and args.no_control:
            continue
        spec = dict(model=model,
                    model_dir=str(model_dir),
                    dim=64,
                    layers=2,
                    keep_per_block=0,
                    dtype="bf16",
                    micro_batch=4,
                    seq=16,
                    seed=args.seed,
                    warmup=0,
                    steps=args.steps,
                    config=common.ds_config(4, args.world_size, keep=keep),
                    dump_params=True)
        runs, params = {}, {}
        slug = f"{model}_{'default' if keep == common.UNSET else 'empty'}"
        start = time.time()
        try:
            for build in common.BUILDS:
                job = workdir / slug / build
                runs[build] = common.launch(spec, build, args.world_size, job)
                params[build] = torch.load(job / "params.pt")
        except RuntimeError as err:
            print(f"{name}: FAILED\n{err}")
            failed = True
            continue
        cmp = compare_runs(runs["pristine"], runs["patched"], params["pristine"], params["patched"])
        cmp.update(name=name,
                   keep=common.describe_keep(keep),
                   control=control,
                   seconds=round(time.time() - start, 1),
                   fp32_params={b: len(runs[b][0]["fp32_params"])
                                for b in common.BUILDS},
                   deepspeed={b: runs[b][0]["deepspeed_path"]
                              for b in common.BUILDS})
        cmp["identical"] = (cmp["same_steps"] == cmp["steps"] and cmp["master"]["same"] == cmp["master"]["tensors"]
                            and cmp["gathered"]["same"] == cmp["gathered"]["tensors"])
        results.append(cmp)

    rows = []
    for r in results:
        m, g = r["master"], r["gathered"]
        yes = lambda ok: "yes" if ok else "no"  # noqa: E731
        rows.append([
            r["name"], f"{yes(r['same_steps'] == r['steps'])} ({r['same_steps']}/{r['steps']})",
            fmt_diff(r["loss_max_abs_diff"]), f"{yes(m['same'] == m['tensors'])} ({m['same']}/{m['tensors']})",
            fmt_diff(m["max_abs_diff"]), f"{yes(g['same'] == g['tensors'])} ({g['same']}/{g['tensors']})",
            fmt_diff(g["max_abs_diff"]), f"{r['fp32_params']['pristine']} / {r['fp32_params']['patched']}"
        ])
    header = [
        "case (pristine 0.19.8 vs series)", "losses identical", "max diff", "fp32 masters identical", "max diff",
        "gathered params identical", "max diff", "fp32 params"
    ]
    print(common.text_table(header, rows))
    print("(identical = bitwise; fp32 params = parameters stored in fp32, pristine / series)\n")
    for r in results:
        verdict = "IDENTICAL" if r["identical"] else "DIFFERENT"
        if r["control"]:
            verdict += " (control: expected DIFFERENT)" + ("" if not r["identical"] else " -- UNEXPECTED")
        print(f"{r['name']}: {verdict}")
        print(f"  losses bitwise identical: {'yes' if r['same_steps'] == r['steps'] else 'no'} "
              f"({r['same_steps']}/{r['steps']} steps, all {args.world_size} ranks), "
              f"max abs diff {fmt_diff(r['loss_max_abs_diff'])}")
        for kind, label in (("master", "fp32 masters (safe_get_full_fp32_param)"),
                            ("gathered", "gathered params (zero.GatheredParameters)")):
            c = r[kind]
            print(f"  parameters bitwise identical, {label}: {'yes' if c['same'] == c['tensors'] else 'no'} "
                  f"({c['same']}/{c['tensors']} tensors), max abs diff {fmt_diff(c['max_abs_diff'])}")
            if c["differing"] and r["control"]:
                print(f"    differing: {len(c['differing'])} tensors"
                      f"{', dtype ' + ', '.join(c['dtype_changes']) if c['dtype_changes'] else ''}")
            elif c["differing"]:
                print(f"    differing: {', '.join(c['differing'][:10])}{' ...' if len(c['differing']) > 10 else ''}")
        print(f"  ({r['seconds']} s; pristine: {r['deepspeed']['pristine']}; series: {r['deepspeed']['patched']})")
    series_end = common.dev_tree_state()
    if series_end != series:
        print(f"WARNING: the dev tree changed during the run ({series} -> {series_end}); rerun for a clean result")
    (workdir / "results.json").write_text(
        json.dumps(
            {
                "command": command,
                "machine": machine,
                "series": series,
                "series_end": series_end,
                "cases": results
            },
            indent=1))
    regressions = [r for r in results if not r["control"] and not r["identical"]]
    print(f"\nresults: {workdir / 'results.json'}")
    if failed:
        print("verdict: a run FAILED")
        return 2
    if regressions:
        print(f"verdict: {len(regressions)} case(s) DIFFER from pristine 0.19.8")
        return 1
    print("verdict: with nothing kept in fp32 the series is bitwise identical to pristine 0.19.8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
