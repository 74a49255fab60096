# Copyright (c) DeepSpeed Team.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""The accuracy study: what keeping the listed parameters in fp32 changes in training, against an fp32 reference.

    make study                     # or: .venv/bin/python benchmarks/accuracy_study.py [--steps N] [--out DIR]

Two parts, each with three ZeRO-3 runs per model from the same weights on the same data:

* ``fp32``: the reference, bf16 disabled;
* ``bf16 + list``: bf16 with the listed parameters kept in fp32, ``keep_in_fp32_modules`` at its default ``"auto"``
  (the model's ``_keep_in_fp32_modules_strict``) or, for gpt-oss, an explicit list: gpt-oss lists its norms only in
  ``_keep_in_fp32_modules``, which applies to fp16, so under bf16 ``"auto"`` keeps nothing;
* ``bf16 []``: bf16 with ``keep_in_fp32_modules: []``, everything in bf16 (the behavior before the option).

The values part (``--steps``, ``--lr``): tiny DeepSeek-V4 (``"auto"``) and gpt-oss (``["sinks", "norm"]``), AdamW with
a constant learning rate of 1e-4, below bf16's resolution for values near 1 (2^-8 to 2^-7): without the list the
bf16 copy of a norm weight moves only when the optimizer's fp32 copy has drifted by half a bf16 step. After every
step each rank gathers the listed parameters (the values the model computes with).

The routing part (``--routing-setting``, ``--seeds``, ``--routing-steps``, ``--routing-lr``): what keeping buys for MoE
routing, with its spread over seeds. Setting ``tiny``: tiny DeepSeek-V3, DeepSeek-V4 and ERNIE 4.5 MoE (``"auto"``)
and gpt-oss (``["sinks"]``: its router does not cast its input to fp32, so its router is not listed), hidden 32, 4
routed experts. Setting ``large``: DeepSeek-V3 (its list holds its router weight) and DeepSeek-V4 (its list holds its
norms, hyper-connections and sinks, not its router weight) at hidden 256 with 8 routed experts, on more tokens.
The models learn token sequences of a few topics (a router can learn to send each topic to its experts), with a
learning rate that warms up, decays and ends in a small tail, where most updates are below bf16's resolution. Each
seed draws the initial weights and the training sequences; the three runs of a seed share both. Every
``--routing-steps // 20`` steps each run routes fixed held-out tokens: the study compares each token's top-k expert
set, per MoE layer, with the fp32 run's, and the router weights, routing biases and sinks with the fp32 run's; it
also applies the fp32 run's router to each bf16 run's router inputs (and each run's router to the fp32 run's
inputs), to tell apart what the router's values and what its input change. What the list changes, each alone, on
the fp32 run's weights after the runs: the forward (the listed tensors rounded to bf16 or not, everything else as
the bf16 runs hold it), the gradients (the router weight's and the listed tensors' against fp32's) and the loading
(the listed tensors' rounding at step 0). ``--parallel N`` runs N launches side by side (on one GPU, with
``--world-size 1``: the GPU check's ``study`` part).

The study prints and writes ``results.md`` (the tables) into ``--out`` and the plots into ``docs/images/`` (copied to
``--out``).
"""

import argparse
import json
import math
import os
import platform
import shlex
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
    "deepseek_v3": "DeepSeek-V3",
    "ernie4_5_moe": "ERNIE 4.5 MoE",
}
VALUE_MODELS = ("deepseek_v4", "gpt_oss")  # the values part
ROUTING_MODELS = ("deepseek_v3", "deepseek_v4", "ernie4_5_moe", "gpt_oss")  # the routing part
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
# The same in the routing part (gpt-oss's router computes in bf16 under bf16, fp32 weight or not: not listed).
ROUTING_KEEP = {
    "deepseek_v3": "auto",
    "deepseek_v4": "auto",
    "ernie4_5_moe": "auto",
    "gpt_oss": ["sinks"],
}
# The routing part's settings: the models, the data (a vocabulary of ``vocab`` tokens in ``topics`` topics,
# sequences of ``seq`` tokens) and the defaults of --seeds, --routing-steps, --routing-lr, --world-size,
# --micro-batch and --parallel. The large setting runs each seed's runs on one rank, two launches side by side: on
# 2 CPU cores about twice as fast as on two ranks (no gloo collectives), the same tokens per step.
SETTINGS = {
    "tiny":
    dict(models=ROUTING_MODELS,
         vocab=tiny_runs.VOCAB,
         seq=tiny_runs.SEQ,
         topics=4,
         seeds=5,
         steps=400,
         lr=1e-3,
         world_size=2,
         micro_batch=8,
         parallel=1),
    "large":
    dict(models=("deepseek_v3", "deepseek_v4"),
         vocab=256,
         seq=32,
         topics=8,
         seeds=5,
         steps=400,
         lr=1e-3,
         world_size=1,
         micro_batch=16,
         parallel=2),
}
# The large setting's models: hidden 256, 2 MoE layers of 8 routed experts (top 2) and a shared expert.
LARGE_SIZES = {
    "deepseek_v3":
    dict(vocab_size=256,
         hidden_size=256,
         intermediate_size=512,
         moe_intermediate_size=128,
         num_attention_heads=4,
         num_key_value_heads=4,
         n_routed_experts=8,
         kv_lora_rank=64,
         q_lora_rank=64,
         qk_rope_head_dim=16,
         qk_nope_head_dim=32,
         v_head_dim=64,
         max_position_embeddings=128),
    "deepseek_v4":
    dict(tiny_runs.SIZES["deepseek_v4"],
         vocab_size=256,
         hidden_size=256,
         moe_intermediate_size=128,
         head_dim=64,
         q_lora_rank=64,
         o_lora_rank=64,
         n_routed_experts=8,
         index_head_dim=32,
         max_position_embeddings=128),
}
# What the list of each routing model keeps (the bf16 + list runs).
KEPT_TEXT = {
    "deepseek_v3": "DeepSeek-V3 (`\"auto\"`): the router weight (a parameter) and the routing bias (a buffer, which "
    "DeepSpeed 0.19.8's own `\"auto\"` keeps in fp32 already)",
    "ernie4_5_moe": "ERNIE 4.5 MoE (`\"auto\"`): the router weight and the routing bias (a parameter without "
    "gradient)",
    "deepseek_v4": "DeepSeek-V4 (`\"auto\"`): its norms, hyper-connections, sinks (parameters) and its routing bias (a "
    "buffer), not its router weight, which it does not list",
    "gpt_oss": "gpt-oss (`[\"sinks\"]`: it lists nothing for bf16): its sinks",
}
SETTING_TEXT = {
    "tiny": "hidden 32, 2 MoE layers of 4 routed experts, top 2",
    "large": "hidden 256, 2 MoE layers of 8 routed experts, top 2",
}
# Its held-out sequences; its evaluations per run.
HELD_OUT, HELD_OUT_SEED = 64, 999_983
EVALS = 20
# Its learning rate, a factor of --routing-lr: linear warm-up over the first 5 % of the steps, cosine decay to TAIL
# at 75 %, then TAIL to the end.
WARMUP, DECAY_END, TAIL = 0.05, 0.75, 0.01
# The routing biases (e_score_correction_bias) start at values drawn from N(0, BIAS_STD^2), as in a trained
# checkpoint, not at transformers' zeros (where rounding to bf16 would change nothing).
BIAS_STD = 0.02

# ---------------------------------------------------------------------------------------------------------------
# Models and data
# ---------------------------------------------------------------------------------------------------------------


def describe_keep(keep):
    return '"auto"' if keep == "auto" else "[" + ", ".join(f'"{k}"' for k in keep) + "]"


def routing_model(model_name, seed=0, setting="tiny"):
    """The ``model_name`` of the routing part's ``setting``, random init after ``torch.manual_seed(seed)``, its
    routing biases drawn from N(0, BIAS_STD^2). ERNIE 4.5 MoE is not among the shared tiny models: its config is
    here."""
    import torch
    import transformers
    if setting == "large":
        model = tiny_runs.tiny_hf_models.tiny_model(model_name, seed=seed, **LARGE_SIZES[model_name])
    elif model_name == "ernie4_5_moe":
        # hidden 32, 2 MoE layers of 4 experts (top 2) and a shared expert
        cfg = transformers.Ernie4_5_MoeConfig(vocab_size=tiny_runs.VOCAB,
                                              hidden_size=32,
                                              intermediate_size=64,
                                              moe_intermediate_size=16,
                                              num_hidden_layers=2,
                                              num_attention_heads=2,
                                              num_key_value_heads=1,
                                              moe_num_experts=4,
                                              moe_k=2,
                                              moe_num_shared_experts=1,
                                              moe_layer_start_index=0,
                                              moe_layer_end_index=1,
                                              max_position_embeddings=64,
                                              pad_token_id=None,
                                              tie_word_embeddings=False)
        torch.manual_seed(seed)
        model = transformers.Ernie4_5_MoeForCausalLM(cfg)
    elif model_name in tiny_runs.SIZES:
        model = tiny_runs.tiny_model(model_name, seed=seed)
    else:  # DeepSeek-V3: the shared tiny model's sizes (hidden 32, 2 MoE layers of 4 experts, top 2)
        model = tiny_runs.tiny_hf_models.tiny_model(model_name, seed=seed)
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, t in [*model.named_parameters(), *model.named_buffers()]:
            if name.endswith("e_score_correction_bias"):
                t.copy_(BIAS_STD * torch.randn(t.shape, generator=g))
    return model


def topic_batch(n, seed, setting="tiny"):
    """``n`` token sequences of the ``setting``, each of one of its topics: a topic has its own share of the
    vocabulary and its own order of it (a permutation); the next token is the current one's successor with
    probability 0.8, another token of the topic with 0.15 and any token with 0.05. The same for a given ``seed`` in
    every run."""
    import torch
    vocab, seq, topics = (SETTINGS[setting][k] for k in ("vocab", "seq", "topics"))
    g0 = torch.Generator().manual_seed(4242)  # the topics: the same in every call
    tokens = torch.randperm(vocab, generator=g0).view(topics, -1)
    per_topic = tokens.shape[1]
    successor = torch.empty(vocab, dtype=torch.long)
    for t in range(topics):
        successor[tokens[t]] = tokens[t][torch.randperm(per_topic, generator=g0)]
    g = torch.Generator().manual_seed(seed)
    topic = torch.randint(topics, (n, ), generator=g)
    ids = torch.empty(n, seq, dtype=torch.long)
    ids[:, 0] = tokens[topic, torch.randint(per_topic, (n, ), generator=g)]
    for i in range(1, seq):
        u = torch.rand(n, generator=g)
        same_topic = tokens[topic, torch.randint(per_topic, (n, ), generator=g)]
        anything = torch.randint(vocab, (n, ), generator=g)
        ids[:, i] = torch.where(u < 0.8, successor[ids[:, i - 1]], torch.where(u < 0.95, same_topic, anything))
    return ids


def lr_factor(step, steps):
    """The routing part's learning rate at ``step`` of ``steps``, as a factor of the peak."""
    warm, end = max(1, round(WARMUP * steps)), max(2, round(DECAY_END * steps))
    if step < warm:
        return (step + 1) / warm
    if step >= end:
        return TAIL
    return TAIL + (1 - TAIL) * 0.5 * (1 + math.cos(math.pi * (step - warm) / max(1, end - warm)))


def routers_of(module):
    """The learned top-k routers of ``module``, by name (DeepSeek-V3/V4, ERNIE 4.5 MoE and gpt-oss call them
    ``...TopkRouter``/``...TopKRouter``; their forward returns the top-k expert indices last)."""
    return [(n, m) for n, m in module.named_modules() if type(m).__name__.lower().endswith("topkrouter")]


def tensor_kind(name):
    """What a tracked tensor of the routing part is, for the tables."""
    if name.endswith("sinks"):
        return "sinks"
    if name.endswith("e_score_correction_bias"):
        return "routing bias"
    if name.endswith(".bias"):
        return "router bias"
    return "router weight"


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
    master = torch.cat([safe_get_full_fp32_param(p).detach().float().flatten() for p in listed_params]).cpu()
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


def routing_dir(out, setting, model_name, seed):
    return Path(out) / "models" / "routing" / setting / model_name / f"s{seed}"


def routing_run(out, setting, model_name, seed, run):
    return Path(out) / "runs" / f"routing.{setting}.{model_name}.s{seed}.{run}.pt"


def train_routing(setting, model_name, seed, run, args, say_):
    """One run of the routing part: ``args.steps`` steps on topic sequences in the order of ``seed``, the held-out
    tokens routed every ``args.steps // EVALS`` steps (and before the first)."""
    import gc
    import torch
    import deepspeed
    import deepspeed.comm as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    keep = [] if run == "bf16_none" else ROUTING_KEEP[model_name]
    ds_config = tiny_runs.zero3_config(args.micro_batch, bf16=run != "fp32", keep=None if keep == "auto" else keep)
    model, hf_ds_config = tiny_runs.from_pretrained_zero3(routing_dir(args.out, setting, model_name, seed), ds_config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    steps = args.steps

    def schedule(opt):
        return torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_factor(s, steps))

    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, lr_scheduler=schedule, config=ds_config)
    module = engine.module

    # The routers, and what the study compares: their parameters and buffers, and the attention sinks.
    routers = routers_of(module)
    tracked = {f"{r}.{n}": (t, True) for r, m in routers for n, t in m.named_parameters()}
    tracked.update({f"{r}.{n}": (t, False) for r, m in routers for n, t in m.named_buffers()})
    tracked.update({n: (t, True) for n, t in module.named_parameters() if n.endswith("sinks")})
    kinds = {
        n:
        ("parameter" if is_param else "buffer", str(t.ds_tensor.dtype if is_param else t.dtype).replace("torch.", ""))
        for n, (t, is_param) in tracked.items()
    }
    # The dtype of every parameter and buffer, as the run holds it (the analysis computes the fp32 run's weights so).
    dtypes = {n: str(p.ds_tensor.dtype).replace("torch.", "") for n, p in module.named_parameters()}
    dtypes.update({n: str(b.dtype).replace("torch.", "") for n, b in module.named_buffers()})
    held_out = topic_batch(HELD_OUT, HELD_OUT_SEED, setting).to(engine.device)
    every = max(1, steps // EVALS)
    evals, losses, t0 = [], [], time.time()

    def evaluate(engine, step):
        captured = {}

        def hook(name):

            def record(mod, inputs, output):
                h = inputs[0].detach()
                captured[name] = (h.reshape(-1, h.shape[-1]).to("cpu", torch.float32, copy=True),
                                  output[-1].detach().sort(-1).values.cpu())

            return record

        handles = [m.register_forward_hook(hook(n)) for n, m in routers]
        with torch.no_grad():
            loss = engine(input_ids=held_out, labels=held_out).loss.float().item()
        for h in handles:
            h.remove()
        with deepspeed.zero.GatheredParameters([t for t, is_param in tracked.values() if is_param]):
            # copies: at world size 1 a gathered parameter is the one the next steps update in place
            values = {n: t.detach().to("cpu", torch.float32, copy=True) for n, (t, _) in tracked.items()}
        evals.append({
            "step": step,
            "loss": loss,
            "lr": float(engine.get_lr()[0]),
            "inputs": torch.stack([captured[n][0] for n, _ in routers]),
            "topk": torch.stack([captured[n][1] for n, _ in routers]),
            "values": values,
        })
        if run == "fp32":  # all its weights, for the analysis
            with deepspeed.zero.GatheredParameters(list(module.parameters())):
                evals[-1]["state"] = {n: p.detach().cpu().clone() for n, p in module.named_parameters()}
            evals[-1]["state"].update({n: b.detach().cpu().clone() for n, b in module.named_buffers()})

    label = f"{MODELS[model_name]} ({setting}, seed {seed}), {RUNS[run]}"
    if seed == 0:  # the dtypes, once per model and run
        say_(f"{label}: {len(routers)} routers; "
             f"{', '.join(f'{n} {k[0]} {k[1]}' for n, k in kinds.items() if '.0.' in n)}; {steps} steps on {world} "
             f"rank{'s' if world > 1 else ''}")
    evaluate(engine, 0)
    for step in range(1, steps + 1):
        ids = topic_batch(args.micro_batch, seed=step * 1_009 + rank + seed * 1_000_003, setting=setting)
        losses.append(tiny_runs.train_step(engine, ids))
        if step % every == 0 or step == steps:
            evaluate(engine, step)
    say_(f"  {label}: loss {losses[-1]:.4f}, held-out {evals[-1]['loss']:.4f} after {steps} steps "
         f"({(time.time() - t0) / steps:.3f} s/step)")
    if rank == 0:
        torch.save(
            {
                "losses": losses,
                "evals": evals,
                "routers": [n for n, _ in routers],
                "kinds": kinds,
                "dtypes": dtypes,
                "seconds": time.time() - t0,
            }, routing_run(args.out, setting, model_name, seed, run))
    engine.destroy()
    del engine, model, optimizer, hf_ds_config
    gc.collect()


# ---------------------------------------------------------------------------------------------------------------
# The parent: launch, analyse, report, plot
# ---------------------------------------------------------------------------------------------------------------


def run_all(jobs, args, log_prefix=""):
    """The ``jobs`` (part/...), in ``args.parallel`` launches side by side, each on ``args.world_size`` ranks. A list
    of lists: one launch per list where there are launches enough (a seed's runs: its results come whole, early),
    else the jobs dealt out in turn (the launches take about as long)."""
    from concurrent.futures import ThreadPoolExecutor
    groups = jobs if jobs and isinstance(jobs[0], list) else [jobs]
    flat = [j for g in groups for j in g]
    n = max(1, min(args.parallel, len(flat)))
    shares = groups if len(groups) == n else [flat[i::n] for i in range(n)]
    prefixes = [log_prefix + (f"{i}-" if n > 1 else "") for i in range(n)]
    limit = args.train_seconds
    start = time.time()
    with ThreadPoolExecutor(n) as pool:
        codes = list(
            pool.map(lambda i: tiny_runs.launch(__file__, ",".join(shares[i]), args, prefixes[i], timeout=limit or
                                                4 * 3600), range(n)))
    if limit and time.time() - start >= limit:
        print(f"--train-seconds {limit:g}: training stopped; the runs that finished are analysed")
        return
    for i, c in enumerate(codes):
        if any(c):
            tiny_runs.fail(f"The study failed (exit codes {c}); the end of the logs:", args, prefixes[i])


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


def analyse_routing(setting, model_name, seed, out):
    """The routing part's numbers of one model and seed: per run, per evaluation, the routing agreement with the fp32
    run, per layer, for the run itself, for the fp32 run's router on the run's router inputs and for the run's router
    on the fp32 run's inputs; the held-out loss; the distance of the tracked tensors to the fp32 run's; and what the
    list changes, each alone, on the fp32 run's weights: the forward, the gradients, the loading."""
    import torch
    import transformers
    res = {run: torch.load(routing_run(out, setting, model_name, seed, run)) for run in RUNS}
    ref = res["fp32"]
    routers = ref["routers"]
    model_dir = routing_dir(out, setting, model_name, seed)
    # The routers in fp32, to route given inputs with given values (a run's, at one evaluation).
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    modules = dict(model.named_modules())

    def route(values, inputs):
        topk = []
        for name, h in zip(routers, inputs):
            mod = modules[name]
            mod.load_state_dict({k[len(name) + 1:]: v for k, v in values.items() if k.startswith(name + ".")})
            with torch.no_grad():
                topk.append(mod(h)[-1].sort(-1).values)
        return torch.stack(topk)

    def agree(a, b):
        """Per layer: the share of tokens whose top-k expert sets are equal."""
        return (a == b).all(-1).float().mean(-1)

    # The whole model, to route the held-out tokens with the fp32 run's weights in a run's dtypes.
    # On the accelerator where there is one (the GPU check), else on the CPU.
    from deepspeed.accelerator import get_accelerator
    device = get_accelerator().device_name()
    full = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(device)
    full_routers = routers_of(full)
    held_out_ids = topic_batch(HELD_OUT, HELD_OUT_SEED, setting).to(device)

    def load(state, dtypes):
        """The fp32 run's weights ``state`` into ``full``, each tensor in its dtype in ``dtypes``."""
        for n, t in [*full.named_parameters(), *full.named_buffers()]:
            if n in state:
                t.data = state[n].to(device=device, dtype=getattr(torch, dtypes.get(n, "float32")))

    def route_model(state, dtypes):
        """The held-out tokens' top-k sets and router logits with the weights ``state`` in ``dtypes``."""
        with torch.no_grad():
            load(state, dtypes)
            out_ = {}
            handles = [
                m.register_forward_hook(lambda mod, i, o, n=n: out_.__setitem__(n, (o[-1].sort(-1).values, o[0])))
                for n, m in full_routers
            ]
            full(input_ids=held_out_ids)
            for h in handles:
                h.remove()
        return (torch.stack([out_[n][0] for n in routers]).cpu(), torch.stack([out_[n][1].float()
                                                                                for n in routers]).cpu())

    def gradients(state, dtypes, names):
        """The held-out loss's gradients of ``names``, in fp32, with the weights ``state`` in ``dtypes``."""
        load(state, dtypes)
        full.zero_grad(set_to_none=True)
        full(input_ids=held_out_ids, labels=held_out_ids).loss.backward()
        params = dict(full.named_parameters())
        # a parameter the loss does not reach (DeepSeek-V4's indexer, behind its top-k) has no gradient: 0
        return torch.cat([(params[n].grad if params[n].grad is not None else torch.zeros_like(params[n])).float().flatten()
                          for n in names]).cpu()

    names = list(ref["evals"][0]["values"])
    groups = {}
    for n in names:
        groups.setdefault(tensor_kind(n), []).append(n)
    steps = [e["step"] for e in ref["evals"]]
    # Offline, the fp32 run's routers must route its own inputs as they did in training.
    reproduced = min(float(agree(route(e["values"], e["inputs"]), e["topk"]).min()) for e in ref["evals"])
    rows, curves = {}, {"steps": steps, "lr": [e["lr"] for e in ref["evals"]]}
    # The fp32 run's router weights at the end: the share of elements for which an update of the tail's learning
    # rate (about the size of an Adam update) is below half the distance between bf16 values there.
    weights = torch.cat([ref["evals"][-1]["values"][n].flatten() for n in groups["router weight"]])
    half_step = torch.exp2(torch.floor(torch.log2(weights.abs().clamp_min(1e-30))) - 8)
    below = float((half_step > ref["evals"][-1]["lr"]).float().mean())
    tail = [i for i, s in enumerate(steps) if s >= DECAY_END * steps[-1]]
    # Whether the fp32 run's routing has settled: its top-k sets equal to those of its previous evaluation, over the
    # second half of the decay (the learning rate 1-30 % of its peak) and over the tail.
    late = [i for i, s in enumerate(steps) if 0.5 * steps[-1] <= s < DECAY_END * steps[-1]]
    settled = {
        k: float(torch.stack([agree(ref["evals"][i]["topk"], ref["evals"][i - 1]["topk"]) for i in idx]).mean())
        for k, idx in (("decay", late), ("tail", tail))
    }
    routed = {}  # (run, evaluation): the fp32 run's weights in the run's dtypes route the held-out tokens
    for run, r in res.items():
        own, ref_router, own_router, dist = [], [], [], {g: [] for g in groups}
        compute = []  # the fp32 run's weights in this run's dtypes (for the fp32 run, itself: nothing to route)
        for i, (e, e_ref) in enumerate(zip(r["evals"], ref["evals"])):
            own.append(agree(e["topk"], e_ref["topk"]))
            if run != "fp32":
                routed[run, i] = route_model(e_ref["state"], r["dtypes"])
            compute.append(agree(routed[run, i][0], e_ref["topk"]) if run != "fp32" else own[-1])
            ref_router.append(agree(route(e_ref["values"], e["inputs"]), e_ref["topk"]))
            own_router.append(agree(route(e["values"], e_ref["inputs"]), e_ref["topk"]))
            for g, ns in groups.items():
                a = torch.cat([e["values"][n].flatten() for n in ns])
                b = torch.cat([e_ref["values"][n].flatten() for n in ns])
                dist[g].append((float((a - b).norm() / b.norm().clamp_min(1e-30)), float((a - b).abs().max())))
        own, ref_router, own_router, compute = (torch.stack(x) for x in (own, ref_router, own_router, compute))
        # At step 0 the runs start from the fp32 run's weights: offline, they must route as in training.
        offline_0 = agree(route_model(ref["evals"][0]["state"], r["dtypes"])[0], r["evals"][0]["topk"])
        held_out = torch.tensor([e["loss"] for e in r["evals"]])
        ref_held_out = torch.tensor([e["loss"] for e in ref["evals"]])
        kept = {}
        for g, ns in groups.items():
            kept[g] = " / ".join(sorted({" ".join(r["kinds"][n]) for n in ns}))
        rows[run] = {
            "agree_0": float(own[0].mean()),
            "agree_final_layers": own[-1].tolist(),
            "agree_final": float(own[-1].mean()),
            "agree_tail": float(own[tail].mean()),
            "ref_router_0": float(ref_router[0].mean()),
            "ref_router_tail": float(ref_router[tail].mean()),
            "own_router_tail": float(own_router[tail].mean()),
            "compute_0": float(compute[0].mean()),
            "compute_tail": float(compute[tail].mean()),
            "offline_0": float(offline_0.mean()),
            "held_out_final": float(held_out[-1]),
            "held_out_diff_tail": float((held_out - ref_held_out)[tail].mean()),
            "train_loss_final": float(torch.tensor(r["losses"][-20:]).mean()),
            "kept": kept,
            "dist_0": {
                g: d[0]
                for g, d in dist.items()
            },
            "dist_final": {
                g: d[-1]
                for g, d in dist.items()
            },
            "seconds": r["seconds"],
        }
        curves[run] = {
            "agree": own.mean(-1).tolist(),
            "ref_router": ref_router.mean(-1).tolist(),
            "compute": compute.mean(-1).tolist(),
            "held_out_diff": (held_out - ref_held_out).tolist(),
        }

    # What the list changes, each alone, on the fp32 run's weights (the analysis model, plain torch, one process).
    list_dtypes, none_dtypes = res["bf16_list"]["dtypes"], res["bf16_none"]["dtypes"]
    params = dict(full.named_parameters())
    # the listed tensors: parameters and buffers (routing biases) the list run holds in fp32 and the [] run not
    listed = [n for n in [*params, *dict(full.named_buffers())]
              if list_dtypes.get(n) == "float32" and none_dtypes.get(n) != "float32"]
    router_weights = [f"{n}.weight" for n in routers]
    # the listed parameters that train, but a router weight (DeepSeek-V3's and ERNIE's list holds theirs)
    others = [n for n in listed if n in params and params[n].requires_grad and n not in router_weights]
    forward_flip, forward_logits = [], []
    for i in tail:
        (topk_list, logits_list), (topk_none, logits_none) = routed["bf16_list", i], routed["bf16_none", i]
        forward_flip.append(1 - float(agree(topk_list, topk_none).mean()))
        forward_logits.append(float((logits_none - logits_list).norm() / logits_list.norm()))
    # The gradients at the first evaluation of the tail: in fp32, in the list's dtypes and in []'s.
    state = ref["evals"][tail[0]]["state"]
    grads = {k: gradients(state, d, router_weights + others) for k, d in (("fp32", ref["dtypes"]), ("list", list_dtypes),
                                                                          ("none", none_dtypes))}
    split = sum(params[n].numel() for n in router_weights)

    def rel(a, b):
        return float((a - b).norm() / b.norm().clamp_min(1e-30))

    start = ref["evals"][0]["state"]
    loaded = torch.cat([start[n].flatten() for n in listed])
    cause = {
        # the forward: the listed tensors rounded or not, everything else in bf16 (the tail's evaluations)
        "forward_flip": sum(forward_flip) / len(forward_flip),
        "forward_logits": sum(forward_logits) / len(forward_logits),
        # the gradients, against fp32's
        "grad_router": {k: rel(grads[k][:split], grads["fp32"][:split])
                        for k in ("list", "none")},
        "grad_others": {k: rel(grads[k][split:], grads["fp32"][split:]) if others else 0.0
                        for k in ("list", "none")},
        # the loading: the listed tensors' rounding (what it changes at step 0: info["paired"]["agree_0"])
        "load_rounding": rel(loaded.bfloat16().float(), loaded),
        # the router weights' distance to the fp32 run's at the end
        "router_drift": {k: rows[r]["dist_final"]["router weight"][0]
                         for k, r in (("list", "bf16_list"), ("none", "bf16_none"))},
    }
    info = {
        "layers": len(routers),
        "tokens": int(ref["evals"][0]["topk"].shape[1]),
        "k": int(ref["evals"][0]["topk"].shape[2]),
        "groups": {
            g: sum(ref["evals"][0]["values"][n].numel() for n in ns)
            for g, ns in groups.items()
        },
        "reproduced": reproduced,
        "offline_0": min(r["offline_0"] for r in rows.values()),
        "below": below,
        "settled": settled,
        "tail_lr": ref["evals"][-1]["lr"],
        "tail_steps": (steps[tail[0]], steps[-1], len(tail)),
        "cause": cause,
        "listed": listed,
        "others": others,
        # whether the loss reaches them (ERNIE's routing bias is a parameter without gradient)
        "others_train": bool(others) and bool(grads["fp32"][split:].abs().sum() > 0),
    }
    return info, rows, curves


def interval(xs):
    """Mean and the half-width of its 95 % interval (Student's t) over the values ``xs`` (one per seed)."""
    import statistics
    t = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262, 10: 2.228,
         12: 2.179, 15: 2.131, 20: 2.086, 30: 2.042}  # t(0.975, df); between two entries the smaller df's (wider)
    m = statistics.fmean(xs)
    if len(xs) < 2:
        return m, float("nan")
    return m, t[max(k for k in t if k <= len(xs) - 1)] * statistics.stdev(xs) / math.sqrt(len(xs))


def over_seeds(per_seed):
    """One model's per-seed results (seed: (info, rows, curves)) as one: every number of a row, of ``info["cause"]``
    and of the curves as (mean, half-width of the 95 % interval) over the seeds; the paired differences list - []
    per seed."""
    seeds = sorted(per_seed)

    def merge(values):
        first = values[0]
        if isinstance(first, dict):
            return {k: merge([v[k] for v in values]) for k in first}
        if isinstance(first, (list, tuple)) and first and isinstance(first[0], (int, float)):
            return [merge([v[i] for v in values]) for i in range(len(first))]
        if isinstance(first, (int, float)) and not isinstance(first, bool):
            return interval([float(v) for v in values])
        return first

    info = dict(per_seed[seeds[0]][0])
    info["cause"] = merge([per_seed[s][0]["cause"] for s in seeds])
    info["settled"] = merge([per_seed[s][0]["settled"] for s in seeds])
    info["below"] = merge([per_seed[s][0]["below"] for s in seeds])
    info["reproduced"] = min(per_seed[s][0]["reproduced"] for s in seeds)
    info["offline_0"] = min(per_seed[s][0]["offline_0"] for s in seeds)
    info["seeds"] = seeds
    rows = {run: merge([per_seed[s][1][run] for s in seeds]) for run in RUNS}
    curves = {k: merge([per_seed[s][2][k] for s in seeds]) for k in per_seed[seeds[0]][2] if k in RUNS}
    curves["steps"] = per_seed[seeds[0]][2]["steps"]
    paired = {}
    for key in ("agree_tail", "compute_tail", "held_out_diff_tail", "agree_0"):
        d = [per_seed[s][1]["bf16_list"][key] - per_seed[s][1]["bf16_none"][key] for s in seeds]
        paired[key] = {"per_seed": d, "interval": interval(d)}
    for key in ("router_drift", "grad_router"):  # list - [] of what the list changes, per seed
        d = [per_seed[s][0]["cause"][key]["list"] - per_seed[s][0]["cause"][key]["none"] for s in seeds]
        paired[key] = {"per_seed": d, "interval": interval(d)}
    info["paired"] = paired
    return info, rows, curves


def pm(x, scale=100, digits=1, unit=" %", sign=""):
    """``(mean, half-width)`` as ``mean ± half-width`` (scaled); a plain number as itself."""
    m, h = x if isinstance(x, (list, tuple)) else (x, float("nan"))
    text = f"{scale * m:{sign}.{digits}f}"
    return text + (f" ± {scale * h:.{digits}f}" if h == h else "") + unit


def sci_pm(x, sign=""):
    m, h = x
    return f"{m:{sign}.1e}" + (f" ± {h:.0e}" if h == h else "")


def verdict(paired, above="list above []", below="list below []"):
    """Whether the list and [] differ beyond the spread: the 95 % interval of the paired difference excludes 0."""
    m, h = paired["interval"]
    if h != h:
        return "one seed: no spread"
    return above if m - h > 0 else (below if m + h < 0 else "within the spread")


def routing_tables(results):
    """The routing part's tables: agreement and losses (mean ± 95 % interval over seeds); list - [] per seed; what
    the list changes, each alone; the values of the tracked tensors."""
    agreement, paired, cause, values = [], [], [], []
    for model_name, (info, rows, _) in results.items():
        for run in RUNS:
            r = rows[run]
            label = run_label(model_name, run, ROUTING_KEEP)
            ref = run == "fp32"
            agreement.append((MODELS[model_name], label, "-" if ref else pm(r["agree_0"]),
                              "-" if ref else pm(r["agree_tail"]), "-" if ref else pm(r["compute_tail"]),
                              "-" if ref else pm(r["ref_router_tail"]), "-" if ref else pm(r["own_router_tail"]),
                              pm(r["held_out_final"], 1, 4, ""),
                              "-" if ref else sci_pm(r["held_out_diff_tail"], "+")))
            for g, n in info["groups"].items():
                values.append((MODELS[model_name], label, f"{g} ({n})", r["kept"][g],
                               "-" if ref else f"{r['dist_0'][g][0][0]:.1e}",
                               "-" if ref else sci_pm(r["dist_final"][g][0]),
                               "-" if ref else f"{r['dist_final'][g][1][0]:.1e}"))
        pr = info["paired"]
        paired.append((MODELS[model_name], len(info["seeds"]), pm(pr["agree_tail"]["interval"], sign="+", unit=""),
                       " / ".join(f"{100 * d:+.1f}" for d in pr["agree_tail"]["per_seed"]),
                       f"{pm(pr['compute_tail']['interval'], digits=2, sign='+', unit='')} ({verdict(pr['compute_tail'])})",
                       f"{sci_pm(pr['router_drift']['interval'], '+')} "
                       f"({verdict(pr['router_drift'], 'list farther', 'list closer')})",
                       sci_pm(pr["held_out_diff_tail"]["interval"], "+"), verdict(pr["agree_tail"]),
                       verdict(pr["held_out_diff_tail"], "list's loss higher", "list's loss lower")))
        c = info["cause"]
        cause.append((MODELS[model_name], describe_keep(ROUTING_KEEP[model_name]), pm(c["forward_flip"], digits=2),
                       sci_pm(c["forward_logits"]), pm(pr["compute_tail"]["interval"], digits=2, sign="+", unit=" points"),
                       f"{sci_pm(c['grad_router']['list'])} / {sci_pm(c['grad_router']['none'])}",
                       f"{sci_pm(c['grad_others']['list'])} / {sci_pm(c['grad_others']['none'])}"
                       if info["others_train"] else
                       ("- (no gradient)" if info["others"] else "- (none but the router weight)"), sci_pm(c["load_rounding"]),
                       pm(pr["agree_0"]["interval"], digits=2, sign="+", unit=" points"),
                       f"{sci_pm(c['router_drift']['list'])} / {sci_pm(c['router_drift']['none'])}"))
    header_a = ("model", "run", "agreement at step 0", "agreement, tail mean", "fp32 run's weights in this run's "
                "dtypes, tail mean", "fp32 run's router on this run's inputs, tail mean",
                "this run's router on the fp32 run's inputs, tail mean", "held-out loss, last",
                "held-out loss - fp32's, tail mean")
    header_p = ("model", "seeds", "agreement, tail mean: list - [] (points)", "per seed (points)",
                "the forward alone: fp32 run's weights in the two runs' dtypes, list - [] (points)",
                "router weight's rel. L2 diff to fp32's at the end, list - []",
                "held-out loss, tail mean: list - []", "verdict, agreement", "verdict, held-out loss")
    header_c = ("model", "list", "forward: top-k sets that rounding the listed tensors changes",
                "forward: router logits, rel. change", "forward: agreement with fp32, list - []",
                "router weight's gradient, rel. error to fp32's: list / []",
                "other listed tensors' gradients, rel. error: list / []", "loading: listed tensors' rel. rounding",
                "the forward at step 0 (the loaded values): agreement, list - []", "router weight, rel. L2 diff to fp32's at the end: "
                "list / []")
    header_v = ("model", "run", "tensors (elements)", "held as", "rel. L2 diff to fp32 at step 0",
                "rel. L2 diff to fp32, last", "max abs diff to fp32, last")
    return (header_a, agreement), (header_p, paired), (header_c, cause), (header_v, values)


def run_label(model_name, run, keep=None):
    return RUNS[run] + (f" {describe_keep((keep or KEEP)[model_name])}" if run == "bf16_list" else "")


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


def plot_routing(results, args, out, setting):
    """The routing agreement over the steps and the held-out loss against the fp32 run's, each a mean over the seeds
    with its 95 % interval; and per model the tail's agreement, list - [], per seed, against what the forward alone
    gives."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np
    colors = {"bf16_list": "tab:blue", "bf16_none": "tab:red"}
    lists = "; ".join(f"{MODELS[m]} {describe_keep(ROUTING_KEEP[m])}" for m in results)
    labels = {"bf16_list": f"bf16 + list ({lists})", "bf16_none": "bf16 []"}
    n = len(results)
    fig, axes = plt.subplots(3, n, figsize=(4.6 * n, 9.6), squeeze=False, gridspec_kw={"height_ratios": [3, 2, 2]})
    for col, (model_name, (info, _, curves)) in enumerate(results.items()):
        steps = np.array(curves["steps"])
        seeds = len(info["seeds"])
        for row, key, scale in ((0, "agree", 100), (1, "held_out_diff", 1)):
            ax = axes[row, col]
            for run in ("bf16_list", "bf16_none"):
                m, h = (scale * np.array([x[i] for x in curves[run][key]]) for i in (0, 1))
                ax.plot(steps, m, "-o", ms=2.5, color=colors[run], label=labels[run] + f", mean of {seeds} seeds")
                ax.fill_between(steps, m - h, m + h, color=colors[run], alpha=0.18, lw=0,
                                label=f"95 % interval over the seeds ({labels[run].split(' (')[0]})")
                if key == "agree":
                    ax.plot(steps, [scale * x[0] for x in curves[run]["compute"]], ":", color=colors[run], lw=1.3,
                            label=f"the fp32 run's weights in the dtypes of {labels[run].split(' (')[0]}")
            ax.axvspan(info["tail_steps"][0], steps[-1], color="0.92", zorder=0)
            ax.grid(alpha=0.3)
        axes[0, col].set_title(f"{MODELS[model_name]}: top-{info['k']} sets equal to fp32's", fontsize=10)
        axes[0, col].set_ylabel("% of held-out tokens x layers")
        axes[1, col].axhline(0, color="black", lw=0.8)
        axes[1, col].set_title("held-out loss minus the fp32 run's", fontsize=10)
        axes[1, col].set_xlabel("step")
        axes[1, col].set_ylabel("loss difference")
        ax = axes[2, col]
        pr = info["paired"]
        for x, key, color, name in ((0, "agree_tail", "tab:purple", "training"),
                                    (1, "compute_tail", "0.4", "forward alone")):
            d = 100 * np.array(pr[key]["per_seed"])
            m, h = (100 * v for v in pr[key]["interval"])
            ax.plot(np.full(len(d), x) + np.linspace(-0.12, 0.12, len(d)), d, "o", ms=4, color=color, alpha=0.7)
            ax.errorbar([x + 0.3], [m], yerr=[[h if h == h else 0]], fmt="s", color=color, capsize=5)
        ax.axhline(0, color="black", lw=0.8)
        ax.set_xticks([0, 1], ["agreement,\nlist - []", "the forward alone:\nfp32 weights in\nthe dtypes, list - []"],
                      fontsize=8)
        ax.set_xlim(-0.5, 1.6)
        ax.set_ylabel("points, tail mean")
        ax.set_title(f"per seed (dots), mean and 95 % interval\nagreement: {verdict(pr['agree_tail'])}; the forward "
                     f"alone: {verdict(pr['compute_tail'])}", fontsize=9)
        ax.grid(alpha=0.3, axis="y")
    handles, names = axes[0, 0].get_legend_handles_labels()
    fig.legend(handles, names, loc="lower center", ncol=2, fontsize=8)
    setting_text = SETTING_TEXT[setting]
    fig.suptitle(f"MoE routing ({setting}: {setting_text}), ZeRO-3 bf16 against fp32, {len(info['seeds'])} seeds:\n"
                 f"{args.routing_steps} AdamW steps, lr peak {args.routing_lr:g}, tail {TAIL * args.routing_lr:g} "
                 f"from step {info['tail_steps'][0]} (grey)", fontsize=10)
    fig.tight_layout(rect=(0, 0.08, 1, 1))
    path = IMAGES / ("accuracy_routing.png" if setting == "tiny" else f"accuracy_routing_{setting}.png")
    fig.savefig(path, dpi=110)
    plt.close(fig)
    shutil.copy(path, out / path.name)
    return path


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


def work(job, args, say_):
    """One job of a rank: ``values/MODEL/RUN`` or ``routing/SETTING/MODEL/SEED/RUN``."""
    part, *rest = job.split("/")
    if part == "values":
        train(*rest, args, say_)
    else:
        setting, model_name, seed, run = rest
        train_routing(setting, model_name, int(seed), run, args, say_)


def values_markdown(results, meta, args, paths):
    """The values part of results.md (and what it prints)."""
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
    md += [f"![{p.stem}](images/{p.name})" for p in paths] + [""]
    print()
    for n in notes:
        print(*textwrap.wrap("- " + n, width=118, subsequent_indent="  "), sep="\n")
    return md


def routing_markdown(results, args, path, setting):
    """The routing part of results.md (and what it prints)."""
    names = ", ".join(MODELS[m] for m in results)
    info0 = next(iter(results.values()))[0]
    first_tail, last, n_tail = info0["tail_steps"]
    every = max(1, args.routing_steps // EVALS)
    tail_lr = TAIL * args.routing_lr
    cfg = SETTINGS[setting]
    seeds = len(info0["seeds"])
    below = ", ".join(f"{MODELS[m]} {pm(info['below'])}" for m, (info, _, _) in results.items())
    settled = ", ".join(f"{MODELS[m]} {pm(info['settled']['decay'])} / {pm(info['settled']['tail'])}"
                        for m, (info, _, _) in results.items())
    threshold = 2.0**(math.floor(math.log2(tail_lr)) + 9)  # the smallest value whose half bf16 step exceeds tail_lr
    md = [
        f"## MoE routing ({setting}): what keeping buys for the router, over {seeds} seeds",
        "",
        f"{names} ({SETTING_TEXT[setting]}{'; a shared expert but in gpt-oss' if 'gpt_oss' in results else ', and a shared expert'}), random init, the routing biases "
        f"(`e_score_correction_bias`) drawn from N(0, {BIAS_STD:g}^2), as a trained checkpoint's are not zero; "
        f"{seeds} seeds (0 to {seeds - 1}), each drawing the initial weights and the training sequences; per "
        f"seed the same three runs from the same weights on the same data, ZeRO-3 on {args.world_size} "
        f"rank{'s' if args.world_size > 1 else ''}, {args.routing_steps} steps of AdamW (no weight decay), "
        f"{args.world_size} x {args.micro_batch} sequences of "
        f"{cfg['seq']} tokens per step. The learning rate warms up over {WARMUP:.0%} of the steps to "
        f"{args.routing_lr:g}, decays (cosine) to {tail_lr:g} at step {round(DECAY_END * args.routing_steps)} and "
        f"stays there: in this tail an update of about {tail_lr:g} is below half a bf16 step for every value above "
        f"{threshold:.3g} (for this share of the fp32 run's router weight elements at the end: {below}). The data: a "
        f"vocabulary of {cfg['vocab']} tokens in {cfg['topics']} topics, each with its own share of the vocabulary "
        "and its own order of it (a token's successor with probability 0.8, another token of the topic with 0.15, "
        f"any token with 0.05), a structure a router can learn. Every {every} steps each run routes the same "
        f"{info0['tokens']} held-out tokens (one forward, no update): the share of tokens whose top-{info0['k']} "
        "expert set in a layer equals the fp32 run's, over the layers; the held-out loss; the router weights, "
        "routing biases and sinks against the fp32 run's. Whether the fp32 run's routing has settled: the share of "
        f"its top-{info0['k']} sets equal to those of its previous evaluation, over the second half of the decay "
        f"(steps {round(0.5 * args.routing_steps)} to {round(DECAY_END * args.routing_steps)}, the learning rate "
        f"30 % to 1 % of its peak) / over the tail: {settled}.",
        "",
        "What the bf16 + list runs keep: " + "; ".join(KEPT_TEXT[m] for m in results) + ". The bf16 [] runs hold "
        "all of these in bf16, the buffers too.",
        "",
        "Every number is a mean over the seeds ± the half-width of its 95 % interval (Student's t, "
        f"{seeds - 1} degrees of freedom). list - [] is taken per seed (the two runs of a seed share weights and "
        "data) before the mean; \"list above []\" or \"below\" where its interval excludes 0, \"within the "
        "spread\" where it does not.",
        "",
        f"### Routing agreement with the fp32 run, and held-out loss (tail: the {n_tail} evaluations of steps "
        f"{first_tail} to {last})",
        "",
    ]
    tables = routing_tables(results)
    titles = ("MoE routing: agreement with the fp32 run", "list - [], per seed", "What the list changes, each alone",
              "The tracked tensors against the fp32 run's")
    md_titles = (None, "### list - [], per seed",
                 "### What the list changes, each alone (the fp32 run's weights, in plain torch after the runs)",
                 "### Router weights, routing biases and sinks against the fp32 run's (mean over the seeds)")
    for (header, rows), title, md_title in zip(tables, titles, md_titles):
        if md_title:
            md += [md_title, ""]
        md += [markdown_table(header, rows), ""]
        print(f"\n{title}")
        print(text_table(header, rows))
    per_model = []
    for model_name, (info, rows, _) in results.items():
        lst, none, c, pr = rows["bf16_list"], rows["bf16_none"], info["cause"], info["paired"]
        label = describe_keep(ROUTING_KEEP[model_name])
        per_model.append(
            f"{MODELS[model_name]}: over the tail, {label} routes {pm(lst['agree_tail'])} of the held-out tokens x "
            f"layers as the fp32 run does, [] {pm(none['agree_tail'])}; list - [] per seed "
            f"{pm(pr['agree_tail']['interval'], sign='+', unit=' points')}: {verdict(pr['agree_tail'])}. "
            f"Each alone (not parts of that difference): the forward (the fp32 run's weights in the two runs' "
            f"dtypes) {pm(pr['compute_tail']['interval'], digits=2, sign='+', unit=' points')} "
            f"({verdict(pr['compute_tail'])}); rounding the listed tensors changes "
            f"{pm(c['forward_flip'], digits=2)} of the top-{info['k']} sets and the router logits by "
            f"{sci_pm(c['forward_logits'])} (relative). The router weight's gradient is "
            f"{sci_pm(c['grad_router']['list'])} off fp32's with the list, {sci_pm(c['grad_router']['none'])} with "
            f"[] ({verdict(pr['grad_router'], 'list farther', 'list closer')}); at the end the router weight is "
            f"{sci_pm(c['router_drift']['list'])} from the fp32 run's with the list, "
            f"{sci_pm(c['router_drift']['none'])} with [] ({verdict(pr['router_drift'], 'list farther', 'list closer')})"
            f". Loading rounds the listed tensors by "
            f"{sci_pm(c['load_rounding'])} (relative; the forward at step 0, list - [], "
            f"{pm(pr['agree_0']['interval'], digits=2, sign='+', unit=' points')}). "
            f"Held-out loss minus the fp32 run's over the tail: {sci_pm(lst['held_out_diff_tail'], '+')} with "
            f"{label}, {sci_pm(none['held_out_diff_tail'], '+')} with [].")
    notes = [
        "\"agreement\": the share of held-out tokens x MoE layers whose top-k expert set (the indices, in any order) "
        "equals the fp32 run's at the same step. \"tail mean\": the mean over the evaluations in the tail.",
        "Where the disagreement of a bf16 run comes from. In a bf16 run the router's input, the hidden state, is "
        "computed in bf16 by the bf16 rest of the model, and the gradients of every weight come from that bf16 "
        "forward and backward; under ZeRO every parameter has an fp32 master either way. What the list changes: the "
        "values the forward computes with (the listed tensors unrounded), the precision of the listed tensors' "
        "gradients and their reduction, and the loaded values (exact). \"fp32 run's weights in this run's dtypes\": "
        "the fp32 run's own weights, each rounded to the dtype this run holds it in, route the held-out tokens: what "
        "computing in bf16 costs where no weight has drifted; list - [] of it is the forward alone. The rest of a "
        "run's disagreement comes from its weights, which drifted from the fp32 run's over training. \"fp32 run's "
        "router on this run's inputs\": what the drift of the router's inputs alone costs; \"this run's router on "
        "the fp32 run's inputs\": what the drift of the router's values alone costs.",
        "\"What the list changes, each alone\" (the third table), on the fp32 run's weights with the held-out tokens, "
        "in one process: the forward, at each evaluation of the tail, with every tensor in the dtype of the list run "
        "against the dtype of the [] run (only the listed tensors differ); the gradients of the loss at the first "
        "evaluation of the tail, in fp32, in the list run's dtypes and in the [] run's (no reduction over ranks" +
        (f": ZeRO-3 on {args.world_size} ranks adds one rounding of the bf16 gradients in the [] run"
         if args.world_size > 1 else ", as in the runs, on one rank") + "); the loading: the listed tensors, parameters "
        "and buffers, at step 0 rounded to bf16, against how far the router weight drifts from the fp32 run's.",
        "Checks: offline, the fp32 run's routers route its own recorded inputs as in training for "
        f"{pm(min(i['reproduced'] for i, _, _ in results.values()))} of the tokens or more in every evaluation of "
        "every seed, and the offline model routes each run's step 0 as the run did for "
        f"{pm(min(i['offline_0'] for i, _, _ in results.values()))} or more.",
        *per_model,
        "\"rel. L2 diff\": ||value - fp32 value|| / ||fp32 value|| over the tensors of the row; at step 0 it is what "
        "loading into the run's dtype did to the checkpoint's values. A routing bias has no gradient: it keeps its "
        "loaded value.",
        "Each run's training loss, mean of its last 20 steps, mean over the seeds (fp32, list, []): " +
        "; ".join(f"{MODELS[m]} " + ", ".join(pm(rows[r]['train_loss_final'], 1, 4, '') for r in RUNS)
                  for m, (_, rows, _) in results.items()) + ". Seconds per run (fp32, list, []): " +
        "; ".join(f"{MODELS[m]} " + ", ".join(f"{rows[r]['seconds'][0]:.0f}" for r in RUNS)
                  for m, (_, rows, _) in results.items()) + ".",
    ]
    md += ["### Notes (routing)", ""] + [f"- {n}" for n in notes] + [""]
    caption = figure_caption(results)
    md += ([f"![{path.stem}](images/{path.name})", ""] if path else []) + [caption, ""]
    print("\n" + "\n".join(textwrap.wrap(caption, width=118)))
    print()
    for n in notes:
        print(*textwrap.wrap("- " + n, width=118, subsequent_indent="  "), sep="\n")
    return md


def figure_caption(results):
    """The routing figure's caption: per model, list - [] with its interval and verdict; where anything the list
    changes differs beyond the spread (the agreement, the forward alone, the router weight's drift), each measurement
    alone (they do not add up to the difference: each is measured on its own)."""
    parts = []
    for model_name, (info, rows, _) in results.items():
        c, pr, lst, none = info["cause"], info["paired"], rows["bf16_list"], rows["bf16_none"]
        text = (f"{MODELS[model_name]} {pm(pr['agree_tail']['interval'], sign='+', unit=' points')} "
                f"({verdict(pr['agree_tail'])})")
        if any(verdict(pr[k]).startswith("list") for k in ("agree_tail", "compute_tail", "router_drift")):
            text += (f"; each alone, list - [] per seed: the forward (the fp32 run's weights in the two runs' "
                     f"dtypes) {pm(pr['compute_tail']['interval'], digits=2, sign='+', unit=' points')} "
                     f"({verdict(pr['compute_tail'])}), rounding the listed tensors flipping "
                     f"{pm(c['forward_flip'], digits=2)} of the top-{info['k']} sets; the router weight's gradient, "
                     f"relative error to fp32's, list / []: {sci_pm(c['grad_router']['list'])} / "
                     f"{sci_pm(c['grad_router']['none'])} ({verdict(pr['grad_router'], 'list farther', 'list closer')}); "
                     f"the loaded values "
                     f"rounded by {sci_pm(c['load_rounding'])} (relative), the forward at step 0 "
                     f"{pm(pr['agree_0']['interval'], digits=2, sign='+', unit=' points')}. Over training the router weight ends "
                     f"{sci_pm(c['router_drift']['list'])} / {sci_pm(c['router_drift']['none'])} (list / []) from the "
                     f"fp32 run's ({verdict(pr['router_drift'], 'list farther', 'list closer')})")
        parts.append(text)
    return ("Figure: agreement with the fp32 run (top), held-out loss against fp32's (middle), mean over the seeds "
            "with its 95 % interval (bands); bottom, the tail's agreement list - [] per seed. list - [], tail mean: " +
            ". ".join(parts) + ".")


def main():
    parser = tiny_runs.arguments(__doc__, DEFAULT_OUT, steps=200, lr=1e-4)
    parser.add_argument("--models",
                        default=",".join(VALUE_MODELS),
                        help="the values part's models, comma-separated, '' for none (default: %(default)s)")
    parser.add_argument("--routing-setting",
                        choices=tuple(SETTINGS),
                        default="tiny",
                        help="the routing part's models and data (default: %(default)s)")
    parser.add_argument("--routing-models",
                        default=None,
                        help="the routing part's models, comma-separated, '' for none (default: the setting's)")
    parser.add_argument("--seeds", type=int, help="the routing part's seeds (default: the setting's)")
    parser.add_argument("--routing-steps", type=int, help="the routing part's steps per run (default: the setting's)")
    parser.add_argument("--routing-lr", type=float, help="the routing part's peak learning rate (default: the setting's)")
    parser.add_argument("--parallel", type=int, help="launches side by side (default: the setting's)")
    parser.add_argument("--train-seconds",
                        type=float,
                        help="stop the routing part's training after this many seconds and analyse the seeds that "
                        "finished (the GPU check's deadline)")
    # --world-size and --micro-batch: the values part's are 2 and 8; the routing part's default to its setting's
    parser.set_defaults(world_size=None, micro_batch=None)
    parser.add_argument("--report-only",
                        action="store_true",
                        help="redo the tables and plots from the runs already in --out, without training")
    args = tiny_runs.parse(parser)
    if args.worker:  # one rank of the jobs named in --worker
        return tiny_runs.worker(args.worker, lambda job, say_: work(job, args, say_))

    t_start = time.time()
    out = Path(args.out)
    setting = args.routing_setting
    cfg = SETTINGS[setting]
    models = [m for m in args.models.split(",") if m]
    routing_models = [m for m in (",".join(cfg["models"]) if args.routing_models is None else
                                  args.routing_models).split(",") if m]
    seeds = cfg["seeds"] if args.seeds is None else args.seeds
    args.routing_steps = cfg["steps"] if args.routing_steps is None else args.routing_steps
    args.routing_lr = cfg["lr"] if args.routing_lr is None else args.routing_lr
    routing_args = argparse.Namespace(**vars(args))
    routing_args.steps, routing_args.lr = args.routing_steps, args.routing_lr
    for key in ("world_size", "micro_batch", "parallel"):
        if getattr(args, key) is None:
            setattr(routing_args, key, cfg[key])
            setattr(args, key, SETTINGS["tiny"][key])
    if not args.report_only:
        for sub in ("models", "runs", "logs"):
            shutil.rmtree(out / sub, ignore_errors=True)
        (out / "runs").mkdir(parents=True)
    IMAGES.mkdir(parents=True, exist_ok=True)

    import transformers
    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    command = shlex.join(["python", "benchmarks/accuracy_study.py"] + sys.argv[1:])

    def describe_run(minutes):
        return {
            "command": command,
            "minutes": minutes,
            "machine": machine(),
            "models": models,
            "routing_models": routing_models,
            "routing_setting": setting,
            "seeds": seeds,
            "args": {
                k: v
                for k, v in vars(args).items()
                if k in ("steps", "lr", "micro_batch", "world_size", "routing_steps", "routing_lr")
            },
            "routing_args": {k: getattr(routing_args, k)
                             for k in ("micro_batch", "world_size", "parallel")},
        }

    if not args.report_only:
        print(f"Accuracy study, 3 runs per model ({', '.join(RUNS.values())}), ZeRO-3 on the "
              f"{os.environ['DS_ACCELERATOR'].upper()}. Output folder: {out}\n"
              f"Values: {', '.join(MODELS[m] for m in models) or 'none'}; {args.steps} steps, AdamW lr {args.lr:g}, "
              f"{args.world_size} ranks x {args.micro_batch} sequences.\n"
              f"Routing ({setting}: {SETTING_TEXT[setting]}): "
              f"{', '.join(MODELS[m] for m in routing_models) or 'none'}; {seeds} seeds, {args.routing_steps} steps, "
              f"AdamW lr {args.routing_lr:g} with warm-up, decay and tail, {routing_args.world_size} rank(s) x "
              f"{routing_args.micro_batch} sequences, {routing_args.parallel} launch(es) side by side.\n")
        for model_name in models:
            tiny_runs.write_model(tiny_runs.tiny_model(model_name, seed=0), out / "models" / model_name)
        for model_name in routing_models:
            for seed in range(seeds):
                tiny_runs.write_model(routing_model(model_name, seed, setting),
                                      routing_dir(out, setting, model_name, seed))
        if models:
            run_all([f"values/{m}/{run}" for m in models for run in RUNS], args)
        if routing_models:
            # what --report-only needs of the seeds that finished, if the routing part is stopped
            (out / "runs" / "meta.json").write_text(json.dumps(describe_run(None), indent=1))
            run_all([[f"routing/{setting}/{m}/{seed}/{run}" for m in routing_models for run in RUNS]
                     for seed in range(seeds)], routing_args, "routing-")
        (out / "runs" / "meta.json").write_text(json.dumps(describe_run((time.time() - t_start) / 60), indent=1))
    meta = json.loads((out / "runs" / "meta.json").read_text())
    for k, v in meta["args"].items():
        setattr(args, k, v)
    models, routing_models = meta.get("models", models), meta.get("routing_models", [])
    setting, seeds = meta.get("routing_setting", "tiny"), meta.get("seeds", 1)

    md = [
        "# Accuracy study: bf16 with and without the fp32 list, against fp32",
        "",
        f"Command: `{meta['command']}`, " + (f"{meta['minutes']:.1f} minutes." if meta["minutes"] is not None else
                                              "stopped before its end: the seeds that finished."),
        "",
        f"Machine: {meta['machine']}.",
        "",
    ]
    paths = []
    import torch
    torch.set_num_threads(os.cpu_count())  # the analysis, in this process (the ranks ran with one thread each)
    try:
        import matplotlib  # noqa: F401
        plots = True
    except ImportError:  # the GPU machine's image has no matplotlib: the tables only
        plots = False
        print("matplotlib is not installed: no plots")
    if models:
        results = {m: analyse(m, out) for m in models}
        paths = plot(results, args, out) if plots else []
        md += values_markdown(results, meta, args, paths)
    done = []
    if routing_models:
        done = [
            seed for seed in range(seeds)
            if all(routing_run(out, setting, m, seed, run).exists() for m in routing_models for run in RUNS)
        ]
        if len(done) < seeds:
            print(f"the routing part's runs of seeds {done} are there, of {seeds}: those only")
            md += [f"Stopped before its end: seeds {done} of {seeds} finished, those only.", ""]
    if routing_models and done:
        routing = {m: over_seeds({seed: analyse_routing(setting, m, seed, out) for seed in done}) for m in routing_models}
        routing_args = argparse.Namespace(**{**vars(args), **meta.get("routing_args", {})})
        path = plot_routing(routing, routing_args, out, setting) if plots else None
        paths += [path] if path else []
        md += routing_markdown(routing, routing_args, path, setting)
    (out / "results.md").write_text("\n".join(md))
    print(f"\nDone in {(time.time() - t_start) / 60:.1f} minutes. Tables: {out / 'results.md'}\nPlots: "
          f"{', '.join(os.path.relpath(p, ROOT) for p in paths)} (copied to {out})")


if __name__ == "__main__":
    main()
