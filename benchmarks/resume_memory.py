# Copyright (c) DeepSpeed Team.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""What resuming a checkpoint of other flat groups costs each rank, against stock 0.19.8 resuming its own.

For every stage of ``--stages`` (ZeRO-1, ZeRO-2, the BF16 optimizer, ZeRO-3) and world size of ``--world-sizes``,
three checkpoints of the synthetic model (``--dim`` 1024, ``--layers`` 8: 8.9 M parameters, 1 % of them a parameter
``keep`` per block), each after two steps, bf16: saved by pristine 0.19.8, by the series with
``keep_in_fp32_modules: []`` and by the series keeping ``["keep"]``. Then four loads, each a job of its own:

* ``stock <- stock``: pristine 0.19.8 resumes its own checkpoint (the baseline);
* ``kept <- stock``: the series keeping ``["keep"]`` resumes pristine's (an upgrade);
* ``kept <- []`` and ``[] <- kept``: the series resumes its own checkpoint of the other layout.

Measured in each rank, during ``engine.load_checkpoint`` only: the peak RSS above the RSS before (Linux's VmHWM,
reset through /proc/self/clear_refs; the allocator's peak on a GPU), the bytes the collectives carried, by kind
(tensors: the largest tensor of each call; Python objects: their pickled size), and the seconds. Each load's
fp32 masters and Adam moments are checked against the saving run's (exact).

    .venv/bin/python benchmarks/resume_memory.py --out out/resume-memory
    .venv/bin/python benchmarks/resume_memory.py --stages 2 --world-sizes 2 --out out/resume-memory-quick

Writes DIR/results.json and DIR/results.md.
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

SAVES = {"stock": ("pristine", configs.UNSET), "[]": ("patched", []), "kept": ("patched", ["keep"])}
# label: (build, keep_in_fp32_modules, the checkpoint it loads)
LOADS = {
    "stock <- stock": ("pristine", configs.UNSET, "stock"),
    "kept <- stock": ("patched", ["keep"], "stock"),
    "kept <- []": ("patched", ["keep"], "[]"),
    "[] <- kept": ("patched", [], "kept"),
}


def spec_for(args, stage, world_size, keep, resume):
    config = configs.ds_config(args.micro_batch, world_size, keep=keep, stage=stage)
    return dict(model="tiny_net",
                dim=args.dim,
                layers=args.layers,
                keep_per_block=models.keep_elements_for_share(0.01, args.dim, args.layers),
                dtype="bf16",
                micro_batch=args.micro_batch,
                seq=args.seq,
                seed=1234,
                warmup=0,
                steps=0,
                config=config,
                resume=resume)


def mib(x):
    return f"{x / 2**20:,.1f}"


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--stages", default="1,2,1-bf16opt,3")
    parser.add_argument("--world-sizes", default="2,4")
    parser.add_argument("--dim", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--micro-batch", type=int, default=2)
    parser.add_argument("--seq", type=int, default=16)
    parser.add_argument("--out", default=str(launch.ROOT / "out" / "resume-memory"))
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stages = configs.parse_stages(args.stages)
    world_sizes = [int(w) for w in args.world_sizes.split(",")]
    rows, results, failures = [], [], []
    started = time.time()
    for stage in stages:
        for world_size in world_sizes:
            where = out / "jobs" / f"zero{stage}" / f"ws{world_size}"
            for name, (build, keep) in SAVES.items():
                directory = where / "checkpoints" / name.replace("[]", "empty")
                spec = spec_for(args, stage, world_size, keep, {"save": True, "dir": str(directory)})
                launch.launch(spec, build, world_size, where / f"save-{name.replace('[]', 'empty')}")
            import torch
            base = None
            for label, (build, keep, source) in LOADS.items():
                tag = source.replace("[]", "empty")
                job_dir = where / ("load-" + label.replace(" <- ", "-from-").replace("[]", "empty"))
                spec = spec_for(args, stage, world_size, keep, {
                    "save": False,
                    "dir": str(where / "checkpoints" / tag),
                    "dump": build != "pristine"
                })
                try:
                    ranks = launch.launch(spec, build, world_size, job_dir)
                except RuntimeError as err:
                    failures.append(f"stage {stage}, world size {world_size}, {label}: {str(err).splitlines()[0]}")
                    print("  FAILED:", failures[-1], flush=True)
                    continue
                received = {"tensor": 0, "object": 0}
                for r in ranks:
                    for key, (_, nbytes) in r["comm"].items():
                        received["object" if key.startswith("object|") else "tensor"] += nbytes
                peak = max(r["peak_above_before_bytes"] for r in ranks)
                base = peak if label == "stock <- stock" else base
                # the bound: 1.25 x stock's own resume, plus the kept share (fp32 master and two moments)
                kept_share = spec["keep_per_block"] * args.layers * 12 / world_size
                target = 1.25 * base + kept_share if base else None
                exact = None  # pristine's accessors cannot give its loaded states before a step
                if build != "pristine":
                    saved = torch.load(where / f"save-{tag}" / "states.pt")
                    loaded = torch.load(job_dir / "states.pt")
                    exact = set(saved) == set(loaded) and all(
                        all(torch.equal(a, b) for a, b in zip(loaded[name], saved[name])) for name in saved)
                results.append({"stage": stage, "world_size": world_size, "load": label, "peak": peak,
                                "target": target, "received": received, "exact": exact, "ranks": ranks})
                rows.append([stage, world_size, label, mib(peak), f"{peak / base:.2f}" if base else "-",
                             "-" if label == "stock <- stock" else ("yes" if peak <= target else "NO"),
                             mib(received["tensor"] / world_size), mib(received["object"] / world_size),
                             f"{max(r['seconds'] for r in ranks):.2f}", {True: "exact", False: "DIFFERENT", None: "-"}[exact]])
                print(f"  stage {stage:<10} ws={world_size} {label:<15} " + " | ".join(map(str, rows[-1][3:])),
                      flush=True)
    md = [
        "# Resuming a checkpoint of other flat groups: each rank's peak memory and received bytes during the load",
        "", f"Command: `{' '.join(shlex.quote(a) for a in [sys.executable, *sys.argv])}` "
        f"({(time.time() - started) / 60:.1f} min)  ",
        "Machine: {cpu}, {cores} cores, {memory_gib} GiB; Python {python}, torch {torch}  ".format_map(
            dict({"cores": "?", "memory_gib": "?", "cpu": "?"}, **report.machine_description())),
        f"Model: synthetic, hidden {args.dim}, {args.layers} blocks, 1 % listed (`keep`), bf16, two steps before the "
        "save. Peak: the largest over the ranks of the peak RSS above the RSS before the load (on a GPU, of the "
        "allocator's peak); the bound is 1.25 x stock's own resume plus the kept share of the optimizer state (12 bytes "
        "per kept element over the data-parallel size). Received: the bytes "
        "the collectives of the load carried, a rank's mean. States: the fp32 masters and Adam moments after the "
        "load against the saving run's, bit for bit.", "",
        report.markdown_table([
            "stage", "world", "load", "peak above before (MiB)", "peak / stock's", "within 1.25 x stock's + kept share",
            "received, tensors (MiB)",
            "received, objects (MiB)", "seconds", "states"
        ], rows), ""
    ]
    md += [f"- FAILED: {f}" for f in failures]
    (out / "results.md").write_text("\n".join(md) + "\n")
    (out / "results.json").write_text(json.dumps({"results": results, "failures": failures}, indent=1))
    print("\n".join(md))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
