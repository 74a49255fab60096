# Copyright (c) DeepSpeed Team.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""Parameters a model names for fp32 (``data_types.keep_in_fp32_modules``) stay in fp32 under ZeRO-3.

The values are chosen so that bf16 shows: the sinks start at 8.0 + k * 1e-4, which bf16 rounds to 8.0 (its
values are 0.0625 apart there), and Adam moves them by about lr = 1e-5 a step, far below that resolution. A sink
kept in bf16 therefore neither holds its initial values nor shows its updates, while a sink kept in fp32 holds both,
and every forward pass sees its fp32 master exactly.
"""

import contextlib
import itertools
import logging
import types

import pytest
import torch

import deepspeed
import deepspeed.comm as dist
from deepspeed.accelerator import get_accelerator
from deepspeed.runtime.engine import DeepSpeedEngine
from deepspeed.utils import (logger, safe_get_full_fp32_param, safe_get_full_grad, safe_get_full_optimizer_state,
                             safe_set_full_fp32_param)
from unit.checkpoint._keep_in_fp32_whole_state import (Continuation, check_masters_own_their_states,
                                                       check_whole_state, whole_state)
from unit.common import DistributedTest

HIDDEN = 9  # odd, so that every partition is padded
SINK_VALUES = 8.0 + 1e-4 * torch.arange(6, dtype=torch.float32)
LISTED = ["sink", "norm", "bias_buf"]


class Attention(torch.nn.Module):
    """One module with parameters of both dtypes: ``proj`` and ``bias`` train in bf16, ``sinks`` and
    ``sink_gate`` are listed; a fetch of this module's parameters holds both dtypes."""

    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Parameter(torch.randn(HIDDEN, HIDDEN) * 0.3)
        self.bias = torch.nn.Parameter(torch.zeros(HIDDEN))
        self.sinks = torch.nn.Parameter(torch.full((6, ), 8.0))
        self.sink_gate = torch.nn.Parameter(torch.linspace(0.5, 1.5, HIDDEN))

    def forward(self, h, grad_boost=0.0):
        sink = self.sink_gate * self.sinks.mean()
        if grad_boost:
            # adds nothing to the output, and grad_boost**2 times a gradient to the sinks (not a uniform one,
            # which the norm that follows would cancel)
            boosted = self.sinks * grad_boost
            sink = sink + (boosted - boosted.detach()).sum() * grad_boost * torch.linspace(
                -1, 1, HIDDEN, device=boosted.device)
        return h @ self.proj.t() + self.bias + 0.01 * sink.to(h.dtype)


class Norm(torch.nn.LayerNorm):
    """Computes in the dtype of its weight (fp32 when kept), as transformers' norms do."""

    def forward(self, h):
        return super().forward(h.to(self.weight.dtype))


class SinkNet(torch.nn.Module):
    _keep_in_fp32_modules_strict = LISTED

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(HIDDEN, HIDDEN)
        self.attn = Attention()
        self.norm = Norm(HIDDEN)
        self.out = torch.nn.Linear(HIDDEN, 3)
        self.register_buffer("bias_buf", torch.full((HIDDEN, ), 8.0) + 1e-3 * torch.arange(HIDDEN))

    def forward(self, x, grad_boost=0.0):
        h = self.attn(self.lin(x), grad_boost)
        h = self.norm(h.float() + 1e-3 * self.bias_buf).to(h.dtype)
        return self.out(h).float().pow(2).mean()


class NormToFp32Net(SinkNet):
    """Moves its norm to fp32 in ``__init__``, as DeepSeek-V4 does: under zero.Init that changes the parameters'
    empty ``data``, not their partitions."""

    def __init__(self):
        super().__init__()
        self.norm.to(torch.float32)


class Expert(torch.nn.Module):

    def __init__(self, hidden):
        super().__init__()
        self.lin = torch.nn.Linear(hidden, hidden)
        self.sinks = torch.nn.Parameter(torch.full((hidden, ), 8.0))

    def forward(self, h):
        return self.lin(h) + self.sinks.to(h.dtype)


class MoENet(torch.nn.Module):
    """DeepSpeed's MoE layer, whose experts hold listed sinks."""

    _keep_in_fp32_modules_strict = ["sinks"]

    def __init__(self, hidden=8):
        super().__init__()
        from deepspeed.moe.layer import MoE
        self.moe = MoE(hidden_size=hidden, expert=Expert(hidden), num_experts=2, ep_size=1, k=1)

    def forward(self, x):
        return self.moe(x)[0].float().pow(2).mean()


class MultimodalNet(torch.nn.Module):
    """Lists nothing itself; the language model's list applies to its own parameters only."""

    def __init__(self):
        super().__init__()
        self.language_model = SinkNet()
        self.vision = Attention()  # has a `sinks` parameter too, not listed by anyone

    def forward(self, x, grad_boost=0.0):
        return self.language_model(self.vision(x).to(x.dtype), grad_boost)


def _config(keep="auto", dtype="bf16", **zero):
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": zero.pop("ga", 1),
        "steps_per_print": 1000,
        "optimizer": {
            "type": "Adam",
            "params": {
                "lr": 1e-5,
                "torch_adam": True
            }
        },
        "zero_optimization": {
            "stage": 3,
            "stage3_param_persistence_threshold": 0,
            **zero
        },
    }
    if dtype == "fp16":
        config["fp16"] = {"enabled": True, "initial_scale_power": 8, "loss_scale_window": 1000, "hysteresis": 1}
    elif dtype == "bf16":
        config["bf16"] = {"enabled": True}
    if keep != "auto":
        config["data_types"] = {"keep_in_fp32_modules": keep}
    return config


def _allow_fp16_on_cpu():
    # DeepSpeed's CPU accelerator reports fp16 as unsupported without oneDNN fp16 kernels; the tiny fp16 models here
    # run fine in plain torch.
    accelerator = get_accelerator()
    if accelerator.device_name() == "cpu" and not accelerator.is_fp16_supported():
        accelerator.is_fp16_supported = lambda: True


def _sinks(model):
    return model.language_model.attn.sinks if isinstance(model, MultimodalNet) else model.attn.sinks


def _build(config, model_cls=SinkNet, zero_init=True):
    """The model, with the sinks set to SINK_VALUES after init (by rank 0, under zero.Init)."""
    torch.manual_seed(42)
    if zero_init:
        with deepspeed.zero.Init(config_dict_or_path=config):
            model = model_cls()
    else:
        model = model_cls()
    sinks = _sinks(model)
    with deepspeed.zero.GatheredParameters([sinks], modifier_rank=0):
        if not zero_init or dist.get_rank() == 0:
            sinks.data.copy_(SINK_VALUES)
    return model


def _engine(config, model_cls=SinkNet, zero_init=True):
    if "fp16" in config:
        _allow_fp16_on_cpu()
    model = _build(config, model_cls, zero_init)
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    return engine


def _half(config):
    if "fp16" in config:
        return torch.float16
    return torch.bfloat16 if "bf16" in config else torch.float32


def _batch(step, config):
    """This rank's batch of ``step``, on the accelerator's device (made on the CPU, so that it is the same there)."""
    gen = torch.Generator().manual_seed(1000 * step + dist.get_rank())
    return torch.randn(2, HIDDEN, generator=gen).to(get_accelerator().current_device_name(), _half(config))


def _train(engine, config, steps, **forward_kwargs):
    losses = []
    for step in range(steps * engine.gradient_accumulation_steps()):
        loss = engine(_batch(step, config), **forward_kwargs)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def _gathered(param):
    """The full value of ``param`` in its dtype, a copy on the CPU (a collective under ZeRO-3)."""
    with deepspeed.zero.GatheredParameters([param]):
        return param.data.detach().cpu().clone()


def _listed_names(model):
    return {name for name, _ in model.named_parameters() if "sink" in name or "norm" in name}


def _check_dtypes(model, kept, half_dtype):
    """Partitions and parameters: the names in ``kept`` in fp32, every other one in ``half_dtype``."""
    for name, param in model.named_parameters():
        want = torch.float32 if name in kept else half_dtype
        assert param.dtype == want, f"{name} is {param.dtype}, expected {want}"
        assert param.ds_tensor.dtype == want, f"the partition of {name} is {param.ds_tensor.dtype}, expected {want}"
    assert model.get_buffer("bias_buf" if isinstance(model, SinkNet) else "language_model.bias_buf").dtype == \
        torch.float32


@contextlib.contextmanager
def _collective_dtypes(name):
    """The dtypes of the tensors that ``deepspeed.comm.<name>`` is called with while the block runs (the first
    argument: all_reduce(tensor, ...), allgather_fn(output_tensor, ...))."""
    calls = []
    original = getattr(dist, name)

    def spy(tensor, *args, **kwargs):
        calls.append(tensor.dtype)
        return original(tensor, *args, **kwargs)

    setattr(dist, name, spy)
    try:
        yield calls
    finally:
        setattr(dist, name, original)


def _all_reduces_in_a_step(engine, config):
    """How many all-reduces ``engine.step()`` makes, after a first step (which may set things up) and a backward."""
    _train(engine, config, steps=1)
    loss = engine(_batch(1, config))
    engine.backward(loss)
    with _collective_dtypes("all_reduce") as calls:
        engine.step()
    return len(calls)


def _check_kept_and_updated(engine):
    """Every kept parameter moved below bf16's resolution, and the forward pass sees its master exactly."""
    for name, param in engine.module.named_parameters():
        if param.dtype != torch.float32:
            continue
        master = safe_get_full_fp32_param(param).cpu()
        gathered = _gathered(param)
        assert gathered.dtype == torch.float32, name
        assert torch.equal(gathered, master), f"{name}: the gathered value differs from its fp32 master"
    sinks = _sinks(engine.module)
    value = _gathered(sinks)
    assert not torch.equal(value, SINK_VALUES), "the sinks did not move"
    assert (value - SINK_VALUES).abs().max() < 1e-3, "the sinks moved by more than a few Adam steps can"
    assert not torch.equal(value, value.bfloat16().float()), "the sinks are on the bf16 grid"


class TestZeroInitKeepsValues(DistributedTest):
    world_size = 2

    @pytest.mark.parametrize("keep", ["auto", ["sink", "norm", "bias_buf"]])
    @pytest.mark.parametrize("model_cls", [SinkNet, MultimodalNet])
    def test_listed_params_hold_exact_fp32(self, keep, model_cls):
        config = _config(keep=keep)
        engine = _engine(config, model_cls)
        model = engine.module
        kept = _listed_names(model)
        if model_cls is MultimodalNet:
            kept = {name for name in kept if name.startswith("language_model.")}
            if keep != "auto":  # an explicit list applies to every name it matches
                kept |= {"vision.sinks", "vision.sink_gate"}
        assert len(kept) == (4 if model_cls is SinkNet or keep == "auto" else 6)
        _check_dtypes(model, kept, torch.bfloat16)
        assert torch.equal(_gathered(_sinks(model)), SINK_VALUES)

    @pytest.mark.parametrize("model_cls", [SinkNet, MultimodalNet])
    def test_empty_list_keeps_nothing(self, model_cls):
        engine = _engine(_config(keep=[]), model_cls)
        for name, param in engine.module.named_parameters():
            assert param.dtype == param.ds_tensor.dtype == torch.bfloat16, name
        sinks = _gathered(_sinks(engine.module))
        assert torch.equal(sinks, SINK_VALUES.bfloat16())
        assert not torch.equal(sinks.float(), SINK_VALUES)


class TestModuleMovedToFp32InInit(DistributedTest):
    world_size = 2

    @pytest.mark.parametrize("keep", ["auto", []])
    def test_partitions_decide(self, keep):
        config = _config(keep=keep)
        engine = _engine(config, NormToFp32Net)
        kept = _listed_names(engine.module) if keep == "auto" else set()
        for name, param in engine.module.named_parameters():
            assert param.ds_tensor.dtype == (torch.float32 if name in kept else torch.bfloat16), name
        losses = _train(engine, config, steps=2)
        assert all(torch.isfinite(torch.tensor(losses)))
        if keep == "auto":
            _check_kept_and_updated(engine)


def _update_cases():
    """Every combination of zero.Init x contiguous gradients x optimizer offload x gradient accumulation; make test
    runs two opposite corners, the nightly runs all."""
    fast = [(True, True, False, 1), (False, False, True, 2)]
    for case in itertools.product([True, False], [True, False], [False, True], [1, 2]):
        yield case if case in fast else pytest.param(*case, marks=pytest.mark.nightly)


class TestSubResolutionUpdates(DistributedTest):
    world_size = 2

    @pytest.mark.parametrize("zero_init, contiguous_gradients, offload, ga", list(_update_cases()))
    def test_update_survives(self, zero_init, contiguous_gradients, offload, ga):
        zero = {"contiguous_gradients": contiguous_gradients, "ga": ga}
        if offload:
            zero["offload_optimizer"] = {"device": "cpu"}
        config = _config(**zero)
        engine = _engine(config, zero_init=zero_init)
        _check_dtypes(engine.module, _listed_names(engine.module), torch.bfloat16)
        losses = _train(engine, config, steps=3)
        assert all(torch.isfinite(torch.tensor(losses)))
        _check_kept_and_updated(engine)


class TestConfigVariants(DistributedTest):
    world_size = 2

    @pytest.mark.parametrize("zero", [
        {
            "reduce_scatter": False
        },
        {
            "overlap_comm": True
        },
        {
            "stage3_param_persistence_threshold": 10
        },
        {
            "stage3_use_all_reduce_for_fetch_params": True
        },
        {
            "stage3_prefetch_bucket_size": 20
        },
        {
            "sub_group_size": 16,
            "reduce_bucket_size": 16
        },
    ],
                             ids=["no_reduce_scatter", "overlap_comm", "persistence", "all_reduce_fetch", "prefetch",
                                  "small_buckets"])
    def test_variant(self, zero):
        config = _config(**zero)
        engine = _engine(config)
        losses = _train(engine, config, steps=3)
        assert all(torch.isfinite(torch.tensor(losses)))
        _check_kept_and_updated(engine)


class TestFetchCollectives(DistributedTest):
    """A parameter fetch is one all-gather (of bytes when it holds both dtypes) or one all-reduce per dtype,
    never one collective per parameter."""
    world_size = 2

    @pytest.mark.parametrize("all_reduce", [False, True])
    def test_collectives_per_fetch(self, all_reduce):
        config = _config(stage3_use_all_reduce_for_fetch_params=all_reduce, stage3_prefetch_bucket_size=0)
        engine = _engine(config)
        _train(engine, config, steps=1)  # the first step traces the modules

        with _collective_dtypes("all_reduce" if all_reduce else "allgather_fn") as calls, torch.no_grad():
            engine(_batch(7, config))
        # lin: 2 bf16; attn: 2 bf16 + 2 fp32; norm: 2 fp32; out: 2 bf16
        counts = {dtype: calls.count(dtype) for dtype in set(calls)}
        if all_reduce:
            # one all-reduce per module and dtype
            assert counts == {torch.bfloat16: 3, torch.float32: 2}, counts
        else:
            # one all-gather per module: attn's partitions of both dtypes travel as bytes
            assert counts == {torch.bfloat16: 2, torch.float32: 1, torch.uint8: 1}, counts


class TestStepCollectives(DistributedTest):
    """ZeRO-3 all-reduces one gradient norm per sub-group, but sums a kept sub-group's squares in the all-reduce of
    the sub-group before it in its param group: keeping parameters adds no all-reduce to a step (its kept gradients
    are reduce-scattered)."""
    world_size = 2

    def test_step_adds_no_all_reduce(self):
        counts = {}
        for keep in ("auto", []):
            config = _config(keep=keep)
            config["gradient_clipping"] = 1.0
            engine = _engine(config)
            assert engine.module.attn.sinks.dtype == (torch.float32 if keep == "auto" else torch.bfloat16)
            counts[str(keep)] = _all_reduces_in_a_step(engine, config)
        assert counts["auto"] == counts["[]"] and counts["[]"] > 0, counts


class OddSections(torch.nn.Module):
    """A bf16 parameter whose partitions hold an odd number of elements next to a listed fp32 one, so that the
    bytes a rank contributes to a fetch of both must be padded to keep the next rank's fp32 section aligned."""
    _keep_in_fp32_modules_strict = ["kept"]

    def __init__(self):
        super().__init__()
        self.low = torch.nn.Parameter(torch.arange(7, dtype=torch.float32) - 3.0)
        self.kept = torch.nn.Parameter(torch.zeros(5))


class TestFetchOfBothDtypes(DistributedTest):
    """One all-gather fetches partitions of both dtypes exactly, whatever their sizes."""
    world_size = [2, 3]

    def test_gathered_values_are_exact(self):
        config = _config()
        with deepspeed.zero.Init(config_dict_or_path=config):
            model = OddSections()
        assert model.low.ds_tensor.dtype == torch.bfloat16 and model.kept.ds_tensor.dtype == torch.float32
        params = [model.low, model.kept]
        kept_values = 8.0 + 1e-4 * torch.arange(5, dtype=torch.float32)  # zero.Init made it bf16 before keeping it
        with deepspeed.zero.GatheredParameters([model.kept], modifier_rank=0):
            if dist.get_rank() == 0:
                model.kept.data.copy_(kept_values)

        with _collective_dtypes("allgather_fn") as calls:
            model.low.all_gather_coalesced(params).wait()  # how ZeRO-3 fetches a module's parameters
        low, kept = (p.data.detach().clone() for p in params)
        model.low.partition(params)
        assert calls == [torch.uint8], calls
        assert low.dtype == torch.bfloat16 and torch.equal(low, (torch.arange(7.0) - 3.0).bfloat16())
        assert kept.dtype == torch.float32 and torch.equal(kept, kept_values)


class InitSinks(torch.nn.Module):
    """A listed parameter that the module's own __init__ sets off the bf16 grid."""
    _keep_in_fp32_modules_strict = ["sinks"]

    def __init__(self):
        super().__init__()
        self.sinks = torch.nn.Parameter(SINK_VALUES.clone())
        self.proj = torch.nn.Parameter(torch.ones(4))

    def forward(self, x):
        return (x * self.proj).float().sum() + self.sinks.sum()


class TestZeroInitRoundsInitValues(DistributedTest):
    """zero.Init makes each partition in the training dtype while a module's __init__ runs, and keeps the listed
    ones in fp32 only when the model's __init__ returns: the values __init__ set are rounded (a documented limit).
    Values loaded afterwards are exact (TestFetchOfBothDtypes). The engine warns once, on rank 0, when training
    starts from the rounded values, and not when values were loaded into them."""
    world_size = 2

    @pytest.mark.parametrize("load", [False, True])
    def test_warned_only_when_training_starts_from_rounded_values(self, load):
        records = _capture_warnings()
        config = _config()
        with deepspeed.zero.Init(config_dict_or_path=config):
            model = InitSinks()
        assert model.sinks.ds_tensor.dtype == torch.float32
        assert torch.equal(_gathered(model.sinks), SINK_VALUES.bfloat16().float())
        if load:
            with deepspeed.zero.GatheredParameters([model.sinks], modifier_rank=0):
                if dist.get_rank() == 0:
                    model.sinks.data.copy_(SINK_VALUES)
        engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
        assert [r.getMessage() for r in records if "rounded" in r.getMessage()] == []
        for _ in range(2):
            engine(torch.ones(2, 4, dtype=torch.bfloat16, device=engine.device))
        messages = [r.getMessage() for r in records if "rounded" in r.getMessage()]
        if dist.get_rank() == 0 and not load:
            assert len(messages) == 1 and "(sinks)" in messages[0] and "torch.bfloat16" in messages[0], messages
        else:
            assert messages == []
        assert torch.equal(_gathered(model.sinks), SINK_VALUES if load else SINK_VALUES.bfloat16().float())
        assert not any(hasattr(param, "ds_rounded_init_partition") for param in model.parameters())


class TestCheckpoint(DistributedTest):
    world_size = 2

    def test_round_trip_is_exact_and_training_continues(self, tmp_path):
        config = _config()
        engine = _engine(config)
        _train(engine, config, steps=2)
        engine.save_checkpoint(str(tmp_path))
        names = [name for name, _ in engine.module.named_parameters()]

        def snapshot(engine):
            params = dict(engine.module.named_parameters())
            return {
                name: (_gathered(params[name]), safe_get_full_fp32_param(params[name]),
                       safe_get_full_optimizer_state(params[name], "exp_avg"),
                       safe_get_full_optimizer_state(params[name], "exp_avg_sq"))
                for name in names
            }

        saved = snapshot(engine)
        saved_state = whole_state(engine)
        torch.manual_seed(7)
        loaded = _engine(config)
        loaded.load_checkpoint(str(tmp_path))
        check_whole_state(whole_state(loaded), saved_state)
        check_masters_own_their_states(loaded)
        restored = snapshot(loaded)
        for name in names:
            for what, a, b in zip(("param", "master", "exp_avg", "exp_avg_sq"), saved[name], restored[name]):
                assert a.dtype == b.dtype and torch.equal(a, b), f"{name}: {what} differs after the load"
        _check_dtypes(loaded.module, _listed_names(loaded.module), torch.bfloat16)

        # both continue the same way, as the optimizer makes it of the loaded state
        continuation = Continuation(loaded)
        assert _train(engine, config, steps=2) == _train(loaded, config, steps=2)
        continuation.check(steps=2)
        check_whole_state(whole_state(loaded), whole_state(engine), "two more steps")
        after, after_loaded = snapshot(engine), snapshot(loaded)
        for name in names:
            assert all(torch.equal(a, b) for a, b in zip(after[name], after_loaded[name])), name
        _check_kept_and_updated(loaded)

        # zero_to_fp32 returns the exact values of the kept parameters
        loaded.save_checkpoint(str(tmp_path / "again"))
        if dist.get_rank() == 0:
            from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
            state_dict = get_fp32_state_dict_from_zero_checkpoint(str(tmp_path / "again"))
            for name in names:
                assert torch.equal(state_dict[name], after_loaded[name][1]), name
        dist.barrier()

    # a checkpoint saved with other parameters kept in fp32: the conformance matrix's ZeRO-3 cells
    # (test_checkpoint_conformance.py: none_to_list, list_to_none, list_to_other, stock_to_list)

    def test_other_model_is_refused_by_name(self, tmp_path):
        config = _config()
        engine = _engine(config)
        _train(engine, config, steps=1)
        engine.save_checkpoint(str(tmp_path))
        torch.manual_seed(7)
        loaded = _engine(config, SinkNetWithExtra)
        with pytest.raises(RuntimeError, match=r"holds no fp32 master of \['extra'\]: it was saved from another model"):
            loaded.load_checkpoint(str(tmp_path), load_module_strict=False)


class SinkNetWithExtra(SinkNet):

    def __init__(self):
        super().__init__()
        self.extra = torch.nn.Parameter(torch.ones(HIDDEN))

    def forward(self, x, grad_boost=0.0):
        return super().forward(x * self.extra.to(x.dtype), grad_boost)


class TestSafeAccessors(DistributedTest):
    world_size = 2

    def test_set_full_fp32_param(self):
        # the sinks have 6 elements, 3 a rank: safe_set_full_fp32_param does not take padded partitions in 0.19.8
        config = _config()
        engine = _engine(config)
        _train(engine, config, steps=1)
        sinks = engine.module.attn.sinks
        new = SINK_VALUES + 3e-5
        safe_set_full_fp32_param(sinks, new)
        assert torch.equal(safe_get_full_fp32_param(sinks), new)
        assert torch.equal(_gathered(sinks), new)

    def test_global_norm_covers_both_dtypes(self):
        # the sinks' gradient dominates the global norm, so leaving the fp32 gradients out would show
        config = _config()
        config["gradient_clipping"] = 1.0
        engine = _engine(config)
        loss = engine(_batch(0, config), grad_boost=1e3)
        engine.backward(loss)
        grads = {name: safe_get_full_grad(p) for name, p in engine.module.named_parameters()}
        assert grads["attn.sinks"].dtype == torch.float32
        expected = torch.stack([g.float().norm() for g in grads.values()]).norm()
        assert grads["attn.sinks"].norm() > 0.9 * expected
        engine.step()
        norm = float(engine.get_global_grad_norm())
        assert norm == pytest.approx(expected.item(), rel=1e-4)
        assert norm > 1.0  # so the step was clipped
        _check_kept_and_updated(engine)


class TestFp16(DistributedTest):
    world_size = 2

    def test_trains_with_loss_scaling(self):
        config = _config(dtype="fp16")
        engine = _engine(config)
        kept = _listed_names(engine.module)
        _check_dtypes(engine.module, kept, torch.float16)
        losses = _train(engine, config, steps=3)
        assert all(torch.isfinite(torch.tensor(losses)))
        _check_kept_and_updated(engine)

    def test_overflow_in_fp32_gradient_skips_the_step(self):
        config = _config(dtype="fp16")
        engine = _engine(config)
        _train(engine, config, steps=1)
        before = {name: safe_get_full_fp32_param(p) for name, p in engine.module.named_parameters()}
        scale = engine.optimizer.loss_scale
        # the loss is finite; only the fp32 gradient of the sinks overflows (about 1e60)
        loss = engine(_batch(1, config), grad_boost=1e30)
        assert torch.isfinite(loss)
        engine.backward(loss)
        engine.step()
        assert engine.skipped_steps == 1
        assert engine.optimizer.loss_scale == scale / 2
        for name, param in engine.module.named_parameters():
            assert torch.equal(safe_get_full_fp32_param(param), before[name]), f"{name} changed in a skipped step"


def _capture_warnings(level=logging.WARNING):
    records = []
    handler = logging.Handler(level=level)
    handler.emit = records.append
    logger.addHandler(handler)
    return records


@contextlib.contextmanager
def _info_logged():
    """DeepSpeed's logger says warnings only by default; deepspeed.initialize says at info level what it keeps."""
    level = logger.level
    logger.setLevel(logging.INFO)
    try:
        yield _capture_warnings(logging.INFO)
    finally:
        logger.setLevel(level)


class Router(torch.nn.Module):
    """gpt-oss's router: listed for fp16 only (``_keep_in_fp32_modules``), and its module does not cast its input
    to the dtype of its weight."""
    _keep_in_fp32_modules = ["router"]

    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(HIDDEN, HIDDEN)
        self.router = torch.nn.Linear(HIDDEN, 4)

    def forward(self, x):
        return self.router(self.proj(x)).float().pow(2).mean()


class TestFirstHour(DistributedTest):
    """What a new user learns at deepspeed.initialize and in the first forward."""
    world_size = 1

    def test_initialize_says_what_is_kept(self):
        with _info_logged() as records:
            engine = _engine(_config())
        messages = [r.getMessage() for r in records if "are kept in fp32" in r.getMessage()]
        kept = [name for name, param in engine.module.named_parameters() if param.ds_tensor.dtype == torch.float32]
        assert len(messages) == 1, messages
        assert f"{len(kept)} parameters and 1 buffers are kept in fp32" in messages[0], messages
        assert "torch.bfloat16 (lin.weight" not in messages[0] and "attn.sinks" in messages[0], messages

    def test_auto_says_what_it_leaves_out_under_bf16(self):
        with _info_logged() as records:
            with deepspeed.zero.Init(config_dict_or_path=_config()):
                model = Router()
            engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=_config())
        assert engine.module.router.weight.ds_tensor.dtype == torch.bfloat16
        messages = [(r.levelno, r.getMessage()) for r in records if "_keep_in_fp32_modules)" in r.getMessage()]
        assert len(messages) == 1 and messages[0][0] == logging.INFO, messages
        assert "'router'" in messages[0][1] and "under fp16 only" in messages[0][1], messages
        assert not any("are kept in fp32" in r.getMessage() for r in records)

    def test_a_kept_linear_weight_with_an_input_it_does_not_cast_is_named(self):
        config = _config(keep=["router"])
        with deepspeed.zero.Init(config_dict_or_path=config):
            model = Router()
        engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
        assert engine.module.router.weight.ds_tensor.dtype == torch.float32
        with pytest.raises(RuntimeError, match=r"^router\.weight is kept in fp32 \(data_types\.keep_in_fp32_modules\)"):
            engine(torch.ones(2, HIDDEN, dtype=torch.bfloat16, device=engine.device))


class TestTrainingDtype(DistributedTest):
    """The training dtype is the engine's, not that of the trainable parameters: with every parameter but the
    listed sinks frozen (a sink or norm tuned alone), fp16 keeps its dynamic loss scaler and overflow check."""
    world_size = 2

    def test_fp16_with_only_kept_params_trainable(self):
        _allow_fp16_on_cpu()
        config = _config(dtype="fp16")
        model = _build(config)
        for name, param in model.named_parameters():
            param.requires_grad = name == "attn.sinks"
        engine, _, _, _ = deepspeed.initialize(model=model,
                                               model_parameters=[model.attn.sinks],
                                               config=config)
        assert engine.module.attn.sinks.ds_tensor.dtype == torch.float32
        assert engine.optimizer.dtype == torch.float16
        assert engine.optimizer.dynamic_loss_scale and engine.optimizer.loss_scale == 2**8
        _train(engine, config, steps=1)
        before = safe_get_full_fp32_param(engine.module.attn.sinks)
        loss = engine(_batch(1, config), grad_boost=1e30)  # the sinks' fp32 gradient overflows
        engine.backward(loss)
        engine.step()
        assert engine.skipped_steps == 1 and engine.optimizer.loss_scale == 2**7
        assert torch.equal(safe_get_full_fp32_param(engine.module.attn.sinks), before)


class TestNothingKeptIsPristine(DistributedTest):
    """Runs that keep nothing get pristine's optimizer: no fp32 sub-groups or buckets, and in fp32 and torch
    autocast runs a master copy of its own (the partition is not its own master, as pristine 0.19.8 has it)."""
    world_size = 2

    @pytest.mark.parametrize("precision", ["bf16", "fp32", "autocast"])
    def test_optimizer_layout(self, precision):
        config = _config(keep=[], dtype=precision)
        if precision == "autocast":
            config["torch_autocast"] = {"enabled": True, "dtype": "bfloat16"}
        engine = _engine(config, zero_init=False)
        optimizer = engine.optimizer
        assert not optimizer.keeps_params_in_fp32 and optimizer.kept_grad_partitions_flat_buffer is None
        assert optimizer.kept_param_buffer is None
        if precision != "autocast":  # whose buckets are one per communication dtype autocast gives
            assert set(optimizer.ipg_buckets) == {torch.bfloat16 if precision == "bf16" else torch.float32}
        for lp, hp in zip(optimizer.fp16_partitioned_groups_flat, optimizer.fp32_partitioned_groups_flat):
            assert lp.data_ptr() != hp.data_ptr()

    def test_destroy_unpins_the_fp32_gradient_buffer(self):
        engine = _engine(_config())
        buffer = engine.optimizer.kept_grad_partitions_flat_buffer
        assert buffer is not None
        accelerator = get_accelerator()
        unpinned, original = [], accelerator.unpin_memory
        accelerator.unpin_memory = lambda tensor: unpinned.append(tensor) or original(tensor)
        try:
            engine.optimizer.destroy()
        finally:
            accelerator.unpin_memory = original
        assert any(t is buffer for t in unpinned)


def test_casting_a_zero_init_model_that_keeps_nothing_needs_only_the_module():
    """With nothing kept, the engine's cast of a zero.Init model reads nothing but its module, as in 0.19.8 (upstream's
    own tests call it with a stand-in engine): it leaves the parameters to zero.Init."""
    module = torch.nn.Linear(3, 3)
    DeepSpeedEngine._cast_module_mixed_precision(types.SimpleNamespace(module=module), torch.bfloat16, None, True)
    assert all(p.dtype == torch.float32 for p in module.parameters())


class Block(torch.nn.Module):

    def __init__(self):
        super().__init__()
        self.norm1 = Norm(HIDDEN)
        self.lin = torch.nn.Linear(HIDDEN, HIDDEN)

    def forward(self, h):
        return self.lin(self.norm1(h).to(h.dtype))


class NestedNorms(torch.nn.Module):
    """A norm at the top (``norm``) and one inside a block (``blocks.0.norm1``)."""

    def __init__(self):
        super().__init__()
        self.blocks = torch.nn.ModuleList([Block()])
        self.norm = Norm(HIDDEN)

    def forward(self, x):
        return self.norm(self.blocks[0](x)).float().pow(2).mean()


def _kept_names(model):
    return {name for name, param in model.named_parameters() if param.ds_tensor.dtype == torch.float32}


class TestOneRuleForNames(DistributedTest):
    """A pattern matches full names, as in named_parameters(), with zero.Init and without."""
    world_size = 2

    @pytest.mark.parametrize("zero_init", [True, False])
    def test_anchored_pattern_matches_full_names(self, zero_init):
        config = _config(keep=["^norm"])
        if zero_init:
            with deepspeed.zero.Init(config_dict_or_path=config):
                model = NestedNorms()
        else:
            model = NestedNorms()
        engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
        assert _kept_names(engine.module) == {"norm.weight", "norm.bias"}

    def test_keeping_what_zero_init_rounded_is_refused(self):
        with deepspeed.zero.Init(config_dict_or_path=_config(keep=["sink"])):
            model = SinkNet()
        with pytest.raises(ValueError, match=r"keeps \d parameters in fp32 that zero.Init made in torch.bfloat16"):
            deepspeed.initialize(model=model, model_parameters=model.parameters(), config=_config(keep=["norm"]))

    def test_auto_keeps_what_zero_init_rounded_with_a_warning(self):
        # the default never stops a run that 0.19.8 trains: the norms train in fp32 from their rounded values
        with deepspeed.zero.Init(config_dict_or_path=_config(keep=[])):
            model = SinkNet()
        records = _capture_warnings()
        engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=_config())
        messages = [r.getMessage() for r in records if "rounded already" in r.getMessage()]
        assert len(messages) == 1 and "train in fp32 from their rounded values" in messages[0], messages
        assert _kept_names(engine.module) == _listed_names(engine.module)
        _train(engine, _config(), steps=1)

    def test_what_zero_init_kept_and_the_run_does_not_trains_as_before(self):
        # zero.Init given "auto" (or no config) keeps the model's own lists; a run that keeps nothing trains as
        # pristine does
        records = _capture_warnings()
        model = _build(_config())
        config = _config(keep=[])
        engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
        messages = [r.getMessage() for r in records if "zero.Init kept 4 parameters" in r.getMessage()]
        assert len(messages) == 1, messages
        for name, param in engine.module.named_parameters():
            assert param.dtype == param.ds_tensor.dtype == torch.bfloat16, name
        assert not engine.optimizer.keeps_params_in_fp32
        assert torch.equal(_gathered(engine.module.attn.sinks), SINK_VALUES.bfloat16())
        _train(engine, config, steps=1)


class TestBadInput(DistributedTest):
    world_size = 1

    def test_invalid_pattern_names_option_and_pattern(self):
        from deepspeed.runtime.config import DeepSpeedConfigError
        with pytest.raises(DeepSpeedConfigError, match=r"keep_in_fp32_modules: 'norm\[' is not a valid"):
            _engine(_config(keep=["norm["]), zero_init=False)

    @pytest.mark.parametrize("keep", [[""], ["sink", ""]])
    def test_empty_pattern_is_refused(self, keep):
        # it would match every name, and keep the whole model in fp32
        from deepspeed.runtime.config import DeepSpeedConfigError
        with pytest.raises(DeepSpeedConfigError, match="keep_in_fp32_modules: an empty name pattern matches every"):
            _engine(_config(keep=keep), zero_init=False)

    def test_whether_parameters_are_kept_is_decided_at_initialize(self):
        engine = _engine(_config(keep=["sink"], stage=0), zero_init=False)
        assert vars(engine).get("keeps_params_in_fp32") is True

    def test_pattern_matching_nothing_warns_once(self):
        records = _capture_warnings()
        engine = _engine(_config(keep=["sinkk", "norm"]))
        messages = [r.getMessage() for r in records if "sinkk" in r.getMessage()]
        assert len(messages) == 1 and "keep_in_fp32_modules" in messages[0] and "'norm'" not in messages[0], messages
        assert _kept_names(engine.module) == {"norm.weight", "norm.bias"}
