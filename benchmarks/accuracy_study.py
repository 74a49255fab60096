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

The routing part (``--routing-steps``, ``--routing-lr``): what keeping buys for MoE routing. Tiny DeepSeek-V3,
DeepSeek-V4 and ERNIE 4.5 MoE (``"auto"``) and gpt-oss (``["sinks"]``: its router does not cast its input to fp32,
so its router is not listed) learn token sequences of a few topics (a router can learn to send each topic to its
experts), with a learning rate that warms up, decays and ends in a small tail, where most updates are below bf16's
resolution. Every ``--routing-steps // 20`` steps each run routes fixed held-out tokens: the study compares each
token's top-k expert set, per MoE layer, with the fp32 run's, and the router weights, routing biases and sinks with
the fp32 run's; it also applies the fp32 run's router to each bf16 run's router inputs (and each run's router to
the fp32 run's inputs), to tell apart what the router's values and what its input change.

The study prints and writes ``results.md`` (the tables) into ``--out`` and the plots into ``docs/images/`` (copied to
``--out``).
"""

import argparse
import json
import math
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
# The routing part's data: sequences of TOPICS topics; its held-out tokens; its evaluations per run.
TOPICS = 4
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


def routing_model(model_name, seed=0):
    """The tiny ``model_name`` of the routing part, random init after ``torch.manual_seed(seed)``, its routing biases
    drawn from N(0, BIAS_STD^2). ERNIE 4.5 MoE is not among the shared tiny models: its config is here."""
    import torch
    import transformers
    if model_name == "ernie4_5_moe":
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


def topic_batch(n, seed):
    """``n`` token sequences, each of one of TOPICS topics: a topic has its own quarter of the vocabulary and its own
    order of it (a permutation); the next token is the current one's successor with probability 0.8, another token
    of the topic with 0.15 and any token with 0.05. The same for a given ``seed`` in every run."""
    import torch
    vocab, seq = tiny_runs.VOCAB, tiny_runs.SEQ
    g0 = torch.Generator().manual_seed(4242)  # the topics: the same in every call
    tokens = torch.randperm(vocab, generator=g0).view(TOPICS, -1)
    per_topic = tokens.shape[1]
    successor = torch.empty(vocab, dtype=torch.long)
    for t in range(TOPICS):
        successor[tokens[t]] = tokens[t][torch.randperm(per_topic, generator=g0)]
    g = torch.Generator().manual_seed(seed)
    topic = torch.randint(TOPICS, (n, ), generator=g)
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


def train_routing(model_name, run, args, say_):
    """One run of the routing part: ``args.steps`` steps on topic sequences, the held-out tokens routed every
    ``args.steps // EVALS`` steps (and before the first)."""
    import gc
    import torch
    import deepspeed
    import deepspeed.comm as dist

    out = Path(args.out)
    model_dir = out / "models" / "routing" / model_name
    rank, world = dist.get_rank(), dist.get_world_size()
    keep = [] if run == "bf16_none" else ROUTING_KEEP[model_name]
    ds_config = tiny_runs.zero3_config(args.micro_batch, bf16=run != "fp32", keep=None if keep == "auto" else keep)
    model, hf_ds_config = tiny_runs.from_pretrained_zero3(model_dir, ds_config)
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
    held_out = topic_batch(HELD_OUT, HELD_OUT_SEED)
    every = max(1, steps // EVALS)
    evals, losses, t0 = [], [], time.time()

    def evaluate(engine, step):
        captured = {}

        def hook(name):

            def record(mod, inputs, output):
                h = inputs[0].detach()
                captured[name] = (h.reshape(-1, h.shape[-1]).float().clone(), output[-1].detach().sort(-1).values)

            return record

        handles = [m.register_forward_hook(hook(n)) for n, m in routers]
        with torch.no_grad():
            loss = engine(input_ids=held_out, labels=held_out).loss.float().item()
        for h in handles:
            h.remove()
        with deepspeed.zero.GatheredParameters([t for t, is_param in tracked.values() if is_param]):
            values = {n: t.detach().float().clone() for n, (t, _) in tracked.items()}
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
                evals[-1]["state"] = {n: p.detach().clone() for n, p in module.named_parameters()}
            evals[-1]["state"].update({n: b.detach().clone() for n, b in module.named_buffers()})

    say_(f"{MODELS[model_name]}, {RUNS[run]} (routing): {len(routers)} routers; "
         f"{', '.join(f'{n} {k[0]} {k[1]}' for n, k in kinds.items() if '.0.' in n)}; {steps} steps on {world} ranks")
    evaluate(engine, 0)
    log_every = max(1, steps // 4)
    for step in range(1, steps + 1):
        ids = topic_batch(args.micro_batch, seed=step * 1_009 + rank)
        losses.append(tiny_runs.train_step(engine, ids))
        if step % every == 0 or step == steps:
            evaluate(engine, step)
        if step % log_every == 0 or step == steps:
            say_(f"  step {step:4d}/{steps}  loss {losses[-1]:.4f}  held-out {evals[-1]['loss']:.4f}  lr "
                 f"{evals[-1]['lr']:.2e}  ({(time.time() - t0) / step:.2f} s/step)")
    if rank == 0:
        torch.save(
            {
                "losses": losses,
                "evals": evals,
                "routers": [n for n, _ in routers],
                "kinds": kinds,
                "dtypes": dtypes,
                "seconds": time.time() - t0,
            }, out / "runs" / f"routing.{model_name}.{run}.pt")
    engine.destroy()
    del engine, model, optimizer, hf_ds_config
    gc.collect()


# ---------------------------------------------------------------------------------------------------------------
# The parent: launch, analyse, report, plot
# ---------------------------------------------------------------------------------------------------------------


def run_all(jobs, args, log_prefix=""):
    """The ``jobs`` (part/model/run), in one launch on ``args.world_size`` ranks."""
    codes = tiny_runs.launch(__file__, ",".join(jobs), args, log_prefix=log_prefix, timeout=3600)
    if any(codes):
        tiny_runs.fail(f"The study failed (exit codes {codes}); the end of the logs:", args, log_prefix)


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


def analyse_routing(model_name, out):
    """The routing part's numbers of one model: per run, per evaluation, the routing agreement with the fp32 run,
    per layer, for the run itself, for the fp32 run's router on the run's router inputs and for the run's router on
    the fp32 run's inputs; the held-out loss; the distance of the tracked tensors to the fp32 run's."""
    import torch
    import transformers
    res = {run: torch.load(out / "runs" / f"routing.{model_name}.{run}.pt") for run in RUNS}
    ref = res["fp32"]
    routers = ref["routers"]
    # The routers in fp32, to route given inputs with given values (a run's, at one evaluation).
    model = transformers.AutoModelForCausalLM.from_pretrained(out / "models" / "routing" / model_name,
                                                              dtype=torch.float32)
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
    full = transformers.AutoModelForCausalLM.from_pretrained(out / "models" / "routing" / model_name,
                                                             dtype=torch.float32)
    full_routers = routers_of(full)
    held_out_ids = topic_batch(HELD_OUT, HELD_OUT_SEED)

    def route_model(state, dtypes):
        """The held-out tokens' top-k sets with the weights ``state``, each tensor in its dtype in ``dtypes``."""
        with torch.no_grad():
            for n, t in [*full.named_parameters(), *full.named_buffers()]:
                if n in state:
                    t.data = state[n].to(getattr(torch, dtypes.get(n, "float32")))
            topk = {}
            handles = [
                m.register_forward_hook(lambda mod, i, o, n=n: topk.__setitem__(n, o[-1].sort(-1).values))
                for n, m in full_routers
            ]
            full(input_ids=held_out_ids)
            for h in handles:
                h.remove()
        return torch.stack([topk[n] for n in routers])

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
    for run, r in res.items():
        own, ref_router, own_router, dist = [], [], [], {g: [] for g in groups}
        compute = []  # the fp32 run's weights in this run's dtypes
        for e, e_ref in zip(r["evals"], ref["evals"]):
            own.append(agree(e["topk"], e_ref["topk"]))
            compute.append(agree(route_model(e_ref["state"], r["dtypes"]), e_ref["topk"]))
            ref_router.append(agree(route(e_ref["values"], e["inputs"]), e_ref["topk"]))
            own_router.append(agree(route(e["values"], e_ref["inputs"]), e_ref["topk"]))
            for g, ns in groups.items():
                a = torch.cat([e["values"][n].flatten() for n in ns])
                b = torch.cat([e_ref["values"][n].flatten() for n in ns])
                dist[g].append((float((a - b).norm() / b.norm().clamp_min(1e-30)), float((a - b).abs().max())))
        own, ref_router, own_router, compute = (torch.stack(x) for x in (own, ref_router, own_router, compute))
        # At step 0 the runs start from the fp32 run's weights: offline, they must route as in training.
        offline_0 = agree(route_model(ref["evals"][0]["state"], r["dtypes"]), r["evals"][0]["topk"])
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
        "tail_lr": ref["evals"][-1]["lr"],
        "tail_steps": (steps[tail[0]], steps[-1], len(tail)),
    }
    return info, rows, curves


def routing_tables(results):
    """The routing part's tables: routing agreement and losses; the values of the tracked tensors."""

    def pct(x):
        return f"{100 * x:.1f} %"

    agreement = []
    values = []
    for model_name, (info, rows, _) in results.items():
        for run in RUNS:
            r = rows[run]
            label = run_label(model_name, run, ROUTING_KEEP)
            ref = run == "fp32"
            agreement.append((MODELS[model_name], label, "-" if ref else pct(r["agree_0"]),
                              "-" if ref else " / ".join(pct(x) for x in r["agree_final_layers"]),
                              "-" if ref else pct(r["agree_tail"]), "-" if ref else pct(r["compute_tail"]),
                              "-" if ref else pct(r["ref_router_tail"]), "-" if ref else pct(r["own_router_tail"]),
                              f"{r['held_out_final']:.4f}", "-" if ref else f"{r['held_out_diff_tail']:+.1e}"))
            for g, n in info["groups"].items():
                values.append(
                    (MODELS[model_name], label, f"{g} ({n})", r["kept"][g], "-" if ref else f"{r['dist_0'][g][0]:.1e}",
                     "-" if ref else f"{r['dist_final'][g][0]:.1e}", "-" if ref else f"{r['dist_final'][g][1]:.1e}"))
    header_a = ("model", "run", "agreement at step 0", "agreement, last evaluation, per layer", "agreement, tail mean",
                "fp32 run's weights in this run's dtypes, tail mean",
                "fp32 run's router on this run's inputs, tail mean",
                "this run's router on the fp32 run's inputs, tail mean", "held-out loss, last",
                "held-out loss - fp32's, tail mean")
    header_v = ("model", "run", "tensors (elements)", "held as", "rel. L2 diff to fp32 at step 0",
                "rel. L2 diff to fp32, last", "max abs diff to fp32, last")
    return (header_a, agreement), (header_v, values)


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


def plot_routing(results, args, out):
    """The routing agreement over the steps, and the held-out loss against the fp32 run's."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    colors = {"bf16_list": "tab:blue", "bf16_none": "tab:red"}
    lists = "; ".join(f"{MODELS[m]} {describe_keep(ROUTING_KEEP[m])}" for m in results)
    labels = {"bf16_list": f"bf16 + list ({lists})", "bf16_none": "bf16 []"}
    fig, axes = plt.subplots(2, len(results), figsize=(4.6 * len(results), 6.8), sharex=True, squeeze=False)
    for col, (model_name, (info, _, curves)) in enumerate(results.items()):
        steps = curves["steps"]
        ax = axes[0, col]
        for run in ("bf16_list", "bf16_none"):
            ax.plot(steps, [100 * x for x in curves[run]["agree"]], "-o", ms=3, color=colors[run], label=labels[run])
            ax.plot(steps, [100 * x for x in curves[run]["compute"]],
                    ":",
                    color=colors[run],
                    lw=1.3,
                    label=f"the fp32 run's weights in the dtypes of {labels[run].split(' (')[0]}")
        ax.set_title(f"{MODELS[model_name]}: top-{info['k']} sets equal to fp32's", fontsize=10)
        ax.set_ylabel("% of held-out tokens x layers")
        ax.grid(alpha=0.3)
        ax = axes[1, col]
        ax.axhline(0, color="black", lw=0.8)
        for run in ("bf16_list", "bf16_none"):
            ax.plot(steps, curves[run]["held_out_diff"], "-o", ms=3, color=colors[run])
        ax.set_title("held-out loss minus the fp32 run's", fontsize=10)
        ax.set_xlabel("step")
        ax.set_ylabel("loss difference")
        ax.grid(alpha=0.3)
        tail = info["tail_steps"][0]
        for row in range(2):
            axes[row, col].axvspan(tail, steps[-1], color="0.92", zorder=0)
    handles, names = axes[0, 0].get_legend_handles_labels()
    fig.legend(handles, names, loc="lower center", ncol=2, fontsize=8)
    fig.suptitle(f"MoE routing, ZeRO-3 bf16 against fp32: {args.routing_steps} AdamW steps, lr peak "
                 f"{args.routing_lr:g}, tail {TAIL * args.routing_lr:g} from step {info['tail_steps'][0]} (grey)")
    fig.tight_layout(rect=(0, 0.07, 1, 1))
    path = IMAGES / "accuracy_routing.png"
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
    """One job of a rank: ``values/MODEL/RUN`` or ``routing/MODEL/RUN``."""
    part, model_name, run = job.split("/")
    (train if part == "values" else train_routing)(model_name, run, args, say_)


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


def routing_markdown(results, args, path):
    """The routing part of results.md (and what it prints)."""

    def pct(x):
        return f"{100 * x:.1f} %"

    def compare(a, b):
        return "above" if round(100 * a, 1) > round(
            100 * b, 1) else ("below" if round(100 * a, 1) < round(100 * b, 1) else "the same as")

    names = ", ".join(MODELS[m] for m in results)
    info0 = next(iter(results.values()))[0]
    first_tail, last, n_tail = info0["tail_steps"]
    every = max(1, args.routing_steps // EVALS)
    tail_lr = TAIL * args.routing_lr
    below = ", ".join(f"{MODELS[m]} {pct(info['below'])}" for m, (info, _, _) in results.items())
    md = [
        "## MoE routing: what keeping buys for the router",
        "",
        f"Tiny {names} (hidden 32, 2 MoE layers of 4 routed experts, top 2; a shared expert but in gpt-oss), random "
        f"init (seed 0), the routing biases (`e_score_correction_bias`) drawn from N(0, {BIAS_STD:g}^2), as a trained "
        "checkpoint's are not zero; the same three runs each, ZeRO-3 on "
        f"{args.world_size} ranks, {args.routing_steps} steps of AdamW (no weight decay), {args.world_size} x "
        f"{args.micro_batch} sequences of {tiny_runs.SEQ} tokens per step. The learning rate warms up over "
        f"{WARMUP:.0%} of the steps to {args.routing_lr:g}, decays (cosine) to {tail_lr:g} at step "
        f"{round(DECAY_END * args.routing_steps)} and stays there: in this tail an update of about {tail_lr:g} is "
        "below half a bf16 step for every value above about 0.005 (for this share of the fp32 run's router weight "
        f"elements at the end: {below}). The data: sequences of {TOPICS} topics, each with its own quarter of the "
        "vocabulary and its own order of it (a token's successor with probability 0.8, another token of the topic "
        "with 0.15, any token with 0.05), a structure a router can learn. Every "
        f"{every} steps each run routes the same {info0['tokens']} held-out tokens (one forward, no update): the "
        f"share of tokens whose top-{info0['k']} expert set in a layer equals the fp32 run's, per layer and over the "
        "layers; the held-out loss; the router weights, routing biases and sinks against the fp32 run's.",
        "",
        "What the bf16 + list runs keep: DeepSeek-V3 and ERNIE 4.5 MoE (`\"auto\"`: `gate.weight`, "
        "`e_score_correction_bias`): the router weight, a parameter, and the routing bias, a buffer in DeepSeek-V3 "
        "(which DeepSpeed 0.19.8's own `\"auto\"` keeps in fp32 already) and in ERNIE a parameter without gradient "
        "(`gate.moe_statics.e_score_correction_bias`). DeepSeek-V4 (`\"auto\"`): its norms, hyper-connections, sinks "
        "(parameters) and its routing bias (a buffer), not its router weight, which it does not list (its router "
        "computes in the input's dtype). gpt-oss lists nothing for bf16 and runs with `[\"sinks\"]` (parameters); its "
        "router computes in the input's dtype too, so it is not listed. The bf16 [] runs hold all of these in bf16, "
        "the buffers too. The column \"held as\" of the second table says what each run held.",
        "",
        f"### Routing agreement with the fp32 run, and held-out loss (tail: the {n_tail} evaluations of steps "
        f"{first_tail} to {last})",
        "",
    ]
    (header_a, agreement), (header_v, values) = routing_tables(results)
    md += [markdown_table(header_a, agreement), ""]
    md += [
        "### Router weights, routing biases and sinks against the fp32 run's", "",
        markdown_table(header_v, values), ""
    ]
    print("\nMoE routing: agreement with the fp32 run")
    print(text_table(header_a, agreement))
    print("\nMoE routing: the tracked tensors against the fp32 run's")
    print(text_table(header_v, values))
    per_model = []
    for model_name, (info, rows, _) in results.items():
        lst, none = rows["bf16_list"], rows["bf16_none"]
        label = describe_keep(ROUTING_KEEP[model_name])
        per_model.append(
            f"{MODELS[model_name]}: over the tail, {label} routes {pct(lst['agree_tail'])} of the held-out tokens x "
            f"layers as the fp32 run does, {compare(lst['agree_tail'], none['agree_tail'])} [] "
            f"({pct(none['agree_tail'])}); the fp32 run's weights in the dtypes of {label}: "
            f"{pct(lst['compute_tail'])}, in those of []: {pct(none['compute_tail'])}; at step 0 {label} "
            f"{pct(lst['agree_0'])}, [] {pct(none['agree_0'])}. The fp32 run's router on the inputs of {label}: "
            f"{pct(lst['ref_router_tail'])}; the router of {label} on the fp32 run's inputs: "
            f"{pct(lst['own_router_tail'])}. Held-out loss minus the fp32 run's over the tail: "
            f"{lst['held_out_diff_tail']:+.1e} with {label}, {none['held_out_diff_tail']:+.1e} with [].")
    notes = [
        "\"agreement\": the share of held-out tokens x MoE layers whose top-k expert set (the indices, in any order) "
        "equals the fp32 run's at the same step; per layer in the \"last evaluation\" column. \"tail mean\": the mean "
        "over the evaluations in the tail.",
        "Where the disagreement of a bf16 run comes from. In a bf16 run the router's input, the hidden state, is "
        "computed in bf16 by the bf16 rest of the model, and the gradients of every weight, the router's included, "
        "come from that bf16 forward and backward; keeping the router's own tensors in fp32 changes neither. Two "
        "columns measure it. \"fp32 run's weights in this run's dtypes\": at each evaluation the fp32 run's own "
        "weights, each rounded to the dtype this run holds it in, route the held-out tokens (the model class in plain "
        "torch, after the runs): what computing in bf16 costs where no weight has drifted; at step 0 this is the run "
        "itself. The rest of a run's disagreement comes from its weights, which have drifted from the fp32 run's: "
        "they took gradients from bf16 compute, and those held in bf16 also lost updates to rounding. With the list "
        "the router's weight (DeepSeek-V3, ERNIE) is held and updated in fp32, so its drift is that of its gradients "
        "(second table). \"fp32 run's router on this run's inputs\" routes the run's recorded router inputs with the "
        "fp32 run's router (weights and biases of that step, in fp32): what the drift of the inputs alone costs; "
        "\"this run's router on the fp32 run's inputs\": what the drift of the router's values alone costs. Each "
        "setting ran once: how much the drift, and so the agreement, varies from one run to another (another seed, "
        "another data order) is not measured here.",
        "Checks: offline, the fp32 run's routers route its own recorded inputs as in training for "
        f"{pct(min(i['reproduced'] for i, _, _ in results.values()))} of the tokens or more in every evaluation, and "
        "the offline model routes each run's step 0 as the run did for "
        f"{pct(min(i['offline_0'] for i, _, _ in results.values()))} or more.",
        *per_model,
        "\"rel. L2 diff\": ||value - fp32 value|| / ||fp32 value|| over the tensors of the row; at step 0 it is what "
        "loading into the run's dtype did to the checkpoint's values. A routing bias has no gradient: it keeps its "
        "loaded value.",
        "Each run's training loss, mean of its last 20 steps (fp32, list, []): " +
        "; ".join(f"{MODELS[m]} " + ", ".join(f"{rows[r]['train_loss_final']:.4f}" for r in RUNS)
                  for m, (_, rows, _) in results.items()) + ".",
    ]
    md += ["### Notes (routing)", ""] + [f"- {n}" for n in notes] + ["", f"![{path.stem}](images/{path.name})", ""]
    print()
    for n in notes:
        print(*textwrap.wrap("- " + n, width=118, subsequent_indent="  "), sep="\n")
    return md


def main():
    parser = tiny_runs.arguments(__doc__, DEFAULT_OUT, steps=200, lr=1e-4)
    parser.add_argument("--models",
                        default=",".join(VALUE_MODELS),
                        help="the values part's models, comma-separated, '' for none (default: %(default)s)")
    parser.add_argument("--routing-models",
                        default=",".join(ROUTING_MODELS),
                        help="the routing part's models, comma-separated, '' for none (default: %(default)s)")
    parser.add_argument("--routing-steps",
                        type=int,
                        default=400,
                        help="the routing part's training steps per run (default: %(default)s)")
    parser.add_argument("--routing-lr",
                        type=float,
                        default=1e-3,
                        help="the routing part's peak learning rate (default: %(default)s)")
    parser.add_argument("--report-only",
                        action="store_true",
                        help="redo the tables and plots from the runs already in --out, without training")
    args = tiny_runs.parse(parser)
    if args.worker:  # one rank of the part/model/run jobs named in --worker
        return tiny_runs.worker(args.worker, lambda job, say_: work(job, args, say_))

    t_start = time.time()
    out = Path(args.out)
    models = [m for m in args.models.split(",") if m]
    routing_models = [m for m in args.routing_models.split(",") if m]
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
        print(f"Accuracy study, 3 runs per model ({', '.join(RUNS.values())}), ZeRO-3 on {args.world_size} CPU "
              f"ranks. Output folder: {out}\n"
              f"Values: {', '.join(MODELS[m] for m in models) or 'none'}; {args.steps} steps, AdamW lr {args.lr:g}.\n"
              f"Routing: {', '.join(MODELS[m] for m in routing_models) or 'none'}; {args.routing_steps} steps, "
              f"AdamW lr {args.routing_lr:g} with warm-up, decay and tail.\n")
        for model_name in models:
            tiny_runs.write_model(tiny_runs.tiny_model(model_name, seed=0), out / "models" / model_name)
        for model_name in routing_models:
            tiny_runs.write_model(routing_model(model_name, seed=0), out / "models" / "routing" / model_name)
        if models:
            run_all([f"values/{m}/{run}" for m in models for run in RUNS], args)
        if routing_models:
            routing_args = argparse.Namespace(**vars(args))
            routing_args.steps, routing_args.lr = args.routing_steps, args.routing_lr
            run_all([f"routing/{m}/{run}" for m in routing_models for run in RUNS], routing_args, "routing-")
        meta = {
            "command": command,
            "minutes": (time.time() - t_start) / 60,
            "machine": machine(),
            "models": models,
            "routing_models": routing_models,
            "args": {
                k: v
                for k, v in vars(args).items()
                if k in ("steps", "lr", "micro_batch", "world_size", "routing_steps", "routing_lr")
            },
        }
        (out / "runs" / "meta.json").write_text(json.dumps(meta, indent=1))
    meta = json.loads((out / "runs" / "meta.json").read_text())
    for k, v in meta["args"].items():
        setattr(args, k, v)
    models, routing_models = meta.get("models", models), meta.get("routing_models", [])

    md = [
        "# Accuracy study: bf16 with and without the fp32 list, against fp32",
        "",
        f"Command: `{meta['command']}` (`make study`), {meta['minutes']:.1f} minutes.",
        "",
        f"Machine: {meta['machine']}.",
        "",
    ]
    paths = []
    if models:
        results = {m: analyse(m, out) for m in models}
        paths = plot(results, args, out)
        md += values_markdown(results, meta, args, paths)
    if routing_models:
        routing = {m: analyse_routing(m, out) for m in routing_models}
        paths.append(plot_routing(routing, args, out))
        md += routing_markdown(routing, args, paths[-1])
    (out / "results.md").write_text("\n".join(md))
    print(f"\nDone in {(time.time() - t_start) / 60:.1f} minutes. Tables: {out / 'results.md'}\nPlots: "
          f"{', '.join(os.path.relpath(p, ROOT) for p in paths)} (copied to {out})")


if __name__ == "__main__":
    main()
