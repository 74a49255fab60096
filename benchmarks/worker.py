# Copyright (c) DeepSpeed Team.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""One rank of a benchmark job, started by ``torchrun`` (launch.py): ``worker.py SPEC``.

It reads the job's spec (JSON: the model, the DeepSpeed config, the steps), builds the engine with whichever
DeepSpeed ``import deepspeed`` finds (the launcher's PYTHONPATH chooses the build), trains, measures (counters.py)
and writes ``rank<r>.json`` (and, when asked, the final parameters, ``params.pt``) into the job's folder. Its output
goes to ``rank<r>.log`` there.
"""

import argparse
import atexit
import collections
import gc
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import configs
from counters import (CommCounter, StepGradRecorder, current_rss_bytes, held_bytes, live_tensor_bytes,
                      optimizer_partitions, peak_rss_bytes, peak_rss_since_reset_bytes, reset_peak_rss)
from launch import DEV_TREE, PRISTINE
from models import HF_MODELS, VOCAB, make_autoep_net, make_lm_head_net, make_tiny_net, tiny_hf_models


def _exit_with_parent():
    """End this rank if the launcher goes away (killed, interrupted), instead of waiting in a collective forever."""
    import threading
    parent = os.getppid()

    def watch():
        while True:
            time.sleep(2)
            if os.getppid() != parent:
                os._exit(3)

    threading.Thread(target=watch, daemon=True).start()


def build_engine(spec, config):
    """The model of ``spec`` (seeded; under ZeRO-3 built or loaded under zero.Init) wrapped by deepspeed.initialize."""
    import torch
    import deepspeed
    # "fp32" and "autocast" (torch autocast, no bf16/fp16 section) train fp32 weights
    train_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(spec["dtype"], torch.float32)
    if config.get("zero_optimization", {}).get("zero_hpz_partition_size", 1) > 1:
        # hpZ's group is a process-wide global that zero.Init creates and will not create twice; each engine of a
        # paired timing (several engines in one process) takes a group of its own: an earlier engine keeps the one
        # its parameters and optimizer hold.
        from deepspeed.utils import groups
        groups._ZERO_PARAM_INTRA_PARALLEL_GROUP = None
    offload_param = config.get("zero_optimization", {}).get("offload_param") or {}
    if offload_param.get("nvme_path") == configs.NVME_PATH:
        offload_param["nvme_path"] = tempfile.mkdtemp(prefix="ds-swap-")
        atexit.register(shutil.rmtree, offload_param["nvme_path"], ignore_errors=True)
    torch.manual_seed(spec["seed"])
    if spec["model"] == "hf_config":
        # A transformers model from its config (tiny_hf_models' kind at the spec's sizes), built whole, weights
        # initialised, on the rank's device (a large model would take minutes on the CPU); the engine casts it.
        from deepspeed.accelerator import get_accelerator
        with torch.device(get_accelerator().current_device_name()):
            model = tiny_hf_models.model_class(spec["hf_kind"])(tiny_hf_models.config(spec["hf_kind"],
                                                                                      **spec["hf_sizes"]))

        def loss_fn(engine, ids):
            return engine(input_ids=ids, labels=ids).loss
    elif spec["model"] in HF_MODELS:
        from transformers.integrations import HfDeepSpeedConfig
        hf_ds_config = HfDeepSpeedConfig(config)  # noqa: F841  (ZeRO-3: zero.Init while from_pretrained runs)
        model = tiny_hf_models.model_class(spec["model"]).from_pretrained(spec["model_dir"], dtype=train_dtype)

        def loss_fn(engine, ids):
            return engine(input_ids=ids, labels=ids).loss
    elif spec["model"] == "autoep_net":
        with deepspeed.zero.Init(config_dict_or_path=config, enabled=config["zero_optimization"]["stage"] == 3):
            model = make_autoep_net(spec["dim"], spec["layers"])

        def loss_fn(engine, ids):
            return engine(ids, ids)
    elif spec["model"] == "lm_head_net":
        with deepspeed.zero.Init(config_dict_or_path=config, enabled=config["zero_optimization"]["stage"] == 3):
            model = make_lm_head_net(spec["dim"], spec["vocab_out"], spec["layers"])

        def loss_fn(engine, ids):
            return engine(ids, ids)
    else:
        with deepspeed.zero.Init(config_dict_or_path=config, enabled=config["zero_optimization"]["stage"] == 3):
            model = make_tiny_net(spec["dim"], spec["layers"], spec["keep_per_block"])

        def loss_fn(engine, ids):
            return engine(ids, ids)

    model.train()
    if "optimizer" in config:  # the engine builds it (configs.py: 0-fusedadam)
        engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    else:
        optimizer = torch.optim.AdamW(model.parameters(), lr=spec.get("lr", 1e-3), weight_decay=0.0)
        engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    return engine, loss_fn


def _minor_faults():
    """This process's minor page faults so far: memory the allocator gave back to the OS and touches again."""
    import resource
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def timed_step(engine, loss_fn, ids, acc, faults=None):
    """One training step; returns its loss (a float), wall-clock and CPU seconds (this process). Appends the step's
    minor page faults to ``faults`` when given."""
    acc.synchronize()
    faults_start = _minor_faults()
    start, cpu_start = time.perf_counter(), time.process_time()
    loss = loss_fn(engine, ids)
    engine.backward(loss)
    engine.step()
    acc.synchronize()
    wall, cpu_time = time.perf_counter() - start, time.process_time() - cpu_start
    if faults is not None:
        faults.append(_minor_faults() - faults_start)
    return loss.detach().float().item(), wall, cpu_time


def _paired_main(spec, rank, job_dir, device):
    """Two engines of one build in the same processes (``spec["paired"]``: their configs), trained on the same
    batches in alternating steps (A, B, A, B, ...), so that the machine's load falls on both alike."""
    import torch
    import deepspeed.comm as dist
    from deepspeed.accelerator import get_accelerator
    acc = get_accelerator()
    gen = torch.Generator().manual_seed(spec["seed"] * 1000 + rank)
    total_steps = spec["warmup"] + spec["steps"]
    vocab = spec.get("vocab", VOCAB)
    if spec.get("data") == "sequences":
        # learnable, so that the losses show training: each sample counts up from a random start
        starts = torch.randint(0, vocab, (total_steps, spec["micro_batch"], 1), generator=gen)
        batches = list((starts + torch.arange(spec["seq"])) % vocab)
    else:
        batches = [torch.randint(0, vocab, (spec["micro_batch"], spec["seq"]), generator=gen) for _ in range(total_steps)]
    engines, memory = [], []
    if spec.get("memory") and acc.device_name() != "cpu" and spec.get("warmup_sizes"):
        # A small engine of the same kind and config first, trained one step and dropped: the process's one-off
        # allocations (cuBLAS workspaces of each stream, the optimizer op's buffers) are then made before the first
        # measured engine, which would otherwise count them as its own.
        warm, loss_fn = build_engine(dict(spec, hf_sizes=spec["warmup_sizes"]), spec["paired"][0])
        timed_step(warm, loss_fn, torch.randint(0, spec["warmup_sizes"]["vocab_size"], (2, 8)).to(device), acc)
        del warm, loss_fn
        gc.collect()
        acc.empty_cache()
    for config in spec["paired"]:
        if spec.get("memory") and acc.device_name() != "cpu":
            memory.append(_engine_memory(spec, config, batches[0].to(device), acc, engines))
        else:
            engines.append(build_engine(spec, config))
    times = [[] for _ in engines]
    cpu = [[] for _ in engines]
    faults = [[] for _ in engines]
    losses = [[] for _ in engines]
    for step in range(total_steps):
        # alternate which engine goes first, so that neither always follows the other
        order = range(len(engines)) if step % 2 == 0 else reversed(range(len(engines)))
        for i in order:
            engine, loss_fn = engines[i]
            loss, wall, cpu_time = timed_step(engine, loss_fn, batches[step].to(device), acc, faults[i])
            times[i].append(wall)
            cpu[i].append(cpu_time)
            losses[i].append(loss)
    result = {
        "rank": rank,
        "paired": True,
        "step_times": [t[spec["warmup"]:] for t in times],
        "cpu_times": [c[spec["warmup"]:] for c in cpu],
        "minor_faults": [f[spec["warmup"]:] for f in faults],
        "losses": losses,
        "fp32_params": [sum(p.dtype == torch.float32 for p in e.module.parameters()) for e, _ in engines],
    }
    if memory:
        result["memory"] = memory
    dist.barrier()
    (job_dir / f"rank{rank}.json").write_text(json.dumps(result))
    dist.barrier()


def _engine_memory(spec, config, ids, acc, engines):
    """Build an engine (appended to ``engines``) and measure its device memory as if it were alone: what it holds
    once its optimizer state exists (after one step), and how far the allocator's peak rises above that during a
    step. Also the allocator's reserved memory after that step (the whole process: cached blocks, and blocks that a
    ``record_stream`` keeps until its stream's work is done)."""
    acc.synchronize()
    base = acc.memory_allocated()
    engine, loss_fn = build_engine(spec, config)
    engines.append((engine, loss_fn))
    timed_step(engine, loss_fn, ids, acc)
    held = acc.memory_allocated()
    acc.reset_peak_memory_stats()
    timed_step(engine, loss_fn, ids, acc)
    return {
        "held_bytes": held - base,
        "step_peak_above_held_bytes": acc.max_memory_allocated() - held,
        "peak_alone_bytes": acc.max_memory_allocated() - base,
        "reserved_bytes": acc.memory_reserved(),
        "max_reserved_bytes": acc.max_memory_reserved(),
    }


def _dump_optimizer_states(engine, path, rank):
    """Every trainable parameter's fp32 master, exp_avg and exp_avg_sq into ``path`` (rank 0; a collective)."""
    import torch
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state
    states = {
        name: [
            safe_get_full_fp32_param(p).detach().cpu().clone(),
            safe_get_full_optimizer_state(p, "exp_avg").detach().cpu().clone(),
            safe_get_full_optimizer_state(p, "exp_avg_sq").detach().cpu().clone()
        ]
        for name, p in engine.module.named_parameters() if p.requires_grad
    }
    if rank == 0:
        torch.save(states, path)


def _resume_main(spec, rank, job_dir, device):
    """``spec["resume"]["save"]``: train two steps and save a checkpoint into ``spec["resume"]["dir"]``. Else load
    that checkpoint and measure the load: this rank's peak RSS above its RSS before (the CPU) or the allocator's
    peak above its allocation before (an accelerator), the bytes the collectives carried, by kind, and the seconds;
    then (and after a save) every parameter's fp32 master, exp_avg and exp_avg_sq into ``states.pt``."""
    import torch
    import deepspeed.comm as dist
    from deepspeed.accelerator import get_accelerator
    acc = get_accelerator()
    resume = spec["resume"]
    engine, loss_fn = build_engine(spec, spec["config"])
    if resume["save"]:
        gen = torch.Generator().manual_seed(spec["seed"] * 1000 + rank)
        for _ in range(2):
            timed_step(engine, loss_fn, torch.randint(0, VOCAB, (spec["micro_batch"], spec["seq"]), generator=gen)
                       .to(device), acc)
        engine.save_checkpoint(resume["dir"], tag="resume")
        _dump_optimizer_states(engine, job_dir / "states.pt", rank)
        result = {"rank": rank}
    else:
        counter = CommCounter()
        gc.collect()
        dist.barrier()
        on_cpu = acc.device_name() == "cpu"
        if on_cpu:
            reset = reset_peak_rss()
            before = current_rss_bytes()
        else:
            acc.synchronize()
            acc.reset_peak_memory_stats()
            before = acc.memory_allocated()
        counter.active = True
        start = time.perf_counter()
        engine.load_checkpoint(resume["dir"], tag="resume")
        seconds = time.perf_counter() - start
        counter.active = False
        peak = (peak_rss_since_reset_bytes() if on_cpu else acc.max_memory_allocated()) - before
        result = {
            "rank": rank,
            "seconds": seconds,
            "peak_above_before_bytes": peak,
            "peak_is_rss": on_cpu,
            "peak_reset": reset if on_cpu else True,
            "comm": counter.snapshot(),
        }
        if resume.get("dump", True):  # 0.19.8 links loaded optimizer states to their parameters only at a step
            _dump_optimizer_states(engine, job_dir / "states.pt", rank)
    dist.barrier()
    (job_dir / f"rank{rank}.json").write_text(json.dumps(result))
    dist.barrier()


def _numel(p):
    """A parameter's full number of elements (ZeRO-3 keeps only a partition in ``p``)."""
    return getattr(p, "ds_numel", p.numel())


def _partition_numel(p, stage, world_size):
    """The elements of a parameter that one rank's partitions hold (ZeRO-1/2: its share of the flat partition)."""
    if hasattr(p, "ds_tensor"):
        return p.ds_tensor.numel()
    return p.numel() if stage == 0 else -(-p.numel() // world_size)


def _masters(engine):
    """The fp32 master of each parameter, by parameter id, where ``safe_get_full_fp32_param`` finds none: the fp32
    copies of the engine's fp16/bf16 optimizer (no ZeRO), or the parameter itself (fp32, no wrapper)."""
    opt = engine.optimizer
    masters = {}
    for low, high in zip(getattr(opt, "fp16_groups", []) or [], getattr(opt, "fp32_groups", []) or []):
        if isinstance(low, (list, tuple)) and isinstance(high, (list, tuple)):
            masters.update((id(a), b) for a, b in zip(low, high))
    return masters


def dump_params(engine, params, path, rank):
    """Every parameter twice, into ``path`` (rank 0): its fp32 master and its full value in the dtype it trains in."""
    import torch
    import deepspeed
    from deepspeed.utils import safe_get_full_fp32_param
    by_id = _masters(engine)
    masters, gathered = {}, {}
    for name, p in params:
        master = safe_get_full_fp32_param(p)
        if master is None:
            master = by_id.get(id(p), p)
        masters[name] = master.detach().cpu().clone()
        with deepspeed.zero.GatheredParameters([p], enabled=hasattr(p, "ds_id")):
            gathered[name] = p.data.detach().cpu().clone()
    if rank == 0:
        torch.save({"master": masters, "gathered": gathered}, path)


def _log_to_file(path):
    """Send this process's output (Python's and the C++ libraries') to ``path``."""
    sys.stdout.flush()
    sys.stderr.flush()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)


def worker_main(spec_path):
    spec = json.loads(Path(spec_path).read_text())
    rank = int(os.environ["RANK"])
    _log_to_file(Path(spec["job_dir"]) / f"rank{rank}.log")
    _exit_with_parent()
    world_size = int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ["LOCAL_RANK"])
    job_dir = Path(spec["job_dir"])

    import torch
    import deepspeed
    import deepspeed.comm as dist
    from deepspeed.accelerator import get_accelerator

    ds_path = Path(deepspeed.__path__[0]).resolve()
    expected = (PRISTINE if spec["build"] == "pristine" else DEV_TREE) / "deepspeed"
    if spec["build"] == "pristine" and ds_path != expected.resolve():
        raise SystemExit(f"expected pristine DeepSpeed at {expected}, imported {ds_path}")
    if spec["build"] == "patched" and PRISTINE.resolve() in ds_path.parents:
        raise SystemExit(f"expected the patched DeepSpeed, imported the pristine one at {ds_path}")

    acc = get_accelerator()
    device_type = acc.device_name()
    if spec["dtype"] == "fp16" and device_type == "cpu":
        # DeepSpeed refuses fp16 on CPUs without avx512_fp16; the benchmark only needs it to run.
        type(acc).is_fp16_supported = lambda self: True
    if device_type != "cpu":
        acc.set_device(local_rank)
    backend = "gloo" if device_type == "cpu" else acc.communication_backend_name()
    deepspeed.init_distributed(dist_backend=backend)

    config = spec["config"]
    micro_batch, seq = spec["micro_batch"], spec["seq"]
    device = torch.device(acc.current_device_name())

    if spec.get("paired"):
        _paired_main(spec, rank, job_dir, device)
        return
    if spec.get("resume"):
        _resume_main(spec, rank, job_dir, device)
        return

    engine, loss_fn = build_engine(spec, config)
    zero_opt = engine.optimizer
    stage = config["zero_optimization"]["stage"]

    params = list(engine.module.named_parameters())
    fp32_params = [(n, p) for n, p in params if p.dtype == torch.float32]
    kept_partition_elements = sum(_partition_numel(p, stage, world_size) for _, p in fp32_params)
    kept_elements = sum(_numel(p) for _, p in fp32_params)

    counter = CommCounter()
    # kept_memory.py: the fp32 gradient partition each flat master partition holds at the optimizer step
    step_grads = StepGradRecorder(zero_opt.optimizer) if spec.get("kept_memory") else None
    gen = torch.Generator().manual_seed(spec["seed"] * 1000 + rank)
    total_steps = spec["warmup"] + spec["steps"]
    batches = [torch.randint(0, VOCAB, (micro_batch, seq), generator=gen) for _ in range(total_steps + 2)]

    losses, step_times, cpu_times = [], [], []
    live_peak = 0
    for step in range(total_steps):
        if step == spec["warmup"]:
            counter.active = True
            if device_type != "cpu":
                acc.synchronize()
                acc.reset_peak_memory_stats()
        loss, wall, cpu_time = timed_step(engine, loss_fn, batches[step].to(device), acc)
        step_times.append(wall)
        cpu_times.append(cpu_time)
        losses.append(loss)
    counter.active = False
    comm = counter.snapshot()
    timed = max(1, spec["steps"])

    result = {
        "rank": rank,
        "build": spec["build"],
        "deepspeed": deepspeed.__version__,
        "deepspeed_path": str(ds_path),
        "device": device_type,
        "backend": backend,
        "losses": losses,
        "loss_hex": [float(x).hex() for x in losses],
        "step_times": step_times[spec["warmup"]:],
        "warmup_times": step_times[:spec["warmup"]],
        # CPU seconds of this process (all its threads, gloo's included) per timed step: less sensitive than wall
        # time to other processes on a shared machine; waiting in a collective costs none
        "cpu_times": cpu_times[spec["warmup"]:],
        "comm_per_step": {
            k: [v[0] / timed, v[1] / timed]
            for k, v in comm.items()
        },
        "n_params": len(params),
        "n_elements": sum(_numel(p) for _, p in params),
        "optimizer_class": type(zero_opt).__name__,
        "fp32_params": [n for n, _ in fp32_params],
        "kept_elements": kept_elements,
        "kept_partition_elements": kept_partition_elements,
        "param_dtypes": dict(collections.Counter(str(p.dtype).replace("torch.", "") for _, p in params)),
    }

    if spec.get("measure"):
        # One more step, measured: the live-tensor census (CPU) after backward and after the step, the optimizer's
        # state by component, and DeepSpeed's own comms logger, switched on for this step only.
        dist.configure(enabled=True, prof_all=True, verbose=False, debug=False)
        ids = batches[total_steps].to(device)
        loss = loss_fn(engine, ids)
        backward_peak = 0
        reduce_grad = getattr(zero_opt, "reduce_independent_p_g_buckets_and_remove_grads", None)
        if device_type == "cpu" and reduce_grad is not None:
            # During backward too (ZeRO-1/2/3): a census each time a gradient is about to enter its reduce bucket,
            # when the gradients that wait for their bucket's reduction are all alive.

            def census_then_reduce(*args, **kwargs):
                nonlocal backward_peak
                backward_peak = max(backward_peak, live_tensor_bytes("cpu"))
                return reduce_grad(*args, **kwargs)

            zero_opt.reduce_independent_p_g_buckets_and_remove_grads = census_then_reduce
        engine.backward(loss)
        if device_type == "cpu" and reduce_grad is not None:
            del zero_opt.reduce_independent_p_g_buckets_and_remove_grads
        if device_type == "cpu":
            result["live_tensor_backward_peak_bytes"] = backward_peak
            live_peak = max(live_peak, backward_peak, live_tensor_bytes("cpu"))
        engine.step()
        acc.synchronize()
        comms_dict = dist.comms_logger.comms_dict
        result["comms_logger"] = {name: sum(v[0] for v in sizes.values()) for name, sizes in comms_dict.items()}
        dist.configure(enabled=False)
        gc.collect()
        if device_type == "cpu":
            steady = live_tensor_bytes("cpu")
            result["live_tensor_bytes"] = steady
            result["live_tensor_peak_bytes"] = max(live_peak, steady)
        else:
            result["allocated_bytes"] = acc.memory_allocated()
            result["allocator_peak_bytes"] = acc.max_memory_allocated()
        result["optimizer_bytes"] = held_bytes(engine)
    if step_grads is not None:
        result["optimizer_partitions"] = optimizer_partitions(engine, step_grads.grads)
    result["peak_rss_bytes"] = peak_rss_bytes()
    result["rss_bytes"] = current_rss_bytes()

    if spec.get("dump_params"):
        dump_params(engine, params, job_dir / "params.pt", rank)

    dist.barrier()
    (job_dir / f"rank{rank}.json").write_text(json.dumps(result))
    # Let every rank write before the process group goes away.
    dist.barrier()
    if hasattr(dist, "destroy_process_group"):
        try:
            dist.destroy_process_group()
        except Exception:  # noqa: BLE001  (teardown only)
            pass


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("spec", help="the job's spec (JSON) that launch.py wrote")
    worker_main(parser.parse_args().spec)
