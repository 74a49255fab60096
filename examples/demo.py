# Copyright (c) DeepSpeed Team.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""The demo: a 2-rank CPU ZeRO-3 bf16 fine-tune of a tiny DeepSeek-V4 whose listed tensors stay in fp32.

    make demo                      # or: .venv/bin/python examples/demo.py [--out DIR] [--steps N]

What it does, in one output folder (default out/demo):

1. builds a tiny DeepSeek-V4 (random init, seed 0; its final norm set off its initial 1.0, as a trained model's
   is) and writes it with ``save_pretrained`` (safetensors, fp32), and what a plain ``from_pretrained`` loads from it;
2. loads it with ``from_pretrained(dtype=torch.bfloat16)`` under ZeRO-3 (``HfDeepSpeedConfig`` makes transformers
   run ``zero.Init``), compares it with the plain load, loads the final norm by hand (transformers 5.24.0 under
   ZeRO-3 drops it: a known issue, docs/upstream/transformers_zero3_renaming_bug.md), leaves
   ``data_types.keep_in_fp32_modules`` at its default ``"auto"``, freezes the embeddings and fine-tunes on 2 CPU
   ranks (gloo); it prints which parameters and buffers were kept in fp32, the loss, and saves a ZeRO checkpoint;
3. trains the same steps twice more from the same weights and data: an fp32 reference and bf16 with
   ``keep_in_fp32_modules: []``;
4. exports the checkpoint with the ``zero_to_fp32.py`` that DeepSpeed put into the checkpoint folder
   (``--safe_serialization``) and prints the dtypes of the export (all fp32, the frozen embeddings included);
5. compares the listed parameters of both bf16 runs with the fp32 reference.

The three runs share one launch: each rank is this file run as ``demo.py --worker RUN,RUN,...``. Only rank 0
prints, and only the lines meant for the reader; everything else goes to the logs in the output folder.
"""

import os
import re
import shutil
import subprocess
import sys
import textwrap
import time
from pathlib import Path

from tiny_runs import (VOCAB, arguments, batch, fail, from_pretrained_zero3, gathered, launch, parse, tiny_model,
                       train_step, worker, write_model, zero3_config)
from zero3_workaround import reload_from_checkpoint

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OUT = ROOT / "out" / "demo"
RUNS_ORDER = ("fp32", "bf16_auto", "bf16_none")
RUNS = {
    "bf16_auto": "bf16, keep_in_fp32_modules \"auto\"",
    "fp32": "the fp32 reference (bf16 off)",
    "bf16_none": "bf16, keep_in_fp32_modules []",
}
WIDTH = 118  # of the printed lines
FINAL_NORM = "model.norm.weight"
PLAIN_LOAD = "plain_from_pretrained.safetensors"  # in the model folder: what a plain from_pretrained loads

# ---------------------------------------------------------------------------------------------------------------
# Model and data (used by the parent and by every rank)
# ---------------------------------------------------------------------------------------------------------------


def listed_pattern(model):
    """The names DeepSeek-V4 lists for fp32 (its _keep_in_fp32_modules_strict) as DeepSpeed matches them."""
    import torch
    from deepspeed.runtime.keep_in_fp32 import keep_in_fp32_pattern
    return keep_in_fp32_pattern(model, "auto", torch.bfloat16)


def template(name):
    """A name with its layer index replaced by '*'."""
    return re.sub(r"\.\d+\.", ".*.", name)


# ---------------------------------------------------------------------------------------------------------------
# One rank
# ---------------------------------------------------------------------------------------------------------------


def train(run, args, say_):
    """One training run on every rank: load, train, (for bf16_auto) save a checkpoint, write the results."""
    import gc
    import torch
    import deepspeed
    import deepspeed.comm as dist
    from deepspeed.utils import safe_get_full_fp32_param
    from safetensors.torch import load_file

    out = Path(args.out)
    run_dir = out / "runs" / run
    rank, world = dist.get_rank(), dist.get_world_size()
    if rank == 0:
        run_dir.mkdir(parents=True, exist_ok=True)
    t_load = time.time()
    ds_config = zero3_config(args.micro_batch, bf16=run != "fp32", keep=[] if run == "bf16_none" else None)
    model, hf_ds_config = from_pretrained_zero3(out / "model", ds_config)
    # Under ZeRO-3, transformers 5.24.0 does not load DeepSeek-V4's final norm (a known issue): compare with what a
    # plain from_pretrained loads, and load the final norm by hand before deepspeed.initialize copies it.
    plain = load_file(out / "model" / PLAIN_LOAD)
    wrong = differs_from(model, plain)
    reload_from_checkpoint(model, str(out / "model"), [FINAL_NORM])
    still_wrong = differs_from(model, plain)
    model.model.embed_tokens.weight.requires_grad_(False)  # frozen parameters, for the export below
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=args.lr, weight_decay=0.0)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=ds_config)
    module = engine.module

    pattern = listed_pattern(module)
    params = dict(module.named_parameters())
    listed = [n for n in params if pattern.search(n)]
    listed_params = [params[n] for n in listed]
    dtype_of = {n: p.ds_tensor.dtype for n, p in params.items()}  # the partition's dtype is what ZeRO-3 holds

    if run == "fp32":
        say_("", "[3/5] The same steps twice more, from the same weights and data:")
    if run == "bf16_auto":
        report_kept(say_, module, pattern, params, dtype_of)
        say_(*wrap(final_norm_line(wrong, plain), 2))
        if set(wrong) - {FINAL_NORM} or still_wrong:
            say_(*wrap(
                f"WARNING: these parameters differ from a plain from_pretrained: "
                f"{sorted(set(wrong) - {FINAL_NORM} | set(still_wrong))}", 2))
        # Do the listed parameters hold the checkpoint's exact fp32 values (what a plain from_pretrained loads)?
        with deepspeed.zero.GatheredParameters(listed_params):
            loaded = {n: params[n].data.detach().float().clone() for n in listed}
        not_bf16 = [n for n in listed if not torch.equal(plain[n].bfloat16().float(), plain[n])]
        inexact = [n for n in listed if not torch.equal(loaded[n], plain[n])]
        say_(*wrap(
            f"Then {len(listed) - len(inexact)} of {len(listed)} listed parameters hold the exact fp32 values a "
            f"plain from_pretrained loads ({len(not_bf16)} of the {len(listed)} are not representable in bf16).", 2))
        if inexact:
            worst = max((loaded[n] - plain[n]).abs().max().item() for n in inexact)
            say_(*wrap(
                f"WARNING: {len(inexact)} listed parameters were loaded through bf16 (max |error| {worst:.1e}): " +
                ", ".join(compact({template(n)
                                   for n in inexact})), 2))
        say_("")

    say_(f"Training {args.steps} steps, {RUNS[run]}: AdamW lr {args.lr:g}, {world} x {args.micro_batch} sequences "
         f"per step (loaded in {time.time() - t_load:.1f} s)")
    losses, t0 = [], time.time()
    log_every = max(1, args.steps // 6)
    first = previous = gathered(listed_params)
    changes = torch.zeros_like(first, dtype=torch.int32)  # per listed element: in how many steps it changed
    for step in range(1, args.steps + 1):
        losses.append(train_step(engine, batch(step, rank, args.micro_batch)))
        current = gathered(listed_params)
        changes += (current != previous).int()
        previous = current
        if step == 1 or step % log_every == 0 or step == args.steps:
            bar = "#" * round(20 * step / args.steps)
            say_(f"  step {step:4d}/{args.steps}  [{bar:<20}]  loss {losses[-1]:.4f}  "
                 f"({(time.time() - t0) / step:.2f} s/step)")

    # Every parameter as the model computes with it, and its fp32 value (the optimizer's copy where there is one).
    with deepspeed.zero.GatheredParameters(list(params.values())):
        working = {n: p.data.detach().float().clone() for n, p in params.items()}
    fp32_values = {}
    for n, p in params.items():
        full = safe_get_full_fp32_param(p) if p.requires_grad else None
        fp32_values[n] = working[n] if full is None else full.detach().float().clone().view(p.ds_shape)

    if run == "bf16_auto":
        ckpt = out / "checkpoint"
        tag = f"global_step{args.steps}"
        engine.save_checkpoint(str(ckpt), tag=tag)
        if rank == 0:
            files = sorted((ckpt / tag).iterdir())
            size = sum(f.stat().st_size for f in files)
            say_(f"  saved the ZeRO checkpoint {ckpt}/{tag}/ ({len(files)} files, {size / 1e6:.1f} MB)")

    if rank == 0:
        torch.save(
            {
                "losses": losses,
                "listed": listed,
                "dtype": {
                    n: str(d).replace("torch.", "")
                    for n, d in dtype_of.items()
                },
                "trainable": {
                    n: p.requires_grad
                    for n, p in params.items()
                },
                "working": working,
                "fp32": fp32_values,
                "first": first,
                "last": previous,
                "changes": changes,
                "seconds": time.time() - t0,
            }, run_dir / "result.pt")
    engine.destroy()
    del engine, module, model, optimizer, params, hf_ds_config
    gc.collect()


def differs_from(model, reference):
    """{name: mean of the loaded value} for the parameters of a ZeRO-3 ``model`` that differ from ``reference`` (cast
    to the dtype they are held in); a collective call."""
    import torch
    import deepspeed
    named = list(model.named_parameters())
    with deepspeed.zero.GatheredParameters([p for _, p in named]):
        return {
            n: p.data.float().mean().item()
            for n, p in named if not torch.equal(p.data, reference[n].to(p.data.dtype))
        }


def final_norm_line(wrong, plain):
    """One sentence: what from_pretrained under ZeRO-3 did with the final norm, and why."""
    import transformers
    saved = plain[FINAL_NORM].mean().item()
    if FINAL_NORM not in wrong:
        return f"{FINAL_NORM} (the final norm, saved at mean {saved:.3f}) loaded right under ZeRO-3."
    got = wrong[FINAL_NORM]
    return (f"{FINAL_NORM} (the final norm, saved at mean {saved:.3f}) came back at {got:.3f}"
            f"{', its initial value' if got == 1.0 else ''}: transformers {transformers.__version__}'s ZeRO-3 loader "
            "renames '.norm.' to '.kv_norm.' in every key and drops it (docs/upstream/); loaded by hand.")


def compact(names):
    """'a.b.x', 'a.b.y' -> 'a.b.{x,y}'."""
    parents = {}
    for name in sorted(names):
        parent, _, leaf = name.rpartition(".")
        parents.setdefault(parent, []).append(leaf)
    return [f"{p}.{{{','.join(leaves)}}}" if len(leaves) > 1 else f"{p}.{leaves[0]}" for p, leaves in parents.items()]


def wrap(text, indent, width=WIDTH):
    return textwrap.wrap(text, width=width, subsequent_indent=" " * indent, break_on_hyphens=False)


def dtype_names(dtypes):
    return "/".join(sorted({str(d).replace("torch.", "") for d in dtypes}))


def report_kept(say_, module, pattern, params, dtype_of):
    import torch
    names = sorted(set(module._keep_in_fp32_modules_strict or []))
    total = sum(p.ds_numel for p in params.values())
    kept = [n for n in params if dtype_of[n] == torch.float32]
    kept_numel = sum(params[n].ds_numel for n in kept)
    buffers = dict(module.named_buffers())
    kept_buffers = [n for n in buffers if pattern.search(n) and buffers[n].dtype == torch.float32]
    other = [n for n in params if n not in kept]
    say_(
        *wrap(f"DeepSeek-V4 lists {len(names)} names for fp32 (_keep_in_fp32_modules_strict): {', '.join(names)}.", 2))
    say_(*wrap(
        f"Kept in fp32 under ZeRO-3 bf16: {len(kept)} of {len(params)} parameters ({kept_numel:,} of {total:,} "
        f"elements, {100 * kept_numel / total:.1f} %) and {len(kept_buffers)} listed buffers. The other "
        f"{len(other)} parameters are {dtype_names(dtype_of[n] for n in other)}; the other "
        f"{len(buffers) - len(kept_buffers)} buffers (not listed) are "
        f"{dtype_names(b.dtype for n, b in buffers.items() if n not in kept_buffers)}.", 2))
    unlisted = [n for n in kept if not pattern.search(n)]
    missed = [n for n in params if pattern.search(n) and n not in kept]
    if unlisted or missed:
        say_(f"  WARNING: fp32 but not listed: {unlisted}; listed but not fp32: {missed}")

    def most_specific(name):
        return max((n for n in names if re.search(n.replace("*", ".*"), name)), key=len, default="(not listed)")

    groups = {}
    for n in kept + kept_buffers:
        groups.setdefault(most_specific(n), []).append(n)
    width = max(len(g) for g in groups)
    say_(f"  {'listed name':<{width}}  count  elements  tensors (layer index as *)")
    for group in sorted(groups, key=lambda g: (names.index(g) if g in names else len(names), g)):
        members = groups[group]
        numel = sum(params[n].ds_numel if n in params else buffers[n].numel() for n in members)
        kinds = compact({template(n) for n in members})
        kinds = [k + (" (buffer)" if any(template(n) == k for n in members if n in buffers) else "") for k in kinds]
        say_(*wrap(f"  {group:<{width}}  {len(members):5d}  {numel:8,d}  {', '.join(kinds)}", width + 21))


# ---------------------------------------------------------------------------------------------------------------
# The parent
# ---------------------------------------------------------------------------------------------------------------


def run_all(args):
    """The three runs, in one launch on ``args.world_size`` ranks."""
    jobs = ",".join(RUNS)
    codes = launch(__file__, jobs, args, log_prefix=f"{jobs}.")
    if any(codes):
        fail(f"The run {jobs!r} failed (exit codes {codes}); the end of its logs:", args, log_prefix=f"{jobs}.")


def export(args):
    """Convert the checkpoint with its own zero_to_fp32.py and check the export against the trained values."""
    import torch
    from safetensors.torch import load_file
    out = Path(args.out)
    ckpt, target = out / "checkpoint", out / "export"
    shutil.rmtree(target, ignore_errors=True)
    script = ckpt / "zero_to_fp32.py"
    cmd = [sys.executable, str(script), str(ckpt), str(target), "--safe_serialization"]
    shown = " ".join([Path(sys.executable).name] + [os.path.relpath(c, out) for c in cmd[1:4]] + cmd[4:])
    print(f"Exporting through the checkpoint folder's own script (in {out}):\n  {shown}")
    t0 = time.time()
    done = subprocess.run(cmd, capture_output=True, text=True)
    (out / "logs" / "zero_to_fp32.log").write_text(done.stdout + done.stderr)
    if done.returncode:
        print(done.stdout[-3000:] + done.stderr[-3000:], file=sys.stderr)
        sys.exit(f"zero_to_fp32.py failed with exit code {done.returncode}")
    exported = {}
    for f in sorted(target.glob("*.safetensors")):
        exported.update(load_file(f))
    trained = torch.load(out / "runs" / "bf16_auto" / "result.pt")
    listed = set(trained["listed"])
    rows = {}
    for n, dtype in trained["dtype"].items():
        if n in listed:
            kind = "listed, kept in fp32"
        elif trained["trainable"][n]:
            kind = f"other trainable ({dtype})"
        else:
            kind = f"frozen ({dtype})"
        row = rows.setdefault(kind, {"dtype": set(), "n": 0, "numel": 0, "exported": set(), "equal": 0, "missing": 0})
        row["dtype"].add(dtype)
        row["n"] += 1
        row["numel"] += trained["fp32"][n].numel()
        if n not in exported:
            row["missing"] += 1
            continue
        row["exported"].add(str(exported[n].dtype).replace("torch.", ""))
        row["equal"] += torch.equal(exported[n], trained["fp32"][n])
    print(f"  {len(exported)} tensors in {', '.join(f.name for f in sorted(target.iterdir()))} "
          f"({time.time() - t0:.1f} s):")
    header = ("parameters", "count", "elements", "in training", "in the export", "equal to the trained fp32 values")
    table = [header]
    for kind, row in rows.items():
        equal = f"{row['equal']} of {row['n']}" + (f" ({row['missing']} missing)" if row["missing"] else "")
        table.append((kind, str(row["n"]), f"{row['numel']:,}", "/".join(sorted(row["dtype"])),
                      "/".join(sorted(row["exported"])) or "-", equal))
    widths = [max(len(r[i]) for r in table) for i in range(len(header))]
    for i, r in enumerate(table):
        print("  " +
              "  ".join(c.ljust(w) if j in (0, 3, 4, 5) else c.rjust(w)
                        for j, (c, w) in enumerate(zip(r, widths))).rstrip())
        if i == 0:
            print("  " + "  ".join("-" * w for w in widths))
    extra = sorted(set(exported) - set(trained["dtype"]))
    if extra:
        dtypes = "/".join(sorted({str(exported[n].dtype).replace("torch.", "") for n in extra}))
        print(*wrap(f"  plus {len(extra)} buffers ({dtypes}): {', '.join(compact({template(n) for n in extra}))}", 4),
              sep="\n")
    dtypes = {str(t.dtype).replace("torch.", "") for t in exported.values()}
    all_equal = all(row["equal"] == row["n"] for row in rows.values())
    print(*wrap(
        f"  Export dtypes: {', '.join(sorted(dtypes))}. {'Every' if all_equal else 'NOT every'} parameter equals "
        "bitwise the run's fp32 value of it: listed, the fp32 parameter itself; other trainable, the optimizer's "
        "fp32 copy; frozen, its bf16 value.", 2),
          sep="\n")


def compare(args):
    """A small table: the listed parameters of the three runs against the fp32 reference."""
    import torch
    out = Path(args.out)
    res = {run: torch.load(out / "runs" / run / "result.pt") for run in RUNS}
    ref = res["fp32"]
    trains = ref["changes"] > 0  # listed elements that get a gradient (the indexer's do not, in this model)
    is_norm = torch.cat([torch.full((ref["working"][n].numel(), ), "norm" in n) for n in ref["listed"]])
    near_one = trains & is_norm  # norm weights start at or a little above 1.0, where bf16 is coarse
    near_zero = trains & ~is_norm
    n_steps = len(ref["losses"])
    update = ref["last"] - ref["first"]

    def changed(run, mask):
        return f"{100 * res[run]['changes'][mask].sum().item() / (mask.sum().item() * n_steps):.1f} %"

    def distance(run, mask):
        if run == "fp32":
            return "-"
        return f"{100 * ((res[run]['last'] - ref['last'])[mask].norm() / update[mask].norm()).item():.1f} %"

    rows = [("", "fp32 ref", "bf16 \"auto\"", "bf16 []"),
            ("norm weights (a): steps that changed them", *(changed(r, near_one) for r in RUNS_ORDER)),
            ("  distance to fp32, relative to its update (b)", *(distance(r, near_one) for r in RUNS_ORDER)),
            ("other listed (c): steps that changed them", *(changed(r, near_zero) for r in RUNS_ORDER)),
            ("  distance to fp32, relative to its update (b)", *(distance(r, near_zero) for r in RUNS_ORDER)),
            ("loss, mean of the last 5 steps", *(f"{sum(res[r]['losses'][-5:]) / 5:.4f}" for r in RUNS_ORDER))]
    print(f"The listed parameters after {n_steps} steps, as the model computes with them:")
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    for r in rows:
        print("  " + r[0].ljust(widths[0]) + "".join("  " + c.rjust(w) for c, w in zip(r[1:], widths[1:])))
    notes = [
        f"(a) the {near_one.sum().item():,} elements of the listed norm weights that train. They start at 1.0 (the "
        "final norm in [1, 1.5)), where bf16 values lie 2^-8 to 2^-7 apart, more than an update. The share of steps "
        "x elements in which the value changed.",
        "(b) ||value - fp32 value|| / ||fp32 value - start value|| over those elements, after the last step.",
        f"(c) the {near_zero.sum().item():,} other listed elements that train (hyper-connection weights and scales, "
        "sinks, position biases). Both bf16 runs differ from fp32 there mostly through the bf16 compute of the "
        "rest of the model, which Adam turns into full-size updates where a gradient is near 0.",
    ]
    for note in notes:
        print(*wrap("  " + note, 6), sep="\n")
    lost = 100 - 100 * res["bf16_none"]["changes"][near_one].sum().item() / max(
        1, res["bf16_auto"]["changes"][near_one].sum().item())
    print(*wrap(
        f"With the list, the norm weights take every update and end within "
        f"{distance('bf16_auto', near_one)} of the fp32 run's update; without it, {lost:.0f} % of the updates that "
        f"change them do not reach their bf16 copy (the optimizer's fp32 copy moves, the model does not see it) "
        f"and they end {distance('bf16_none', near_one)} off.", 0),
          sep="\n")


def main():
    args = parse(arguments(__doc__, DEFAULT_OUT, steps=30, lr=3e-4))
    if args.worker:  # one rank of the runs named in --worker
        return worker(args.worker, lambda run, say_: train(run, args, say_))

    t_start = time.time()
    out = Path(args.out)
    for sub in ("model", "runs", "checkpoint", "export", "logs"):
        shutil.rmtree(out / sub, ignore_errors=True)
    out.mkdir(parents=True, exist_ok=True)

    import torch
    import transformers
    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    import importlib.metadata as md
    import importlib.util
    where = Path(importlib.util.find_spec("deepspeed").origin).parents[1]
    print(f"keep_in_fp32_modules demo: ZeRO-3 on {args.world_size} CPU ranks (gloo, DS_ACCELERATOR="
          f"{os.environ['DS_ACCELERATOR']})\ntorch {torch.__version__}, transformers {transformers.__version__}, "
          f"deepspeed {md.version('deepspeed')} from {where}")
    print(f"Output folder: {out}\n")

    model = tiny_model("deepseek_v4", seed=0)
    with torch.no_grad():  # a trained model's final norm is not at its initial 1.0
        model.model.norm.weight.add_(0.5 * torch.rand_like(model.model.norm.weight))
    write_model(model, out / "model")
    from safetensors.torch import save_file
    plain = transformers.DeepseekV4ForCausalLM.from_pretrained(out / "model", dtype=torch.float32)
    save_file({n: p.detach().contiguous() for n, p in plain.named_parameters()}, out / "model" / PLAIN_LOAD)
    numel = sum(p.numel() for p in model.parameters())
    print(f"[1/5] A tiny DeepSeek-V4 (hidden 32, 2 layers, 4 routed experts, vocab {VOCAB}; {numel:,} parameters, "
          f"random init, the final norm\n      in [1, 1.5)), written with save_pretrained: {out / 'model'}/"
          "model.safetensors (fp32)\n")
    del model, plain

    print(f"[2/5] from_pretrained(dtype=torch.bfloat16) under ZeRO-3 (HfDeepSpeedConfig) on {args.world_size} ranks,\n"
          "      data_types.keep_in_fp32_modules left at its default \"auto\", embeddings frozen")
    run_all(args)
    print("\n[4/5] ", end="")
    export(args)
    print("\n[5/5] ", end="")
    compare(args)
    print(f"\nDone in {time.time() - t_start:.0f} s. Everything is in {out}:")
    for name, what in (("model/", f"the tiny model (save_pretrained), initial_weights and {PLAIN_LOAD}"),
                       ("checkpoint/", "the ZeRO-3 checkpoint of the \"auto\" run, with its zero_to_fp32.py"),
                       ("export/", "zero_to_fp32.py's export (safetensors, fp32)"),
                       ("runs/", "losses and final values of the 3 runs (torch.load)"),
                       ("logs/", "the full output of every rank and of zero_to_fp32.py")):
        print(f"  {name:<12} {what}")


if __name__ == "__main__":
    main()
