# Copyright (c) DeepSpeed Team.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""The whole training state of an engine, per parameter name, and what a resume must do with it: the oracle of every
resume test.

``whole_state(engine)`` (a collective: every rank calls it) returns what a job that stopped and resumed must get back:

- per trainable parameter name, every state its optimizer keeps for it: each tensor state (Adam's ``exp_avg`` and
  ``exp_avg_sq``, SGD's ``momentum_buffer``, ...) gathered whole, and each scalar state (``step``) as every master
  holding a piece of the parameter on any rank holds it (they must agree), with the hyperparameters of its param
  group (``lr``, ``betas``, ``initial_lr`` that a scheduler adds, ...);
- its fp32 master, gathered whole;
- the loss scaler's state, the lr scheduler's ``state_dict()`` and the engine's step counters (``micro_steps`` is not
  saved by DeepSpeed, so it is not compared).

The masters are found through attributes that DeepSpeed 0.19.8 has too, so a reference can be taken by a pristine
0.19.8 run. ``check_whole_state(got, want)`` compares two of them key by key, exactly. ``Continuation(engine)``, made
right after a load, records what the base optimizer is fed during the next steps and ``check(k)`` replays it on an
optimizer of the same class per master, fed the loaded state: each master and each of its states must equal the
replay's bit for bit, and each master's ``step`` must be the loaded count plus k. A step tensor that two masters
share (each ``step()`` then advances it once per master) fails both ``check_masters_own_their_states`` and the
replay.
"""

import copy
import glob
import inspect
import os

import torch

import deepspeed.comm as dist
from deepspeed.accelerator import get_accelerator

COUNTERS = ("global_steps", "global_samples", "skipped_steps")


def base_optimizer(engine):
    """The torch optimizer under the engine's: ZeRO's optimizers and the fp16/bf16 wrappers hold it as
    ``.optimizer``."""
    optimizer = engine.optimizer
    while not isinstance(optimizer, torch.optim.Optimizer):
        optimizer = optimizer.optimizer
    return optimizer


def _masters(engine):
    """This rank's masters: [(the base optimizer's tensor, [(name, offset in it, the parameter)] whose pieces it
    holds)], through attributes that 0.19.8's optimizers have as well."""
    wrapper, optimizer = engine.optimizer, base_optimizer(engine)
    names = {id(param): name for name, param in engine.module.named_parameters()}
    if hasattr(wrapper, "fp32_partitioned_groups_flat"):  # ZeRO-3
        result = []
        for params, master in zip(wrapper.fp16_groups, wrapper.fp32_partitioned_groups_flat):
            result.append((master, [(names[id(p)], None, p) for p in params]))
        return result
    params = [(name, p) for name, p in engine.module.named_parameters() if getattr(p, "_hp_mapping", None)]
    if hasattr(wrapper, "bit16_groups") or hasattr(wrapper, "bf16_groups"):  # ZeRO-1/2, the BF16 optimizer
        result = []
        for group in optimizer.param_groups:
            for master in group["params"]:
                ptr = master.untyped_storage().data_ptr()
                held = [(name, None, p) for name, p in params
                        if p._hp_mapping.hp_fragment.untyped_storage().data_ptr() == ptr]
                result.append((master, held))
        return result
    if hasattr(wrapper, "fp32_groups_flat"):  # FP16_Optimizer
        return [(master, [(names[id(p)], None, p) for p in params])
                for params, master in zip(wrapper.fp16_groups, wrapper.fp32_groups_flat)]
    if hasattr(wrapper, "fp32_groups"):  # FP16_UnfusedOptimizer: a master per parameter
        return [(master, [(names[id(p)], None, p)])
                for params, masters in zip(wrapper.fp16_groups, wrapper.fp32_groups)
                for p, master in zip(params, masters)]
    return [(p, [(names[id(p)], None, p)]) for group in optimizer.param_groups for p in group["params"]]


def _group_index_of(optimizer, master, engine):
    """The index of the param group of ``master``."""
    for index, group in enumerate(optimizer.param_groups):
        if any(p is master for p in group["params"]):
            return index
    wrapper = engine.optimizer  # ZeRO-3 lists a sub-group's master in its param group only during its step
    return wrapper.sub_group_to_group_id[[id(m) for m in wrapper.fp32_partitioned_groups_flat].index(id(master))]


def _group_of(optimizer, master, engine):
    """The hyperparameters of the param group of ``master`` (without ``params``)."""
    group = optimizer.param_groups[_group_index_of(optimizer, master, engine)]
    return {key: value for key, value in group.items() if key != "params"}


def _plain(value):
    return value.item() if torch.is_tensor(value) else value


def _is_flat(value):
    return torch.is_tensor(value) and value.dim() > 0


def _full_tensor_state(engine, param, key, flat_state, offset):
    """The whole of ``param``'s tensor state ``key`` (None: its fp32 master), from ``flat_state``, this rank's flat
    tensor of it that holds the parameter at ``offset`` (None where this rank holds none of it). A collective under
    ZeRO."""
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state
    if hasattr(param, "_hp_mapping"):  # ZeRO-1/2, the BF16 optimizer: the fragments of the ranks, summed
        mapping = param._hp_mapping
        buffer = torch.zeros(param.numel(), dtype=torch.float32, device=get_accelerator().current_device_name())
        if mapping is not None and flat_state is not None:
            lp, hp = mapping.lp_fragment_address, mapping.get_hp_fragment_address()
            buffer.narrow(0, lp.start, lp.numel).copy_(flat_state.reshape(-1).narrow(0, hp.start, hp.numel))
        dist.all_reduce(buffer, group=param._dp_group)
        return buffer.view_as(param).cpu()
    value = safe_get_full_fp32_param(param) if key is None else safe_get_full_optimizer_state(param, key)
    if value is not None:  # ZeRO-3
        return value.detach().cpu().clone()
    return flat_state.reshape(-1).narrow(0, offset, param.numel()).view_as(param).detach().cpu().clone()


def whole_state(engine):
    """The engine's whole training state, per parameter name (see the module's docstring). A collective."""
    optimizer = base_optimizer(engine)
    masters = _masters(engine)
    local = {}  # name -> (scalars of each master holding a piece, tensor keys, the group's hyperparameters)
    offsets = {}
    group_scalars = {}  # param group index -> the scalar states of its masters on this rank, those of padding too
    for master, held in masters:
        state = optimizer.state[master]
        scalars = {key: _plain(value) for key, value in state.items() if not _is_flat(value)}
        group_scalars.setdefault(_group_index_of(optimizer, master, engine), []).append(scalars)
        keys = sorted(key for key, value in state.items() if _is_flat(value))
        group = _group_of(optimizer, master, engine)
        start = 0
        for name, _, param in held:
            local.setdefault(name, []).append((scalars, keys, group))
            offsets[name] = (master, start)
            start += param.numel()
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, (local, group_scalars))
    groups = {}
    for _, rank_groups in gathered:
        for index, scalars in rank_groups.items():
            groups.setdefault(index, []).extend(scalars)
    for index, scalars in groups.items():  # every master of a param group, on every rank, counts alike
        assert all(s == scalars[0] for s in scalars), f"the masters of param group {index} disagree: {scalars}"
    gathered = [rank_local for rank_local, _ in gathered]
    params = {}
    for name, param in engine.module.named_parameters():
        if not param.requires_grad:
            continue
        seen = [entry for rank_local in gathered for entry in rank_local.get(name, [])]
        assert seen, f"{name}: no master holds it on any rank"
        scalars, keys, group = seen[0]
        for other in seen[1:]:
            assert other == seen[0], f"{name}: the masters holding it disagree: {seen}"
        entry = {"scalars": scalars, "group": group, "states": {}}
        master, offset = offsets.get(name, (None, 0))
        flat = lambda key: master if key is None else optimizer.state[master][key]  # noqa: E731
        for key in [None] + keys:
            value = _full_tensor_state(engine, param, key, flat(key) if master is not None else None, offset)
            entry["states"]["master" if key is None else key] = value
        params[name] = entry
    scaler = getattr(engine.optimizer, "loss_scaler", None)
    scheduler = getattr(engine, "lr_scheduler", None)
    return {
        "params": params,
        "groups": {
            index: scalars[0]
            for index, scalars in groups.items()
        },
        "scaler": {
            key: _plain(value)
            for key, value in vars(scaler).items()
        } if scaler is not None else None,
        "scheduler": scheduler.state_dict() if scheduler is not None else None,
        "counters": {
            key: getattr(engine, key)
            for key in COUNTERS
        },
    }


def check_whole_state(got, want, what="the load", masters_to_the_last_bits=False):
    """``got`` is ``want`` (whole_state), exactly: the same parameters, each with the same tensor states (dtype and
    every value), scalar states and hyperparameters; the same scaler, scheduler and counters. With
    ``masters_to_the_last_bits`` the fp32 masters may differ in their last bits (FusedAdam's CPU build, see
    Continuation.check)."""
    assert set(got["params"]) == set(want["params"]), \
        f"after {what}: parameters {sorted(set(got['params']) ^ set(want['params']))} differ"
    for name, entry in want["params"].items():
        other = got["params"][name]
        assert set(other["states"]) == set(entry["states"]), \
            f"{name}: states {sorted(other['states'])} after {what}, {sorted(entry['states'])} saved"
        for key, value in entry["states"].items():
            assert other["states"][key].dtype == value.dtype, f"{name}: {key} is {other['states'][key].dtype}"
            if key == "master" and masters_to_the_last_bits:
                torch.testing.assert_close(other["states"][key], value, rtol=1e-6, atol=1e-9)
            else:
                assert torch.equal(other["states"][key], value), f"{name}: {key} differs after {what}"
        assert other["scalars"] == entry["scalars"], \
            f"{name}: scalar states {other['scalars']} after {what}, {entry['scalars']} saved"
        assert other["group"] == entry["group"], \
            f"{name}: param group {other['group']} after {what}, {entry['group']} saved"
    assert got["groups"] == want["groups"], f"the param groups' scalar states after {what}: {got['groups']}, saved " \
        f"{want['groups']}"
    for key in ("scaler", "scheduler", "counters"):
        assert got[key] == want[key], f"the {key} after {what}: {got[key]}, saved {want[key]}"


def check_masters_own_their_states(engine):
    """No two masters share a state tensor (a shared ``step`` is advanced once per master a step)."""
    optimizer = base_optimizer(engine)
    seen = {}
    for index, (master, _) in enumerate(_masters(engine)):
        for key, value in optimizer.state[master].items():
            if torch.is_tensor(value):
                ptr = value.untyped_storage().data_ptr()
                assert ptr not in seen, f"masters {seen[ptr]} and {index} share their state {key!r}"
                seen[ptr] = index


def _same_bits(a, b):
    """``a`` and ``b`` hold the same bits (NaN included: a ZeRO-3 partition's padding may hold uninitialized memory,
    which its optimizer steps like the rest)."""
    a, b = torch.as_tensor(a), torch.as_tensor(b)
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return torch.equal(a.detach().reshape(-1).contiguous().view(torch.uint8),
                       b.detach().reshape(-1).contiguous().view(torch.uint8))


class Continuation:
    """Made right after a load: records each master with its loaded value and state, and each call of the base
    optimizer's ``step`` during the next steps: per param group, its hyperparameters then (a scheduler sets the lr)
    and the gradients of its masters. ``check(k)`` after k steps replays the calls on an optimizer of the same class
    per param group (ZeRO-3 steps one sub-group's master at a time: one per master), fed copies of the loaded masters
    and of each one's loaded state, made one by one, as a job that never stopped holds them (see the module's
    docstring)."""

    def __init__(self, engine):
        self.optimizer = base_optimizer(engine)
        self.loaded = {}
        for index, (master, _) in enumerate(_masters(engine)):
            state = copy.deepcopy(dict(self.optimizer.state[master]))
            self.loaded[id(master)] = (index, master, master.detach().clone(), state)
        self.calls = []
        self.handle = self.optimizer.register_step_pre_hook(self._record)

    def _record(self, optimizer, args, kwargs):
        call = []
        for group in optimizer.param_groups:
            stepped = [(id(p), p.grad.detach().clone()) for p in group["params"]
                       if id(p) in self.loaded and p.grad is not None]
            if stepped:
                hyperparameters = {key: copy.deepcopy(value) for key, value in group.items() if key != "params"}
                call.append((hyperparameters, stepped))
        self.calls.append(call)

    def _replay(self):
        """The replayed masters and their states, by id of the engine's master."""
        copies = {key: torch.nn.Parameter(loaded.clone()) for key, (_, _, loaded, _) in self.loaded.items()}
        replicas = {}
        kwargs = {}
        if "adamw_mode" in inspect.signature(type(self.optimizer)).parameters:  # DeepSpeedCPUAdam: off the group
            kwargs["adamw_mode"] = self.optimizer.adam_w_mode
        for call in self.calls:
            for hyperparameters, stepped in call:
                ids = tuple(key for key, _ in stepped)
                if ids not in replicas:
                    replica = type(self.optimizer)([dict(hyperparameters, params=[copies[key] for key in ids])],
                                                   **kwargs)
                    for key in ids:  # each master's own copy of its own state
                        replica.state[copies[key]] = copy.deepcopy(self.loaded[key][3])
                    replicas[ids] = replica
                replica = replicas[ids]
                replica.param_groups[0].update(hyperparameters)
                for key, grad in stepped:
                    copies[key].grad = grad
                replica.step()
        states = {}
        for ids, replica in replicas.items():
            for key in ids:
                states[key] = replica.state[copies[key]]
        return copies, states

    def check(self, steps):
        self.handle.remove()
        stepped = {}
        for call in self.calls:
            for _, masters in call:
                for key, _ in masters:
                    stepped[key] = stepped.get(key, 0) + 1
        copies, states = self._replay()
        for key, (index, master, loaded, state) in self.loaded.items():
            assert stepped.get(key, 0) == steps, f"master {index} was stepped {stepped.get(key, 0)} times in {steps}"
            now = self.optimizer.state[master]
            if "step" in state:
                assert _plain(now["step"]) == _plain(state["step"]) + steps, \
                    f"master {index}: step {_plain(now['step'])}, loaded {_plain(state['step'])} + {steps} steps"
            replayed = copies[key].detach()
            message = (f"master {index} ({tuple(master.shape)}) is not what its optimizer makes of the loaded state "
                       f"in {steps} steps: {(replayed - master.detach()).abs().max().item()} apart")
            if type(self.optimizer).__name__ == "FusedAdam":
                # its CPU build keeps one C++ Adam per process, whose bias corrections follow the previous call
                # (incremental powers of the betas, else std::pow): a replay in the same process can differ in the
                # last bits; a wrong step changes them by far more
                torch.testing.assert_close(replayed,
                                           master.detach(),
                                           rtol=1e-6,
                                           atol=1e-9,
                                           equal_nan=True,
                                           msg=message)
            else:
                assert _same_bits(replayed, master), message
            for name, value in states[key].items():
                assert _same_bits(value, now[name]), \
                    f"master {index}: {name} is not what its optimizer makes of the loaded state in {steps} steps"


def check_steps(engine, steps, every_master):
    """Every master's ``step`` in memory is ``steps``; with ``every_master`` each master has one (Adam's; SGD keeps
    none, Muon's matrices neither)."""
    optimizer = base_optimizer(engine)
    for index, (master, held) in enumerate(_masters(engine)):
        state = optimizer.state[master]
        names = [name for name, _, _ in held]
        assert "step" in state or not every_master, f"master {index} ({names}) has no step: {sorted(state)}"
        if "step" in state:
            assert _plain(state["step"]) == steps, f"master {index} ({names}): step {_plain(state['step'])}, " \
                f"{steps} steps taken"


def _optimizer_state_dicts(value, where=()):
    """The torch optimizer state dicts (a dict with "state" and "param_groups") in ``value``, a loaded checkpoint
    file, with where each lies."""
    if isinstance(value, dict):
        if isinstance(value.get("state"), dict) and isinstance(value.get("param_groups"), list):
            yield where, value
            return
        for key, item in value.items():
            yield from _optimizer_state_dicts(item, where + (key, ))
    elif isinstance(value, (list, tuple)):
        for index, item in enumerate(value):
            yield from _optimizer_state_dicts(item, where + (index, ))


def _check_state_dict_steps(state_dict, steps, every_master, where):
    assert state_dict["state"] or not every_master, f"{where}: no state"
    for key, state in state_dict["state"].items():
        assert "step" in state or not every_master, f"{where}: state {key} has no step: {sorted(state)}"
        if "step" in state:
            assert _plain(state["step"]) == steps, \
                f"{where}: state {key} has step {_plain(state['step'])}, {steps} steps taken"


def check_saved_steps(tag_dir, steps, every_master):
    """In a saved checkpoint (``tag_dir``: its tag's folder), every base-optimizer state's ``step`` is ``steps``: in
    each rank's optimizer-state file (ZeRO's ``*optim_states.pt``; without ZeRO the model-states file holds it); in a
    universal checkpoint's folder, in each parameter's ``step.pt`` and in the states its ``optimizer_state.pt`` holds
    (ZeRO-3's, which holds no ``step.pt``). With ``every_master`` each state has one, and so has each parameter of a
    universal checkpoint (in its ``step.pt`` or there)."""
    zero = os.path.join(tag_dir, "zero")
    if os.path.isdir(zero):
        shared = list(_optimizer_state_dicts(torch.load(os.path.join(zero, "optimizer_state.pt"), weights_only=False)))
        for where, state_dict in shared:
            _check_state_dict_steps(state_dict, steps, every_master, f"{zero}/optimizer_state.pt {where}")
        folders = [f for f in sorted(glob.glob(os.path.join(zero, "*"))) if os.path.isdir(f)]
        assert folders, f"{zero} holds no parameter"
        for folder in folders:
            if set(os.listdir(folder)) <= {"fp32.pt"}:  # a buffer's, or a parameter's without optimizer states
                continue
            path = os.path.join(folder, "step.pt")
            if os.path.exists(path):
                value = _plain(torch.load(path, weights_only=False))
                assert value == steps, f"{path}: step {value}, {steps} steps taken"
            else:
                assert not every_master or shared, f"{folder} holds no step.pt, and {zero}/optimizer_state.pt no states"
        return
    files = sorted(glob.glob(os.path.join(tag_dir, "*optim_states.pt")))
    if not files:
        files = sorted(glob.glob(os.path.join(tag_dir, "mp_rank_*_model_states.pt")))
    assert files, f"{tag_dir} holds no optimizer states"
    for path in files:
        found = list(_optimizer_state_dicts(torch.load(path, map_location="cpu", weights_only=False)))
        assert found, f"{path} holds no optimizer state dict"
        for where, state_dict in found:
            _check_state_dict_steps(state_dict, steps, every_master, f"{path} {where}")
