# Copyright (c) DeepSpeed Team.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""What a rank counts (imported by worker.py, inside the ranks): the collectives that reach DeepSpeed's
communication backend, by kind and dtype; the bytes of live tensors, of the optimizer's buffers and states; RSS.
"""

import collections
import gc
import os

COMM_KINDS = {
    "all_gather_into_tensor": "all-gather",
    "all_gather": "all-gather",
    "all_gather_base": "all-gather",
    "all_gather_coalesced": "all-gather",
    "reduce_scatter_tensor": "reduce-scatter",
    "reduce_scatter": "reduce-scatter",
    "all_reduce": "all-reduce",
    "all_reduce_coalesced": "all-reduce",
    "inference_all_reduce": "all-reduce",
    "reduce": "reduce",
    "broadcast": "broadcast",
    "all_to_all_single": "all-to-all",
    "all_to_all": "all-to-all",
    "broadcast_object_list": "object",
    "all_gather_object": "object",
    "gather_object": "object",
    "scatter_object_list": "object",
}


def _first_tensor(values):
    import torch
    for value in values:
        if isinstance(value, torch.Tensor):
            return value
        if isinstance(value, (list, tuple)):
            found = _first_tensor(value)
            if found is not None:
                return found
    return None


def _tensors(values):
    import torch
    for value in values:
        if isinstance(value, torch.Tensor):
            yield value
        elif isinstance(value, (list, tuple)):
            yield from _tensors(value)


class CommCounter:
    """Counts the collectives that reach DeepSpeed's communication backend, by kind and dtype.

    Wraps the backend's methods (``deepspeed.comm.comm.cdb``), which every ``deepspeed.comm`` collective calls.
    DeepSpeed's comms logger counts the same calls by name and message size but not by dtype.
    """

    def __init__(self):
        import deepspeed.comm.comm as dcomm
        self.counts = collections.Counter()
        self.bytes = collections.Counter()
        self.active = False
        cdb = dcomm.cdb
        for op in COMM_KINDS:
            fn = getattr(cdb, op, None)
            if fn is not None:
                setattr(cdb, op, self._wrap(op, fn))

    def _wrap(self, op, fn):

        def counted(*args, **kwargs):
            if self.active and COMM_KINDS[op] == "object":
                # Python objects, pickled: their bytes once the call has filled the list
                import pickle
                result = fn(*args, **kwargs)
                self.counts[("object", "-")] += 1
                self.bytes[("object", "-")] += len(pickle.dumps(args[0] if args else kwargs.get("object_list")))
                return result
            if self.active:
                values = list(args) + list(kwargs.values())
                tensor = _first_tensor(values)
                key = (COMM_KINDS[op], str(tensor.dtype).replace("torch.", "") if tensor is not None else "-")
                self.counts[key] += 1
                # message: the largest tensor argument (the gathered output, the reduce-scatter input)
                self.bytes[key] += max((t.numel() * t.element_size() for t in _tensors(values)), default=0)
            return fn(*args, **kwargs)

        return counted

    def snapshot(self):
        return {
            f"{kind}|{dtype}": [self.counts[(kind, dtype)], self.bytes[(kind, dtype)]]
            for kind, dtype in self.counts
        }


def _storage_key(tensor):
    try:
        storage = tensor.untyped_storage()
        return storage.data_ptr(), storage.nbytes(), tensor.device.type
    except (RuntimeError, NotImplementedError):
        return None


def live_tensor_bytes(device_type):
    """Bytes of all distinct tensor storages on ``device_type`` that Python objects reach (a CPU allocator census)."""
    import torch
    seen = set()
    total = 0
    for obj in gc.get_objects():
        try:
            is_tensor = isinstance(obj, torch.Tensor)
        except ReferenceError:  # a weakref.proxy whose object is gone (the Muon optimizer holds some)
            continue
        if is_tensor:
            key = _storage_key(obj)
            if key and key[0] and key[2] == device_type and key[0] not in seen:
                seen.add(key[0])
                total += key[1]
    return total


def _reachable_tensors(value, seen, depth):
    """The tensors in ``value``: itself, in lists, tuples and dicts, and in objects of DeepSpeed's own classes (ipg
    buckets, swappers, ...), ``depth`` levels deep; not in modules or optimizers (counted on their own)."""
    import torch
    if id(value) in seen or depth < 0:
        return
    seen.add(id(value))
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (list, tuple, set)):
        for item in value:
            yield from _reachable_tensors(item, seen, depth - 1)
    elif isinstance(value, dict):
        for item in value.values():
            yield from _reachable_tensors(item, seen, depth - 1)
    elif (type(value).__module__.startswith("deepspeed") and hasattr(value, "__dict__")
          and not isinstance(value, (torch.nn.Module, torch.optim.Optimizer))):
        for item in vars(value).values():
            yield from _reachable_tensors(item, seen, depth - 1)


def held_bytes(engine):
    """Bytes the parameters and the optimizer hold on this rank, by component; each storage counted once, in the
    first component that reaches it:

    * ``parameters``: the module's parameters (under ZeRO-3 their partitions, ``ds_tensor``), in every dtype;
    * ``optimizer states``: the basic (torch) optimizer's states, e.g. Adam's moments;
    * then each attribute of DeepSpeed's optimizer wrapper that holds tensors (``fp32_groups``,
      ``single_partition_of_fp32_groups``, ``fp32_partitioned_groups_flat``, ``ipg_buckets`` ...), by its name:
      masters, flat buffers, gradient partitions, reduce buckets, whatever the stage keeps. Each stage names its
      buffers in its own way; comparing two runs of one stage shows which buffer grew.
    """
    import torch
    storages = set()

    def size(tensors):
        total = 0
        for t in tensors:
            key = _storage_key(t)
            if key and key[0] and key[0] not in storages:
                storages.add(key[0])
                total += key[1]
        return total

    components = collections.OrderedDict()
    params = list(engine.module.parameters())
    components["parameters"] = size(getattr(p, "ds_tensor", p) for p in params)
    opt = engine.optimizer
    basic = getattr(opt, "optimizer", opt)
    states = []
    if isinstance(basic, torch.optim.Optimizer):
        for state in basic.state.values():
            states.extend(v for v in state.values() if isinstance(v, torch.Tensor) and v.dim() > 0)
    components["optimizer states"] = size(states)
    if opt is not basic and hasattr(opt, "__dict__"):
        skip = {id(p) for p in params} | {id(basic), id(engine), id(engine.module)}
        for name, value in sorted(vars(opt).items()):
            if isinstance(value, (torch.nn.Module, torch.optim.Optimizer)):
                continue
            held = size(_reachable_tensors(value, set(skip), 3))
            if held:
                components["optimizer." + name] = held
    return components


def reset_peak_rss():
    """Start this process's peak RSS (VmHWM) afresh from its current RSS (Linux: /proc/self/clear_refs). Returns
    whether it could."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def peak_rss_since_reset_bytes():
    """VmHWM: the peak RSS since reset_peak_rss (or since the start)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return 0


def peak_rss_bytes():
    import resource
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB


def current_rss_bytes():
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return 0


class StepGradRecorder:
    """Records, each time the basic (torch) optimizer steps, the gradient each of its parameters holds at that
    moment: under ZeRO-1/2/3 and the BF16 optimizer, the fp32 gradient partition of each flat master partition
    (``id(master) -> (numel, bytes, dtype)``). Wraps the instance's ``step``; the last step's values stay."""

    def __init__(self, basic):
        self.grads = {}
        step = basic.step

        def recording_step(*args, **kwargs):
            for group in basic.param_groups:
                for p in group["params"]:
                    if p.grad is not None:
                        self.grads[id(p)] = (p.grad.numel(), p.grad.numel() * p.grad.element_size(),
                                             str(p.grad.dtype).replace("torch.", ""))
            return step(*args, **kwargs)

        basic.step = recording_step


def _master_partitions(opt):
    """(kind, the flat fp32 master partitions of this rank, whether each belongs to a group of kept parameters,
    the full flat fp32 gradient buffer of each group or None) of DeepSpeed's optimizer wrapper ``opt``, for ZeRO-1/2
    (``single_partition_of_fp32_groups``), the BF16 optimizer (``fp32_groups_flat_partition``) and ZeRO-3
    (``fp32_partitioned_groups_flat``); pristine 0.19.8 has no kept groups."""
    if hasattr(opt, "fp32_groups_flat_partition") and hasattr(opt, "bf16_groups"):
        masters = list(opt.fp32_groups_flat_partition)
        kept = list(getattr(opt, "group_kept_in_fp32", []) or [False] * len(masters))
        return "bf16_optimizer", masters, kept, list(opt.fp32_groups_gradients_flat)
    if hasattr(opt, "single_partition_of_fp32_groups"):
        masters = list(opt.single_partition_of_fp32_groups)
        if getattr(opt, "keeps_params_in_fp32", False):
            kept = [opt._kept_group(i) for i in range(len(masters))]
        else:
            kept = [False] * len(masters)
        return "zero1_2", masters, kept, [None] * len(masters)
    if hasattr(opt, "fp32_partitioned_groups_flat"):
        masters = list(opt.fp32_partitioned_groups_flat)
        if getattr(opt, "keeps_params_in_fp32", False):
            from deepspeed.runtime.keep_in_fp32 import is_kept_in_fp32  # the series only
            kept = [is_kept_in_fp32(opt.fp16_groups[i][0]) for i in range(len(masters))]
        else:
            kept = [False] * len(masters)
        return "zero3", masters, kept, [None] * len(masters)
    raise ValueError(f"no flat fp32 master partitions in {type(opt).__name__}")


def optimizer_partitions(engine, step_grads):
    """Per flat group of DeepSpeed's optimizer, what this rank holds: its fp32 master partition (elements, bytes),
    the basic optimizer's states of it (Adam's exp_avg and exp_avg_sq: tensors of one or more dimensions), the fp32
    gradient partition it held at the last optimizer step (``step_grads``: a StepGradRecorder's), and whether the
    group is one of parameters kept in fp32. ZeRO-3: whether the master is the parameter partition itself; the BF16
    optimizer: its full flat gradient buffer (every group has one, of all the group's elements)."""
    import torch
    opt = engine.optimizer
    basic = opt.optimizer
    kind, masters, kept, grad_buffers = _master_partitions(opt)
    groups = []
    for i, master in enumerate(masters):
        state = basic.state.get(master, {})
        states = {k: v.numel() * v.element_size() for k, v in state.items() if isinstance(v, torch.Tensor) and v.dim()}
        grad = step_grads.get(id(master))
        entry = {
            "kept": bool(kept[i]),
            "master_numel": master.numel(),
            "master_bytes": master.numel() * master.element_size(),
            "master_dtype": str(master.dtype).replace("torch.", ""),
            "state_bytes": sum(states.values()),
            "states": sorted(states),
            "grad_numel": grad[0] if grad else 0,
            "grad_bytes": grad[1] if grad else 0,
            "grad_dtype": grad[2] if grad else None,
        }
        if grad_buffers[i] is not None:
            entry["full_grad_buffer_bytes"] = grad_buffers[i].numel() * grad_buffers[i].element_size()
        if kind == "zero3":
            entry["master_is_param_partition"] = master.data_ptr() == opt.fp16_partitioned_groups_flat[i].data_ptr()
            entry["group_full_numel"] = sum(p.ds_numel for p in opt.fp16_groups[i])
        else:
            flat = (opt.bf16_groups_flat if kind == "bf16_optimizer" else opt.bit16_groups_flat)[i]
            entry["group_full_numel"] = sum(p.numel() for p in
                                            (opt.bf16_groups if kind == "bf16_optimizer" else opt.bit16_groups)[i])
            entry["group_flat_numel"] = flat.numel()
        groups.append(entry)
    return {"kind": kind, "groups": groups}
