# Copyright (c) DeepSpeed Team.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""The accuracy study: what keeping the listed parameters in fp32 changes in training, against an fp32 reference.

    make study                     # or: .venv/bin/python benchmarks/accuracy_study.py [--steps N] [--out DIR]

For a tiny DeepSeek-V4 and a tiny gpt-oss, three ZeRO-3 runs from the same weights and the same data:

* ``fp32``: the reference, bf16 disabled;
* ``bf16 + list``: bf16 with the listed parameters kept in fp32. DeepSeek-V4: ``keep_in_fp32_modules`` at its
  default ``"auto"`` (the model's ``_keep_in_fp32_modules_strict``). gpt-oss lists its norms only in
  ``_keep_in_fp32_modules``, which applies to fp16, so under bf16 ``"auto"`` keeps nothing: it runs with the
  explicit list ``["sinks", "norm"]`` (attention sinks and norm weights);
* ``bf16 []``: bf16 with ``keep_in_fp32_modules: []``, everything in bf16 (the behavior before the option).

AdamW with a learning rate of 1e-4, below bf16's resolution for values near 1 (2^-8 to 2^-7): without the list the
bf16 copy of a norm weight moves only when the optimizer's fp32 copy has drifted by half a bf16 step. After every
step each rank gathers the listed parameters (the values the model computes with). The study prints and writes
``results.md`` (the tables) into ``--out`` and the plots into ``docs/images/`` (copied to ``--out``).
"""

import json
import os
import platform
import shutil
import sys
import textwrap
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))  # tiny_runs.py: what this study shares with the demo

import tiny_runs  # noqa: E402

DEFAULT_OUT = ROOT / "out" / "study"
IMAGES = ROOT / "docs" / "images"
MODELS = {
    "deepseek_v4": "DeepSeek-V4",
    "gpt_oss": "gpt-oss",
}
RUNS = {
    "fp32": "fp32 (reference)",
    "bf16_list": "bf16 + list",
    "bf16_none": "bf16 []",
}
# What "the list" is, per model (data_types.keep_in_fp32_modules of the bf16_list run).
KEEP = {
    "deepseek_v4": "auto",
    "gpt_oss": ["sinks", "norm"],
}

# ---------------------------------------------------------------------------------------------------------------
# Models and data
# ---------------------------------------------------------------------------------------------------------------


def describe_keep(keep):
    return '"auto"' if keep == "auto" else "[" + ", ".join(f'"{k}"' for k in keep) + "]"


# ---------------------------------------------------------------------------------------------------------------
# One rank
# ---------------------------------------------------------------------------------------------------------------


def train(model_name, run, args, say_):
    import gc
    import torch
    import deepspeed
    import deepspeed.comm as dist
    from deepspeed.runtime.keep_in_fp32 import keep_in_fp32_pattern
    from deepspeed.utils import safe_get_full_fp32_param
    from safetensors.torch import load_file

    out = Path(args.out)
    model_dir = out / "models" / model_name
    rank, world = dist.get_rank(), dist.get_world_size()
    keep = [] if run == "bf16_none" else KEEP[model_name]
    ds_config = tiny_runs.zero3_config(args.micro_batch, bf16=run != "fp32", keep=None if keep == "auto" else keep)
    model, hf_ds_config = tiny_runs.from_pretrained_zero3(model_dir, ds_config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=ds_config)
    module = engine.module

    # The listed parameters: the same names in all three runs.
    pattern = keep_in_fp32_pattern(module, KEEP[model_name], torch.bfloat16)
    params = dict(module.named_parameters())
    listed = [n for n in params if pattern.search(n)]
    listed_params = [params[n] for n in listed]
    dtypes = sorted({str(p.ds_tensor.dtype).replace("torch.", "") for p in listed_params})
    other = sorted({str(p.ds_tensor.dtype).replace("torch.", "") for n, p in params.items() if n not in listed})

    initial = load_file(model_dir / "initial_weights.safetensors")
    start = tiny_runs.gathered(listed_params)
    exact = torch.equal(start, torch.cat([initial[n].flatten() for n in listed]))
    say_(f"{MODELS[model_name]}, {RUNS[run]}: {len(listed)} listed parameters in {'/'.join(dtypes)}, the other "
         f"{len(params) - len(listed)} in {'/'.join(other)}; {args.steps} steps on {world} ranks")
    trajectory = torch.empty(args.steps + 1, start.numel())
    trajectory[0] = start
    losses, t0 = [], time.time()
    log_every = max(1, args.steps // 4)
    for step in range(1, args.steps + 1):
        losses.append(tiny_runs.train_step(engine, tiny_runs.batch(step, rank, args.micro_batch)))
        trajectory[step] = tiny_runs.gathered(listed_params)
        if step % log_every == 0 or step == args.steps:
            say_(f"  step {step:4d}/{args.steps}  loss {losses[-1]:.4f}  ({(time.time() - t0) / step:.2f} s/step)")
    # The optimizer's fp32 copy of the listed parameters (the parameters themselves where they are fp32).
    master = torch.cat([safe_get_full_fp32_param(p).detach().float().flatten() for p in listed_params])
    if rank == 0:
        torch.save(
            {
                "losses": losses,
                "listed": listed,
                "numel": [p.ds_numel for p in listed_params],
                "dtypes": dtypes,
                "trajectory": trajectory,
                "master": master,
                "exact_after_load": exact,
                "seconds": time.time() - t0,
            }, out / "runs" / f"{model_name}.{run}.pt")
    engine.destroy()
    del engine, module, model, optimizer, params, hf_ds_config
    gc.collect()


# ---------------------------------------------------------------------------------------------------------------
# The parent: launch, analyse, report, plot
# ---------------------------------------------------------------------------------------------------------------


def run_all(jobs, args):
    """The ``jobs`` (model/run), in one launch on ``args.world_size`` ranks."""
    codes = tiny_runs.launch(__file__, ",".join(jobs), args, timeout=3600)
    if any(codes):
        tiny_runs.fail(f"The study failed (exit codes {codes}); the end of the logs:", args)


def analyse(model_name, out):
    """The numbers of one model: a dict per run, and what the plots need."""
    import torch
    res = {run: torch.load(out / "runs" / f"{model_name}.{run}.pt") for run in RUNS}
    ref = res["fp32"]
    ref_traj = ref["trajectory"]
    first, last = ref_traj[0], ref_traj[-1]
    trains = (ref_traj[1:] != ref_traj[:-1]).any(0)  # listed elements that get a gradient
    is_norm = torch.cat([torch.full((k, ), "norm" in n) for n, k in zip(ref["listed"], ref["numel"])])
    groups = {"norm weights": trains & is_norm, "all listed": trains}
    rows = {}
    for run, r in res.items():
        traj = r["trajectory"]
        changes = traj[1:] != traj[:-1]
        diff = traj[-1] - last
        dloss = torch.tensor(r["losses"]) - torch.tensor(ref["losses"])
        rows[run] = {
            "dtypes": "/".join(r["dtypes"]),
            "exact": r["exact_after_load"],
            "changed": {
                g: float(changes[:, m].float().mean())
                for g, m in groups.items()
            },
            "never": {
                g: int((~changes[:, m].any(0)).sum())
                for g, m in groups.items()
            },
            "max_abs": {
                g: float(diff[m].abs().max())
                for g, m in groups.items()
            },
            "rel_l2": {
                g: float(diff[m].norm() / last[m].norm())
                for g, m in groups.items()
            },
            "per_update": {
                g: float(diff[m].norm() / (last - first)[m].norm())
                for g, m in groups.items()
            },
            # The values the model computes with against the optimizer's own fp32 copy of them.
            "vs_master": float((traj[-1] - r["master"])[trains].abs().max()),
            "loss_final": float(torch.tensor(r["losses"][-20:]).mean()),
            "loss_mean_abs": float(dloss.abs().mean()),
            "loss_max_abs": float(dloss.abs().max()),
            "loss_last": float(dloss[-20:].mean()),
        }
    info = {
        "params": len(ref["listed"]),
        "elements": int(sum(ref["numel"])),
        "groups": {
            g: int(m.sum())
            for g, m in groups.items()
        },
    }
    # The trajectory to plot: the norm weight element that the reference moves most.
    pick = int(torch.where(groups["norm weights"], (last - first).abs(), torch.tensor(-1.0)).argmax())
    offsets = torch.tensor([0] + ref["numel"]).cumsum(0)
    index = int(torch.searchsorted(offsets, torch.tensor(pick), right=True)) - 1
    curves = {
        "losses": {
            run: r["losses"]
            for run, r in res.items()
        },
        "element": (ref["listed"][index], pick - int(offsets[index])),
        "trajectory": {
            run: r["trajectory"][:, pick].tolist()
            for run, r in res.items()
        },
        "steps": ref_traj.shape[0] - 1,
    }
    return info, rows, curves


def run_label(model_name, run):
    return RUNS[run] + (f" {describe_keep(KEEP[model_name])}" if run == "bf16_list" else "")


def model_table(model_name, info, rows):
    """One model's table: a metric per row, a run per column."""

    def pct(x):
        return f"{100 * x:.1f} %"

    def sci(x):
        return f"{x:.2e}"

    header = ("", *(run_label(model_name, run) for run in RUNS))
    table = [("listed parameters' dtype", *(rows[r]["dtypes"] for r in RUNS)),
             ("exact checkpoint values after loading", *("yes" if rows[r]["exact"] else "no" for r in RUNS))]
    for g, n in info["groups"].items():
        table += [
            (f"{g} ({n:,} elements): steps that changed a value", *(pct(rows[r]["changed"][g]) for r in RUNS)),
            (f"{g}: elements that never changed", *(str(rows[r]["never"][g]) for r in RUNS)),
            (f"{g}: max abs diff to fp32", "-", *(sci(rows[r]["max_abs"][g]) for r in list(RUNS)[1:])),
            (f"{g}: rel. L2 diff to fp32", "-", *(sci(rows[r]["rel_l2"][g]) for r in list(RUNS)[1:])),
            (f"{g}: diff / fp32 update", "-", *(pct(rows[r]["per_update"][g]) for r in list(RUNS)[1:])),
        ]
    table += [
        ("max abs diff to the run's own fp32 copy", *(sci(rows[r]["vs_master"]) for r in RUNS)),
        ("loss, mean of the last 20 steps", *(f"{rows[r]['loss_final']:.5f}" for r in RUNS)),
        ("loss: mean abs diff to fp32", "-", *(sci(rows[r]["loss_mean_abs"]) for r in list(RUNS)[1:])),
        ("loss: max abs diff to fp32", "-", *(sci(rows[r]["loss_max_abs"]) for r in list(RUNS)[1:])),
        ("loss: mean diff to fp32, last 20 steps", "-", *(f"{rows[r]['loss_last']:+.2e}" for r in list(RUNS)[1:])),
    ]
    title = (f"{MODELS[model_name]}: {info['params']} listed parameters, {info['elements']:,} elements; the list: "
             f"{describe_keep(KEEP[model_name])}")
    return title, header, table


def text_table(header, rows):
    widths = [max(len(str(r[i])) for r in [header] + rows) for i in range(len(header))]

    def line(r):
        return "  ".join(str(c).ljust(w) if i == 0 else str(c).rjust(w) for i, (c, w) in enumerate(zip(r, widths)))

    return "\n".join([line(header), "  ".join("-" * w for w in widths)] + [line(r) for r in rows])


def markdown_table(header, rows):
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return "\n".join(lines)


def plot(results, args, out):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np
    import torch
    colors = {"fp32": "black", "bf16_list": "tab:blue", "bf16_none": "tab:red"}
    styles = {"fp32": "-", "bf16_list": "--", "bf16_none": "-"}
    paths = []

    # Loss curves, and their difference to the reference.
    fig, axes = plt.subplots(2, len(results), figsize=(6 * len(results), 7), sharex=True, squeeze=False)
    for col, (model_name, (_, _, curves)) in enumerate(results.items()):
        steps = np.arange(1, curves["steps"] + 1)
        ref = np.array(curves["losses"]["fp32"])
        for run, losses in curves["losses"].items():
            label = RUNS[run] + (f" {describe_keep(KEEP[model_name])}" if run == "bf16_list" else "")
            axes[0, col].plot(steps, losses, styles[run], color=colors[run], label=label, lw=1.2)
            if run != "fp32":
                axes[1, col].plot(steps, np.array(losses) - ref, color=colors[run], label=label, lw=1.0)
        axes[0, col].set_title(f"{MODELS[model_name]}: training loss")
        axes[0, col].set_ylabel("loss")
        axes[0, col].legend()
        axes[1, col].axhline(0, color="black", lw=0.8)
        axes[1, col].set_title("loss minus the fp32 reference's")
        axes[1, col].set_xlabel("step")
        axes[1, col].set_ylabel("loss difference")
        axes[1, col].legend()
    fig.suptitle(f"ZeRO-3, {args.world_size} CPU ranks, AdamW lr {args.lr:g}: bf16 with and without the fp32 list "
                 "against fp32")
    fig.tight_layout()
    paths.append(IMAGES / "accuracy_loss.png")
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)

    # One listed element's trajectory, with the bf16 grid around it.
    fig, axes = plt.subplots(1, len(results), figsize=(6 * len(results), 4.2), squeeze=False)
    for col, (model_name, (_, _, curves)) in enumerate(results.items()):
        ax = axes[0, col]
        steps = np.arange(0, curves["steps"] + 1)
        values = np.concatenate([np.array(v) for v in curves["trajectory"].values()])
        margin = 0.15 * (values.max() - values.min()) + 1e-6
        lo, hi = values.min() - margin, values.max() + margin
        for g in torch.linspace(lo, hi, 4000).bfloat16().float().unique().tolist():
            ax.axhline(g, color="0.85", lw=0.8, zorder=0)
        for run, traj in curves["trajectory"].items():
            label = RUNS[run] + (f" {describe_keep(KEEP[model_name])}" if run == "bf16_list" else "")
            ax.step(steps, traj, styles[run], where="post", color=colors[run], label=label, lw=1.3)
        name, index = curves["element"]
        ax.set_title(f"{MODELS[model_name]}: {name}[{index}]", fontsize=10)
        ax.set_xlabel("step")
        ax.set_ylabel("value the model computes with")
        ax.legend(fontsize=8)
    fig.suptitle("A listed parameter element (grey lines: bf16 values)")
    fig.tight_layout()
    paths.append(IMAGES / "accuracy_trajectory.png")
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)
    for p in paths:
        shutil.copy(p, out / p.name)
    return paths


def machine():
    import torch
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    import importlib.metadata as md
    import transformers
    return (f"{cpu}, {os.cpu_count()} cores, {platform.system()} {platform.release()}; Python "
            f"{platform.python_version()}, torch {torch.__version__}, transformers {transformers.__version__}, "
            f"deepspeed {md.version('deepspeed')} (this series, DS_ACCELERATOR={os.environ['DS_ACCELERATOR']})")


def main():
    parser = tiny_runs.arguments(__doc__, DEFAULT_OUT, steps=200, lr=1e-4)
    parser.add_argument("--models", default=",".join(MODELS), help="comma-separated (default: %(default)s)")
    parser.add_argument("--report-only",
                        action="store_true",
                        help="redo the tables and plots from the runs already in --out, without training")
    args = tiny_runs.parse(parser)
    if args.worker:  # one rank of the model/run jobs named in --worker
        return tiny_runs.worker(args.worker, lambda job, say_: train(*job.split("/"), args, say_))

    t_start = time.time()
    out = Path(args.out)
    models = args.models.split(",")
    if not args.report_only:
        for sub in ("models", "runs", "logs"):
            shutil.rmtree(out / sub, ignore_errors=True)
        (out / "runs").mkdir(parents=True)
    IMAGES.mkdir(parents=True, exist_ok=True)

    import transformers
    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    command = " ".join(["python benchmarks/accuracy_study.py"] + sys.argv[1:])
    if not args.report_only:
        print(
            f"Accuracy study: {', '.join(MODELS[m] for m in models)}, 3 runs each ({', '.join(RUNS.values())});\n"
            f"{args.steps} steps, AdamW lr {args.lr:g}, ZeRO-3 on {args.world_size} CPU ranks. Output folder: {out}\n")
    if not args.report_only:
        for model_name in models:
            tiny_runs.write_model(tiny_runs.tiny_model(model_name, seed=0), out / "models" / model_name)
        run_all([f"{m}/{run}" for m in models for run in RUNS], args)
        meta = {
            "command": command,
            "minutes": (time.time() - t_start) / 60,
            "machine": machine(),
            "args": {
                k: v
                for k, v in vars(args).items() if k in ("steps", "lr", "micro_batch", "world_size")
            },
        }
        (out / "runs" / "meta.json").write_text(json.dumps(meta, indent=1))
    meta = json.loads((out / "runs" / "meta.json").read_text())
    for k, v in meta["args"].items():
        setattr(args, k, v)

    results = {m: analyse(m, out) for m in models}
    paths = plot(results, args, out)
    notes = [
        "Values are those the model computes with (the listed parameters gathered after each step), compared after "
        "the last step.",
        "\"norm weights\": the listed norm weights (they start at 1.0, where bf16 values lie 2^-8 to 2^-7 apart, more "
        "than an update); \"all listed\": every listed element that gets a gradient.",
        "\"steps that changed a value\": the share of steps x elements in which the element's value changed.",
        "\"rel. L2 diff\": ||value - fp32 value|| / ||fp32 value||; \"diff / fp32 update\": ||value - fp32 value|| / "
        "||fp32 value - start value||.",
        "\"own fp32 copy\": the optimizer's fp32 value of the same parameters in the same run "
        "(safe_get_full_fp32_param); with the list the parameter is that value.",
        "\"exact checkpoint values after loading\": whether the listed parameters held the checkpoint's exact fp32 "
        "values before the first step.",
        "Both bf16 runs compute the rest of the model in bf16, so their gradients differ slightly from fp32; Adam "
        "turns such differences into full-size updates where a gradient is near 0, which is most of the distance "
        "of the listed elements other than norm weights (DeepSeek-V4's hyper-connection weights) in both runs.",
        "gpt-oss lists its norms only in `_keep_in_fp32_modules` (kept under fp16), so under bf16 \"auto\" keeps "
        "nothing; its run uses the explicit list [\"sinks\", \"norm\"].",
    ]
    md = [
        "# Accuracy study: bf16 with and without the fp32 list, against fp32",
        "",
        f"Command: `{meta['command']}` (`make study`), {meta['minutes']:.1f} minutes.",
        "",
        f"Machine: {meta['machine']}.",
        "",
        f"Tiny DeepSeek-V4 and gpt-oss (hidden 32, 2 layers, 4 experts, vocab {tiny_runs.VOCAB}, {tiny_runs.SEQ} "
        f"tokens per sequence), random init (seed 0), save_pretrained, from_pretrained under ZeRO-3 on "
        f"{args.world_size} ranks; {args.steps} steps of AdamW (lr {args.lr:g}, no weight decay), {args.world_size} x "
        f"{args.micro_batch} sequences per step, the same data in every run.",
        "",
    ]
    for model_name, (info, rows, _) in results.items():
        title, header, table = model_table(model_name, info, rows)
        print(f"\n{title}")
        print(text_table(header, table))
        md += [f"## {title}", "", markdown_table(header, table), ""]
    md += ["## Notes", ""] + [f"- {n}" for n in notes] + ["", "## Plots", ""]
    md += [f"![{p.stem}]({p.name})" for p in paths] + [""]
    (out / "results.md").write_text("\n".join(md))
    print()
    for n in notes:
        print(*textwrap.wrap("- " + n, width=118, subsequent_indent="  "), sep="\n")
    print(f"\nDone in {(time.time() - t_start) / 60:.1f} minutes. Tables: {out / 'results.md'}\nPlots: "
          f"{', '.join(os.path.relpath(p, ROOT) for p in paths)} (copied to {out})")


if __name__ == "__main__":
    main()
