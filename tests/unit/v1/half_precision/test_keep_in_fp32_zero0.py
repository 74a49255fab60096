# Copyright (c) DeepSpeed Team.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""Parameters kept in fp32 by the engine's fp16/bf16 optimizers (no ZeRO, and BF16_Optimizer under ZeRO-1): their
gradients are reduced in fp32, torch optimizers without ZeRO (FP16_UnfusedOptimizer) take them as their own masters,
FusedAdam without ZeRO (FP16_Optimizer) keeps them in sub-groups of their own, the
fused steps that hold one dtype fall back ("auto") or refuse (an explicit list), and BF16_Optimizer and FP16_Optimizer
load optimizer states saved with another set of kept parameters parameter by parameter, exactly."""

import pytest
import torch
from torch._utils import _unflatten_dense_tensors

from unit.checkpoint._keep_in_fp32_whole_state import (Continuation, check_masters_own_their_states,
                                                       check_whole_state, whole_state)
from unit.common import DistributedTest
from unit.v1.half_precision.test_keep_in_fp32_modules import (SINK_VALUES, _batch, _collective_dtypes, _listed_names,
                                                              _sinks, _train)
from unit.v1.half_precision.test_keep_in_fp32_stages import (_check_dtypes, _check_kept_and_updated, _snapshot,
                                                             _stage_config, _stage_engine)


class TestKeptGradientsReducedInFp32(DistributedTest):
    world_size = 2

    @pytest.mark.parametrize("stage, dtype", [("zero0", "bf16"), ("zero0", "fp16"), ("zero1_bf16_optimizer", "bf16")])
    def test_all_reduce_dtypes(self, stage, dtype):
        config = _stage_config(stage, dtype=dtype)
        engine = _stage_engine(stage, config)
        kept_numel = sum(p.numel() for p in engine.module.parameters() if p.dtype == torch.float32)
        loss = engine(_batch(0, config))
        with _collective_dtypes("all_reduce") as calls:
            engine.backward(loss)
        # one reduction in the training dtype, one in fp32 for the kept parameters (not cast to the training dtype)
        assert torch.float32 in calls, calls
        assert calls.count(torch.float32) == 1 and kept_numel > 0, calls
        engine.step()


class TestFusedAdamKeepsNothing(DistributedTest):
    world_size = 1

    def test_fused_adam_without_zero_keeps_nothing_with_empty_list(self):
        config = _fused_config("fp16", keep=[])
        engine = _stage_engine("zero0", config)
        assert type(engine.optimizer).__name__ == "FP16_Optimizer"
        _check_dtypes(engine.module, set(), torch.float16)
        assert len(engine.optimizer.fp32_groups_flat) == len(engine.optimizer.param_groups) == 1


class TestUnfusedOptimizerWithoutZero(DistributedTest):
    """Torch's Adam at stage 0 (FP16_UnfusedOptimizer): a parameter kept in fp32 is its own master, so that its
    fp32 value is held once, and it trains in fp32."""
    world_size = 1

    @pytest.mark.parametrize("dtype", ["bf16", "fp16"])
    def test_kept_parameter_is_its_own_master(self, dtype):
        config = _stage_config("zero0", dtype=dtype)
        engine = _stage_engine("zero0", config)
        optimizer = engine.optimizer
        assert type(optimizer).__name__ == "FP16_UnfusedOptimizer"
        kept = _listed_names(engine.module)
        assert kept
        _check_dtypes(engine.module, kept, torch.bfloat16 if dtype == "bf16" else torch.float16)

        def check_masters():
            for params, masters in zip(optimizer.fp16_groups, optimizer.fp32_groups):
                for param, master in zip(params, masters):
                    name = engine.param_names[param]
                    assert (master is param) == (name in kept), name
                    assert master.dtype == torch.float32

        check_masters()
        # the step that makes the optimizer's states at init (with weight decay) leaves the kept values as they were
        assert torch.equal(_sinks(engine.module).data.cpu(), SINK_VALUES)
        _train(engine, config, steps=3)
        check_masters()
        _check_kept_and_updated(engine)


def _fused_config(dtype, keep="auto"):
    """Stage 0 with the default Adam: FusedAdam, which the engine wraps in FP16_Optimizer."""
    config = _stage_config("zero0", keep=keep, dtype=dtype)
    del config["optimizer"]["params"]["torch_adam"]
    return config


def _fused_masters(engine):
    """Each parameter's fp32 master in FP16_Optimizer's flat master weights, a copy on the CPU."""
    optimizer = engine.optimizer
    assert type(optimizer).__name__ == "FP16_Optimizer"
    masters = {}
    for group, flat in zip(optimizer.fp16_groups, optimizer.fp32_groups_flat):
        assert flat.dtype == torch.float32
        for param, master in zip(group, _unflatten_dense_tensors(flat, group)):
            masters[engine.param_names[param]] = master.detach().cpu().clone()
    return masters


def _check_fused_kept(engine, half_dtype):
    """The listed parameters in fp32, in sub-groups of their own, equal to their masters."""
    kept = _listed_names(engine.module)
    _check_dtypes(engine.module, kept, half_dtype)
    optimizer = engine.optimizer
    assert len(optimizer.param_groups) == 1 and len(optimizer.param_groups[0]["params"]) == 2
    assert optimizer.group_kept_in_fp32 == [False, True]
    masters = _fused_masters(engine)
    for name, param in engine.module.named_parameters():
        if name in kept:
            assert torch.equal(param.data.cpu(), masters[name]), name
    # one fp32 copy of the kept parameters: their flat master is the buffer they live in
    kept_flat = optimizer.fp32_groups_flat[1]
    assert kept_flat is optimizer.fp16_groups_flat[1]
    start, end = kept_flat.data_ptr(), kept_flat.data_ptr() + kept_flat.numel() * kept_flat.element_size()
    assert all(start <= p.data_ptr() < end for p in optimizer.fp16_groups[1])


def _fused_param_states(engine):
    """Each parameter's fp32 master, exp_avg and exp_avg_sq in FP16_Optimizer's flat masters, and the Adam steps of
    the flat masters."""
    optimizer = engine.optimizer
    result, steps = {}, set()
    for group, flat in zip(optimizer.fp16_groups, optimizer.fp32_groups_flat):
        state = optimizer.optimizer.state[flat]
        steps.add(state["step"])
        for key, tensor in (("master", flat), ("exp_avg", state["exp_avg"]), ("exp_avg_sq", state["exp_avg_sq"])):
            for param, piece in zip(group, _unflatten_dense_tensors(tensor.detach(), group)):
                result.setdefault(engine.param_names[param], {})[key] = piece.clone()
    return result, steps


# (keep_in_fp32_modules of the saving run, of the loading run)
OTHER_LAYOUTS = [([], "auto"), ("auto", []), (["sink_gate"], ["sinks"])]


def _fused_snapshot(engine):
    """Every parameter's value and master, the Adam state of each flat master and the loss scale."""
    optimizer = engine.optimizer
    values = {name: p.detach().clone() for name, p in engine.module.named_parameters()}
    states = []
    for flat in optimizer.fp32_groups_flat:
        states.append({
            key: value.clone()
            for key, value in optimizer.optimizer.state[flat].items() if torch.is_tensor(value)
        })
    return values, _fused_masters(engine), states, optimizer.loss_scale


def _check_fused_same(a, b):
    for x, y in zip(a[:2], b[:2]):
        assert x.keys() == y.keys()
        for name in x:
            assert x[name].dtype == y[name].dtype and torch.equal(x[name], y[name]), name
    assert len(a[2]) == len(b[2])
    for x, y in zip(a[2], b[2]):
        assert x.keys() == y.keys() and all(torch.equal(x[key], y[key]) for key in x)
    assert a[3] == b[3]


class TestFusedAdamWithoutZero(DistributedTest):
    """The default Adam at stage 0 (FusedAdam in FP16_Optimizer) keeps the listed parameters in fp32."""
    world_size = 1

    @pytest.mark.parametrize("dtype", ["bf16", pytest.param("fp16", marks=pytest.mark.nightly)])
    def test_exact_after_init_and_updates_below_bf16_resolution(self, dtype):
        config = _fused_config(dtype)
        engine = _stage_engine("zero0", config)
        half = torch.bfloat16 if dtype == "bf16" else torch.float16
        _check_fused_kept(engine, half)
        assert torch.equal(_sinks(engine.module).data.cpu(), SINK_VALUES)
        assert torch.equal(_fused_masters(engine)["attn.sinks"], SINK_VALUES)
        losses = _train(engine, config, steps=3)
        assert all(torch.isfinite(torch.tensor(losses)))
        assert engine.skipped_steps == 0
        _check_fused_kept(engine, half)
        _check_kept_and_updated(engine)

    def test_overflow_in_fp32_gradient_skips_the_step(self):
        config = _fused_config("fp16")
        engine = _stage_engine("zero0", config)
        _train(engine, config, steps=1)
        before = _fused_masters(engine)
        scale = engine.optimizer.loss_scale
        # the loss is finite; only the fp32 gradient of the sinks overflows
        loss = engine(_batch(1, config), grad_boost=1e30)
        assert torch.isfinite(loss)
        engine.backward(loss)
        assert _sinks(engine.module).grad.dtype == torch.float32
        engine.step()
        assert engine.skipped_steps == 1
        assert engine.optimizer.loss_scale == scale / 2
        after = _fused_masters(engine)
        for name in before:
            assert torch.equal(before[name], after[name]), f"{name} changed in a skipped step"
        _train(engine, config, steps=2)
        _check_fused_kept(engine, torch.float16)
        _check_kept_and_updated(engine)

    @pytest.mark.parametrize("dtype", ["bf16", pytest.param("fp16", marks=pytest.mark.nightly)])
    def test_global_norm_covers_both_dtypes(self, dtype):
        config = _fused_config(dtype)
        config["gradient_clipping"] = 1.0
        engine = _stage_engine("zero0", config)
        loss = engine(_batch(0, config), grad_boost=1e3)
        engine.backward(loss)
        scale = engine.optimizer.loss_scale or 1.0
        grads = {name: p.grad.float() / scale for name, p in engine.module.named_parameters()}
        assert engine.module.attn.sinks.grad.dtype == torch.float32
        expected = torch.stack([g.norm() for g in grads.values()]).norm()
        assert grads["attn.sinks"].norm() > 0.9 * expected
        engine.step()
        norm = float(engine.get_global_grad_norm())
        assert norm == pytest.approx(expected.item(), rel=1e-3)
        assert norm > 1.0  # so the step was clipped
        _check_fused_kept(engine, torch.bfloat16 if dtype == "bf16" else torch.float16)
        _check_kept_and_updated(engine)

    @pytest.mark.parametrize("dtype", ["bf16", pytest.param("fp16", marks=pytest.mark.nightly)])
    def test_round_trip_is_exact_and_training_continues(self, dtype, tmp_path):
        config = _fused_config(dtype)
        engine = _stage_engine("zero0", config)
        _train(engine, config, steps=2)
        engine.save_checkpoint(str(tmp_path))
        saved = _fused_snapshot(engine)
        saved_state = whole_state(engine)

        torch.manual_seed(7)
        loaded = _stage_engine("zero0", config)
        loaded.load_checkpoint(str(tmp_path))
        _check_fused_same(saved, _fused_snapshot(loaded))
        check_whole_state(whole_state(loaded), saved_state)
        check_masters_own_their_states(loaded)

        continuation = Continuation(loaded)
        assert _train(engine, config, steps=2) == _train(loaded, config, steps=2)
        continuation.check(steps=2)
        _check_fused_same(_fused_snapshot(engine), _fused_snapshot(loaded))
        _check_fused_kept(loaded, torch.bfloat16 if dtype == "bf16" else torch.float16)
        _check_kept_and_updated(loaded)

    @pytest.mark.parametrize("saved_keep, loaded_keep", [OTHER_LAYOUTS[0]] +
                             [pytest.param(*case, marks=pytest.mark.nightly) for case in OTHER_LAYOUTS[1:]])
    def test_other_layout_loads_exactly(self, saved_keep, loaded_keep, tmp_path):
        """Optimizer states saved with other parameters kept in fp32 load parameter by parameter: every master and
        Adam moment as saved, Adam's step carried, the parameters at their masters."""
        config = _fused_config("bf16", keep=saved_keep)
        engine = _stage_engine("zero0", config)
        _train(engine, config, steps=2)
        engine.save_checkpoint(str(tmp_path))
        saved, saved_steps = _fused_param_states(engine)
        saved_state = whole_state(engine)
        config = _fused_config("bf16", keep=loaded_keep)
        loaded = _stage_engine("zero0", config)
        loaded.load_checkpoint(str(tmp_path))
        check_whole_state(whole_state(loaded), saved_state)
        check_masters_own_their_states(loaded)
        restored, steps = _fused_param_states(loaded)
        # FusedAdam counts a param group's steps in its last flat master's state
        assert steps == {max(saved_steps)}, (steps, saved_steps)
        assert restored.keys() == saved.keys()
        for name, states in restored.items():
            for key, value in states.items():
                assert torch.equal(value, saved[name][key]), f"{name}: {key} differs"
        for name, param in loaded.module.named_parameters():
            assert torch.equal(param.data, restored[name]["master"].to(param.dtype)), f"{name} is not its master"
        if loaded_keep == "auto":
            _check_fused_kept(loaded, torch.bfloat16)
        continuation = Continuation(loaded)
        assert all(torch.isfinite(torch.tensor(_train(loaded, config, steps=1))))
        continuation.check(steps=1)


class TestBf16OptimizerCrossLayout(DistributedTest):
    world_size = 2

    @pytest.mark.parametrize("saved_keep, loaded_keep", [OTHER_LAYOUTS[2]] +
                             [pytest.param(*case, marks=pytest.mark.nightly) for case in OTHER_LAYOUTS[:2]])
    def test_other_layout_loads_exactly(self, saved_keep, loaded_keep, tmp_path):
        """Optimizer states saved with other parameters kept in fp32 load parameter by parameter, also where both
        lists keep one sub-group: every master and Adam moment as saved, Adam's step carried, the parameters at their
        masters."""
        config = _stage_config("zero1_bf16_optimizer", keep=saved_keep)
        engine = _stage_engine("zero1_bf16_optimizer", config)
        _train(engine, config, steps=2)
        engine.save_checkpoint(str(tmp_path))
        saved = _snapshot(engine)
        saved_state = whole_state(engine)
        config = _stage_config("zero1_bf16_optimizer", keep=loaded_keep)
        loaded = _stage_engine("zero1_bf16_optimizer", config)
        assert type(loaded.optimizer).__name__ == "BF16_Optimizer"
        loaded.load_checkpoint(str(tmp_path))
        check_whole_state(whole_state(loaded), saved_state)
        check_masters_own_their_states(loaded)
        restored = _snapshot(loaded)
        assert restored.keys() == saved.keys()
        for name, (value, *states) in restored.items():
            for what, x, y in zip(("master", "exp_avg", "exp_avg_sq"), states, saved[name][1:]):
                assert x.dtype == torch.float32 and torch.equal(x, y), f"{name}: {what} differs"
            assert torch.equal(value, states[0].to(value.dtype)), f"{name} is not its master"
        assert {int(state["step"]) for state in loaded.optimizer.optimizer.state.values()} == {2}
        continuation = Continuation(loaded)
        assert all(torch.isfinite(torch.tensor(_train(loaded, config, steps=1))))
        continuation.check(steps=1)
