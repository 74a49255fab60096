# Copyright (c) DeepSpeed Team.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""Parameters a model names for fp32 stay in fp32 in every ZeRO stage, not only under ZeRO-3.

The cases of test_keep_in_fp32_modules.py, for each optimizer that holds the listed parameters next to the bf16/fp16
ones: no ZeRO (the engine's fp16/bf16 optimizer), ZeRO-1 and ZeRO-2, ZeRO-1 with bf16 and fp32 gradient
accumulation (the BF16 optimizer), and ZeRO-3 with parameter offload to the CPU. The sinks start at 8.0 + k * 1e-4,
which bf16 rounds to 8.0, and Adam moves them by about 1e-5 a step: kept in fp32 they hold both.
"""

import collections
import contextlib
import copy
import itertools

import pytest
import torch

import deepspeed
import deepspeed.comm as dist
from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_grad, safe_get_full_optimizer_state
from unit import tiny_hf_models
from unit.checkpoint._keep_in_fp32_whole_state import (Continuation, base_optimizer, check_masters_own_their_states,
                                                       check_whole_state, whole_state)
from unit.common import DistributedTest
from unit.v1.half_precision.test_keep_in_fp32_modules import (HIDDEN, SINK_VALUES, Norm, _batch, _config, _engine,
                                                              _gathered, _listed_names, _sinks, _train)

# The zero_optimization section of each stage; "zero1_bf16_optimizer" is ZeRO-1 with bf16 and fp32 gradient
# accumulation, which the engine gives to its BF16 optimizer.
STAGES = {
    "zero0": {
        "stage": 0
    },
    "zero1": {
        "stage": 1
    },
    "zero2": {
        "stage": 2
    },
    "zero1_bf16_optimizer": {
        "stage": 1
    },
    "zero3_offload": {
        "stage": 3,
        "stage3_param_persistence_threshold": 0,
        "offload_param": {
            "device": "cpu"
        }
    },
}
# The stages whose optimizer states can be offloaded to the CPU.
OPTIMIZER_OFFLOAD = ["zero1", "zero2", "zero3_offload"]
# The stages that write ZeRO checkpoints, which zero_to_fp32 reads.
ZERO_CHECKPOINTS = ["zero1", "zero2", "zero1_bf16_optimizer", "zero3_offload"]
FP16_STAGES = [stage for stage in STAGES if stage != "zero1_bf16_optimizer"]


def _stage_config(stage, keep="auto", dtype="bf16", ga=1, offload_optimizer=False):
    config = _config(keep=keep, dtype=dtype, ga=ga)
    config["zero_optimization"] = dict(STAGES[stage])
    if offload_optimizer:
        config["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}
    if stage == "zero1_bf16_optimizer":
        config.setdefault("data_types", {})["grad_accum_dtype"] = "fp32"
    return config


def _stage_engine(stage, config):
    return _engine(config, zero_init=stage == "zero3_offload")


def _storage_dtype(param):
    return getattr(param, "ds_tensor", param).dtype


def _check_dtypes(model, kept, half_dtype):
    """The names in ``kept`` in fp32, every other parameter in ``half_dtype`` (under ZeRO-3 its partition too)."""
    for name, param in model.named_parameters():
        want = torch.float32 if name in kept else half_dtype
        assert param.dtype == want and _storage_dtype(param) == want, f"{name} is {_storage_dtype(param)}, not {want}"
    assert model.bias_buf.dtype == torch.float32


def _master(param):
    """The fp32 master of ``param`` where the optimizer has an accessor for it (not the engine's fp16/bf16 optimizer
    without ZeRO), else its value in fp32; a copy on the CPU."""
    master = safe_get_full_fp32_param(param)
    return _gathered(param).float() if master is None else master.cpu()


def _masters(engine):
    """Each parameter's fp32 master (``_master``)."""
    return {name: _master(param) for name, param in engine.module.named_parameters()}


def _check_kept_and_updated(engine):
    """The kept parameters equal their masters, and the sinks moved below bf16's resolution."""
    masters = _masters(engine)
    for name, param in engine.module.named_parameters():
        if param.dtype == torch.float32:
            value = _gathered(param)
            assert value.dtype == torch.float32 and torch.equal(value, masters[name]), name
    value = _gathered(_sinks(engine.module))
    assert not torch.equal(value, SINK_VALUES), "the sinks did not move"
    assert (value - SINK_VALUES).abs().max() < 1e-3, "the sinks moved by more than a few Adam steps can"
    assert not torch.equal(value, value.bfloat16().float()), "the sinks are on the bf16 grid"


def _snapshot(engine):
    """Every parameter's value, master and Adam moments (None where the optimizer has no accessor)."""
    masters = _masters(engine)
    return {
        name: (_gathered(param), masters[name], safe_get_full_optimizer_state(param, "exp_avg"),
               safe_get_full_optimizer_state(param, "exp_avg_sq"))
        for name, param in engine.module.named_parameters()
    }


def _check_same(a, b):
    for name in a:
        for what, x, y in zip(("param", "master", "exp_avg", "exp_avg_sq"), a[name], b[name]):
            assert (x is None) == (y is None), f"{name}: {what}"
            assert x is None or (x.dtype == y.dtype and torch.equal(x, y)), f"{name}: {what} differs"


class TestStagesKeepValues(DistributedTest):
    world_size = 2

    @pytest.mark.parametrize("stage", list(STAGES))
    def test_listed_params_hold_exact_fp32(self, stage):
        config = _stage_config(stage)
        engine = _stage_engine(stage, config)
        _check_dtypes(engine.module, _listed_names(engine.module), torch.bfloat16)
        assert torch.equal(_gathered(_sinks(engine.module)), SINK_VALUES)
        masters = _masters(engine)
        assert torch.equal(masters["attn.sinks"], SINK_VALUES), "the fp32 master was made from rounded values"

    @pytest.mark.parametrize("stage", [
        stage if stage in ("zero0", "zero3_offload") else pytest.param(stage, marks=pytest.mark.nightly)
        for stage in STAGES
    ])
    def test_empty_list_keeps_nothing(self, stage):
        config = _stage_config(stage, keep=[])
        engine = _stage_engine(stage, config)
        _check_dtypes(engine.module, set(), torch.bfloat16)
        assert torch.equal(_gathered(_sinks(engine.module)), SINK_VALUES.bfloat16())


def _update_cases():
    """Each stage with optimizer offload on and off where it has it, and gradient accumulation 1 and 2; make test runs
    one case a stage, the nightly runs all."""
    fast = [("zero0", False, 2), ("zero1", True, 1), ("zero2", False, 2), ("zero1_bf16_optimizer", False, 1),
            ("zero3_offload", True, 2)]
    for stage in STAGES:
        for offload in ([False, True] if stage in OPTIMIZER_OFFLOAD else [False]):
            for ga in (1, 2):
                case = (stage, offload, ga)
                yield case if case in fast else pytest.param(*case, marks=pytest.mark.nightly)


class TestStagesSubResolutionUpdates(DistributedTest):
    world_size = 2

    @pytest.mark.parametrize("stage, offload, ga", list(_update_cases()))
    def test_update_survives(self, stage, offload, ga):
        config = _stage_config(stage, ga=ga, offload_optimizer=offload)
        engine = _stage_engine(stage, config)
        losses = _train(engine, config, steps=3)
        assert all(torch.isfinite(torch.tensor(losses)))
        _check_dtypes(engine.module, _listed_names(engine.module), torch.bfloat16)
        _check_kept_and_updated(engine)


class TestStagesOverlapCommOneRank(DistributedTest):
    """One rank, overlap_comm and contiguous_gradients on, in every stage (tools/gpu-check runs it on CUDA, where the
    reduction stream is real): the listed parameters are fp32 and exact once loaded, the first step's fp32 master of
    the sinks equals what the optimizer computes from their fp32 gradient, and updates below bf16's resolution
    survive."""
    world_size = 1

    @pytest.mark.parametrize("stage", ["zero0", "zero1", "zero2", "zero1_bf16_optimizer", "zero3", "zero3_offload"])
    def test_first_step_is_the_optimizers_and_updates_survive(self, stage):
        config = _config() if stage == "zero3" else _stage_config(stage)
        config["zero_optimization"].update(overlap_comm=True, contiguous_gradients=True)
        config["gradient_clipping"] = 0.0  # not DeepSpeed's default 1.0: the step takes the gradient as it is
        engine = _engine(config, zero_init=True) if stage == "zero3" else _stage_engine(stage, config)
        sinks = _sinks(engine.module)
        value = _gathered(sinks)
        assert sinks.dtype == _storage_dtype(sinks) == value.dtype == torch.float32
        assert torch.equal(value, SINK_VALUES)

        engine.backward(engine(_batch(0, config)))
        grad = safe_get_full_grad(sinks)
        assert grad is not None and grad.dtype == torch.float32
        grad = grad.detach().cpu().clone()
        assert torch.isfinite(grad).all() and grad.abs().max() > 0
        before = _master(sinks)
        optimizer = base_optimizer(engine)
        # Adam's state for the sinks before the step: none, but where the sinks are their own master in
        # FP16_UnfusedOptimizer (zero0), which steps once at init with zero gradients (step 1, zero moments)
        state = {key: tensor.clone() for key, tensor in optimizer.state.get(sinks, {}).items()}
        assert bool(state) == (stage == "zero0"), state
        engine.step()

        # the reference: a fresh optimizer of the engine's class and hyperparameters, with that state, steps the
        # sinks' master alone, on the device of the masters that the engine's optimizer steps
        devices = {master.device for master in optimizer.state}
        assert len(devices) == 1, devices
        device = devices.pop()
        reference = before.to(device).clone()
        reference.grad = grad.to(device)
        hyperparameters = {key: setting for key, setting in optimizer.param_groups[0].items() if key != "params"}
        reference_optimizer = type(optimizer)([dict(hyperparameters, params=[reference])])
        if state:
            reference_optimizer.state[reference] = state
        reference_optimizer.step()
        assert torch.equal(_master(sinks), reference.detach().cpu()), "the first step is not the optimizer's"
        # Adam's first update is about lr * sign(gradient), which a rounded gradient gives too; its moments hold the
        # gradient's every bit (without ZeRO, where the sinks are their own master, the state is the sinks')
        for key in ("exp_avg", "exp_avg_sq"):
            moment = safe_get_full_optimizer_state(sinks, key)
            moment = optimizer.state[sinks][key] if moment is None else moment
            assert torch.equal(moment.cpu(), reference_optimizer.state[reference][key].cpu()), key

        _train(engine, config, steps=2)
        _check_kept_and_updated(engine)


class TestStagesFp16(DistributedTest):
    world_size = 2

    @pytest.mark.parametrize("stage", FP16_STAGES)
    def test_overflow_in_fp32_gradient_skips_the_step(self, stage):
        config = _stage_config(stage, dtype="fp16")
        engine = _stage_engine(stage, config)
        _check_dtypes(engine.module, _listed_names(engine.module), torch.float16)
        _train(engine, config, steps=1)
        before = _masters(engine)
        scale = engine.optimizer.loss_scale
        # the loss is finite; only the fp32 gradient of the sinks overflows (about 1e60)
        loss = engine(_batch(1, config), grad_boost=1e30)
        assert torch.isfinite(loss)
        engine.backward(loss)
        engine.step()
        assert engine.skipped_steps == 1
        assert engine.optimizer.loss_scale == scale / 2
        after = _masters(engine)
        for name in before:
            assert torch.equal(before[name], after[name]), f"{name} changed in a skipped step"
        losses = _train(engine, config, steps=2)
        assert all(torch.isfinite(torch.tensor(losses)))
        _check_kept_and_updated(engine)


class TestStagesClipping(DistributedTest):
    world_size = 2

    @pytest.mark.parametrize("stage", list(STAGES))
    def test_global_norm_covers_both_dtypes(self, stage):
        # the sinks' gradient dominates the global norm, so leaving the fp32 gradients out would show
        config = _stage_config(stage)
        config["gradient_clipping"] = 1.0
        engine = _stage_engine(stage, config)
        loss = engine(_batch(0, config), grad_boost=1e3)
        engine.backward(loss)
        grads = {name: safe_get_full_grad(p) for name, p in engine.module.named_parameters()}
        assert grads["attn.sinks"].dtype == torch.float32
        expected = torch.stack([g.float().norm() for g in grads.values()]).norm()
        assert grads["attn.sinks"].norm() > 0.9 * expected
        engine.step()
        norm = float(engine.get_global_grad_norm())
        assert norm == pytest.approx(expected.item(), rel=1e-3)
        assert norm > 1.0  # so the step was clipped
        _check_kept_and_updated(engine)


# The collectives of DeepSpeed's communication backend (deepspeed.comm.comm.cdb), which every deepspeed.comm
# collective calls.
BACKEND_COLLECTIVES = ("all_reduce", "all_reduce_coalesced", "inference_all_reduce", "reduce", "all_gather",
                       "all_gather_into_tensor", "all_gather_coalesced", "reduce_scatter", "reduce_scatter_tensor",
                       "broadcast", "all_to_all_single")


@contextlib.contextmanager
def _backend_spy(names, on_call):
    """Calls ``on_call(name, args, kwargs)`` for each collective of ``names`` that reaches DeepSpeed's communication
    backend while the block runs."""
    cdb = dist.comm.cdb

    def spy(name, collective):

        def record(*args, **kwargs):
            on_call(name, args, kwargs)
            return collective(*args, **kwargs)

        return record

    originals = {name: getattr(cdb, name) for name in names if hasattr(cdb, name)}
    for name, collective in originals.items():
        setattr(cdb, name, spy(name, collective))
    try:
        yield
    finally:
        for name, collective in originals.items():
            setattr(cdb, name, collective)


@contextlib.contextmanager
def _backend_collectives():
    """The names of the collectives that reach DeepSpeed's communication backend while the block runs."""
    calls = []
    with _backend_spy(BACKEND_COLLECTIVES, lambda name, args, kwargs: calls.append(name)):
        yield calls


# The stages whose optimizer partitions the kept fp32 masters over the data parallel ranks and all-gathers the
# updated partitions after the step, as it does the training dtype's (ZeRO-3 gathers parameters of both dtypes in one
# collective at the next fetch, and stage 0 does not partition).
GATHERS_KEPT_PARTITIONS = ["zero1", "zero2", "zero1_bf16_optimizer"]


def _added_collectives(stage, fp32_communication=False):
    """How many collectives keeping parameters in fp32 adds to a step of ``stage``: the reduction of the kept
    gradients, but none at ZeRO-3 when the others are reduced in fp32 too (they share the others' bucket), and the
    all-gather of the kept partitions where GATHERS_KEPT_PARTITIONS. The gradient norm takes no all-reduce more: every
    stage all-reduces a param group's norm over its parameters of both dtypes."""
    return (not (fp32_communication and stage.startswith("zero3"))) + (stage in GATHERS_KEPT_PARTITIONS)


class TestStagesStepCollectives(DistributedTest):
    """Keeping parameters in fp32 adds one reduction to a training step, in every stage: that of their fp32
    gradients. ZeRO-1/2 and the BF16 optimizer partition the kept fp32 masters like every other group, so their
    updated partitions are all-gathered after the step: one collective more there. ZeRO-3 all-reduces the kept
    sub-groups' gradient norm in the all-reduce of their param group's other sub-group: none more there."""
    world_size = 2

    @pytest.mark.parametrize("stage, offload_optimizer", [(stage, False) for stage in STAGES] +
                             [pytest.param(stage, True, marks=pytest.mark.nightly) for stage in OPTIMIZER_OFFLOAD])
    def test_step_adds_one_reduction(self, stage, offload_optimizer):
        calls = {}
        for keep in ("auto", []):
            config = _stage_config(stage, keep=keep, offload_optimizer=offload_optimizer)
            config["gradient_clipping"] = 1.0
            engine = _stage_engine(stage, config)
            _check_dtypes(engine.module, _listed_names(engine.module) if keep else [], torch.bfloat16)
            _train(engine, config, steps=1)  # a first step may set things up
            with _backend_collectives() as calls[str(keep)]:
                _train(engine, config, steps=1)
        added = collections.Counter(calls["auto"])
        added.subtract(collections.Counter(calls["[]"]))
        assert calls["[]"] and len(calls["auto"]) == len(calls["[]"]) + _added_collectives(stage), dict(added)


class InterleavedNorms(torch.nn.Module):
    """Four layers, each a bf16 linear and a listed norm, then a bf16 linear: backward meets a kept gradient after
    every other one, and a bf16 one first."""
    _keep_in_fp32_modules_strict = ["norm"]

    def __init__(self, layers=4):
        super().__init__()
        self.lins = torch.nn.ModuleList([torch.nn.Linear(HIDDEN, HIDDEN) for _ in range(layers)])
        self.norms = torch.nn.ModuleList([Norm(HIDDEN) for _ in range(layers)])
        self.out = torch.nn.Linear(HIDDEN, HIDDEN)

    def forward(self, x):
        h = x
        for lin, norm in zip(self.lins, self.norms):
            h = norm(lin(h)).to(x.dtype)
        return self.out(h).float().pow(2).mean()


class TestFp32CommunicationBuckets(DistributedTest):
    """With communication_data_type fp32 the other parameters' gradients are reduced in fp32 too. ZeRO-1/2 still
    reduce the kept ones in a bucket of their own: keeping adds one reduction per step (and the collectives
    _added_collectives counts), not one at every switch between a kept parameter and another in backward. ZeRO-3
    reduces them in the others' fp32 bucket: no reduction more."""
    world_size = 2

    # each stage, ZeRO-2 with overlap_comm too, with and without contiguous_gradients
    @pytest.mark.parametrize("stage, zero", [
        pytest.param("zero2", {}, id="zero2"),
        pytest.param("zero2", {"overlap_comm": True}, marks=pytest.mark.nightly, id="zero2-overlap_comm"),
        pytest.param("zero2", {
            "overlap_comm": True,
            "contiguous_gradients": False
        },
                     marks=pytest.mark.nightly,
                     id="zero2-overlap_comm-no_contiguous_gradients"),
        pytest.param("zero1", {}, marks=pytest.mark.nightly, id="zero1"),
        pytest.param("zero3", {}, id="zero3"),
    ])
    def test_one_reduction_more(self, stage, zero):
        calls = {}
        for keep in ("auto", []):
            config = _config(keep=keep) if stage == "zero3" else _stage_config(stage, keep=keep)
            config["communication_data_type"] = "fp32"
            config["zero_optimization"].update(zero)
            torch.manual_seed(42)
            model = InterleavedNorms()
            engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
            assert all((p.dtype == torch.float32) == (keep == "auto" and "norms" in n)
                       for n, p in engine.module.named_parameters())
            _train(engine, config, steps=1)
            with _backend_collectives() as calls[str(keep)]:
                _train(engine, config, steps=1)
        added = collections.Counter(calls["auto"])
        added.subtract(collections.Counter(calls["[]"]))
        assert len(calls["auto"]) == len(calls["[]"]) + _added_collectives(stage, fp32_communication=True), dict(added)

    @pytest.mark.parametrize("stage, reduce_scatter", [("zero3", True), ("zero3", False), ("zero3_offload", True)])
    def test_zero3_reduces_kept_gradients_in_the_fp32_bucket(self, stage, reduce_scatter):
        """The same reductions as with nothing kept, and the kept gradients bit for bit those that their own bucket
        reduces under the default communication_data_type, not rounded to the bf16 gradients' accumulation dtype
        (a bf16 gradient comes first in the bucket, in the order of backward and of ds_id)."""
        reductions, grads = {}, {}
        for keep, comm in (("auto", "fp32"), ([], "fp32"), ("auto", None)):
            config = _config(keep=keep) if stage == "zero3" else _stage_config(stage, keep=keep)
            config["zero_optimization"]["reduce_scatter"] = reduce_scatter
            if comm is not None:
                config["communication_data_type"] = comm
            torch.manual_seed(42)
            model = InterleavedNorms()
            engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
            _train(engine, config, steps=1)
            with _backend_calls(("all_reduce", "reduce_scatter_tensor")) as calls:
                engine.backward(engine(_batch(1, config)))
            grads[(str(keep), comm)] = {
                name: safe_get_full_grad(p)
                for name, p in engine.module.named_parameters() if "norms" in name
            }
            engine.step()
            reductions[(str(keep), comm)] = collections.Counter(
                (name, dtype) for name, dtype, numel, _ in calls if numel > 1)
        assert reductions[("auto", "fp32")] == reductions[("[]", "fp32")], reductions
        for name, grad in grads[("auto", "fp32")].items():
            assert grad.dtype == torch.float32 and torch.equal(grad, grads[("auto", None)][name]), name
        assert any(not torch.equal(g, g.bfloat16().float()) for g in grads[("auto", "fp32")].values())


# Where the backend's collectives take async_op when it is passed by position.
ASYNC_OP_POSITION = {"all_reduce": 3, "reduce_scatter_tensor": 4, "all_gather_into_tensor": 3}


@contextlib.contextmanager
def _backend_calls(names=("all_reduce", "all_gather_into_tensor")):
    """Each collective of ``names`` that reaches DeepSpeed's communication backend while the block runs: its name,
    the dtype and number of elements of its first tensor, and whether it was launched with async_op."""
    calls = []

    def record(name, args, kwargs):
        tensor = next(a for a in list(args) + list(kwargs.values()) if torch.is_tensor(a))
        position = ASYNC_OP_POSITION.get(name, len(args))
        async_op = kwargs.get("async_op", args[position] if position < len(args) else False)
        calls.append((name, tensor.dtype, tensor.numel(), bool(async_op)))

    with _backend_spy(names, record):
        yield calls


class TestStagesKeptCollectivesFollowStock(DistributedTest):
    """The collectives that keeping adds run where stock runs such collectives, in stock's order, on every rank: the
    fp32 all-reduce of the kept gradients is one more blocking collective after the training dtype's (ZeRO-1/2
    reduce the kept bucket as stock reduces a contiguous one), and ZeRO-1/2 and
    the BF16 optimizer all-gather the updated partitions of both dtypes one group after the other, blocking, as
    stock gathers its groups. Nothing is launched async and waited for later: under NCCL the collectives of one
    communicator run in order anyway, and across communicators (MoE) concurrent collectives can deadlock. ZeRO-1/2
    all-reduce a param group's gradient norm once, over its parameters of both dtypes, as without keeping."""
    world_size = 2

    @pytest.mark.parametrize("stage", ["zero0", "zero1", "zero2", "zero1_bf16_optimizer"])
    def test_kept_collectives_follow_the_others_blocking(self, stage):
        config = _stage_config(stage)
        config["gradient_clipping"] = 1.0
        engine = _stage_engine(stage, config)
        _train(engine, config, steps=1)
        with _backend_calls() as calls:
            _train(engine, config, steps=1)
        assert not any(launched_async for *_, launched_async in calls), calls
        reductions = [(i, dtype) for i, (name, dtype, numel, _) in enumerate(calls)
                      if name == "all_reduce" and numel > 1 and dtype != torch.uint8]
        kept = [i for i, dtype in reductions if dtype == torch.float32]
        others = [i for i, dtype in reductions if dtype == torch.bfloat16]
        assert len(kept) == 1 and others, calls
        assert kept[0] > others[-1], f"the kept gradients are not reduced after the others: {calls}"
        gathers = [dtype for name, dtype, _, _ in calls if name == "all_gather_into_tensor"]
        if stage in GATHERS_KEPT_PARTITIONS:
            assert sorted(str(dtype) for dtype in gathers) == ["torch.bfloat16", "torch.float32"], calls
        norms = [call for call in calls if call[0] == "all_reduce" and call[2] == 1 and call[1] == torch.float32]
        assert len(norms) == (stage in ("zero1", "zero2")), calls


class TestStage3KeptReductionFollowsStock(DistributedTest):
    """ZeRO-3 reduce-scatters the kept gradients left at the end of backward (their bucket seldom fills) after the
    training dtype's, blocking like them, through the same bucket drain and its back-pressure on
    reduce_and_partition_stream, with and without offload."""
    world_size = 2

    @pytest.mark.parametrize("stage", ["zero3", "zero3_offload"])
    def test_kept_reduce_scatter_follows_the_others_blocking(self, stage):
        config = _config() if stage == "zero3" else _stage_config(stage)
        engine = _stage_engine(stage, config)
        _train(engine, config, steps=1)
        with _backend_calls(("reduce_scatter_tensor", )) as calls:
            _train(engine, config, steps=1)
        assert not any(launched_async for *_, launched_async in calls), calls
        kept = [i for i, (_, dtype, _, _) in enumerate(calls) if dtype == torch.float32]
        others = [i for i, (_, dtype, _, _) in enumerate(calls) if dtype == torch.bfloat16]
        assert len(kept) == 1 and others, calls
        assert kept[0] > others[-1], f"the kept gradients are not reduced after the others: {calls}"


class TestStagesKeptGradientsAveraged(DistributedTest):
    """ZeRO-1/2 reduce the kept gradients in fp32 to the mean of the ranks' gradients, bit for bit, with and without
    overlap_comm and contiguous_gradients (stock's paths for a contiguous bucket and for a bucket without a
    buffer): each rank's gradient is taken from a plain copy of the module on the same batch."""
    world_size = 2

    @pytest.mark.parametrize("contiguous_gradients", [True, False], ids=["contiguous", "not_contiguous"])
    @pytest.mark.parametrize("overlap_comm", [True, False], ids=["overlap_comm", "no_overlap_comm"])
    @pytest.mark.parametrize("stage", ["zero1", "zero2"])
    def test_kept_gradient_is_the_mean_of_the_ranks(self, stage, overlap_comm, contiguous_gradients):
        config = _stage_config(stage)
        config["zero_optimization"].update(overlap_comm=overlap_comm, contiguous_gradients=contiguous_gradients)
        engine = _stage_engine(stage, config)
        plain = copy.deepcopy(engine.module)  # the same parameters and dtypes, without ZeRO's gradient hooks
        batch = _batch(0, config)
        plain(batch).backward()
        local = [p.grad.float() for p in (plain.attn.sinks, plain.norm.weight)]
        assert all(g.dtype == torch.float32 and g.abs().sum() > 0 for g in local)
        means = []
        for grad in local:
            gathered = [torch.empty_like(grad) for _ in range(dist.get_world_size())]
            dist.all_gather(gathered, grad)
            assert not torch.equal(gathered[0], gathered[1]), "the ranks' gradients do not differ"
            means.append(sum(gathered) / dist.get_world_size())
        engine.backward(engine(batch))
        for name, param, mean in zip(("attn.sinks", "norm.weight"),
                                     (engine.module.attn.sinks, engine.module.norm.weight), means):
            grad = safe_get_full_grad(param)
            assert grad.dtype == torch.float32, name
            assert torch.equal(grad.cpu(), mean.cpu()), f"{name}: the reduced gradient is not the ranks' mean"


class _Stream:
    """A stream of a device whose kernels run asynchronously (_async_device): each wait is logged."""

    def __init__(self, name, log):
        self.name, self.log = name, log

    def wait_stream(self, other):
        self.log.append(("wait_stream", self.name, other.name))

    def wait_event(self, event):
        self.log.append(("wait_event", self.name, event.stream))

    def synchronize(self):
        self.log.append(("stream_synchronize", self.name))


@contextlib.contextmanager
def _async_device():
    """The CPU accelerator as a device whose kernels run asynchronously, on streams, for the calls that reach it
    while the block runs: its streams, events, synchronize and record_stream are logged in order (with the
    collectives that reach the backend) instead of being no-ops, and stock's code takes its paths for such a device.
    The tensors stay on the CPU, so values are computed as usual."""
    from deepspeed.accelerator import get_accelerator
    accelerator = get_accelerator()
    log = []
    streams = {"current": _Stream("compute", log)}

    class Event:

        def __init__(self, **kwargs):
            self.stream = None

        def record(self, stream=None):
            self.stream = (stream or streams["current"]).name

        def synchronize(self):
            log.append(("event_synchronize", self.stream))

        def query(self):
            return True

    @contextlib.contextmanager
    def on(stream):
        previous = streams["current"]
        streams["current"] = stream if stream is not None else previous
        try:
            yield
        finally:
            streams["current"] = previous

    made = iter(f"stream{i}" for i in itertools.count())

    class AsyncDevice(type(accelerator)):

        def is_synchronized_device(self):
            return False

        def resolves_data_dependency(self):
            return False

        @property
        def Stream(self):
            return lambda *args, **kwargs: _Stream(next(made), log)

        def current_stream(self, device_index=None):
            return streams["current"]

        def default_stream(self, device_index=None):
            return streams["current"]

        def stream(self, stream):
            return on(stream)

        def synchronize(self, device_index=None):
            log.append(("synchronize", ))

        @property
        def Event(self):
            return Event

    cls, record_stream = accelerator.__class__, torch.Tensor.record_stream
    accelerator.__class__ = AsyncDevice
    torch.Tensor.record_stream = lambda tensor, stream: log.append(("record_stream", tensor, stream.name))
    try:
        with _backend_spy(("all_reduce", "reduce"), lambda name, args, kwargs: log.append(
            (name, next(a for a in list(args) + list(kwargs.values()) if torch.is_tensor(a)).dtype))):
            yield log
    finally:
        torch.Tensor.record_stream = record_stream
        accelerator.__class__ = cls


class TestZeRO12KeptBucketFollowsStockStreams(DistributedTest):
    """ZeRO-1/2 reduce the kept bucket as stock reduces a bucket with a contiguous buffer (average_tensor), on the
    streams of a device whose kernels run asynchronously: with overlap_comm, the reduction stream waits for the
    stream that made the gradients (no host synchronize that the same run without keeping does not make), every kept
    gradient and the flat tensor the reduction read are recorded on the reduction stream before they can be freed,
    and the bucket, which has no buffer, keeps no double-buffer bookkeeping. A bucket of 20 elements flushes the
    kept one in the middle of backward."""
    world_size = 2

    @pytest.mark.parametrize("stage", ["zero1", "zero2"])
    def test_streams_as_stock(self, stage):
        logs, kept_buckets = {}, {}
        for keep in ("auto", []):
            config = _stage_config(stage, keep=keep)
            config["zero_optimization"].update(overlap_comm=True, contiguous_gradients=True, reduce_bucket_size=20)
            with _async_device() as log:
                engine = _stage_engine(stage, config)
                del log[:]
                engine.backward(engine(_batch(0, config)))
                logs[str(keep)] = list(log)
            kept_buckets[str(keep)] = engine.optimizer.kept_ipg_bucket
        log = logs["auto"]
        assert log.count(("synchronize", )) == logs["[]"].count(("synchronize", )), \
            "keeping adds a host synchronize to backward"
        kept_reductions = [i for i, entry in enumerate(log) if entry == ("all_reduce", torch.float32)]
        assert len(kept_reductions) >= 2, log  # one in the middle of backward, one at its end
        previous = -1
        for i in kept_reductions:
            waits = [e for e in log[previous + 1:i] if e[0] == "wait_stream" and e[2] == "compute"]
            assert waits, f"the reduction stream does not wait for the gradients before a kept reduction: {log}"
            previous = i
        recorded = [(entry[1].dtype, entry[1].numel()) for entry in log
                    if entry[0] == "record_stream" and entry[2] != "compute"]
        for name, param in engine.module.named_parameters():
            if param.dtype == torch.float32:
                assert (torch.float32, param.numel()) in recorded, f"{name}'s gradient was not recorded"
        bucket = kept_buckets["auto"]
        assert kept_buckets["[]"] is None and bucket.buffer == [] and bucket.index == 0 and not bucket.reuse_events

    @pytest.mark.parametrize("stage", ["zero1", "zero2"])
    def test_use_multi_rank_bucket_allreduce_off(self, stage):
        """use_multi_rank_bucket_allreduce false: each rank's share of the kept gradients is reduced to it (reduce),
        as the others are, not all-reduced, and each is the ranks' mean bit for bit."""
        config = _stage_config(stage)
        config["zero_optimization"].update(use_multi_rank_bucket_allreduce=False)
        engine = _stage_engine(stage, config)
        plain = copy.deepcopy(engine.module)
        batch = _batch(0, config)
        plain(batch).backward()
        with _backend_calls(("all_reduce", "reduce")) as calls:
            engine.backward(engine(batch))
        assert [c for c in calls if c[1] == torch.float32 and c[2] > 1 and c[0] == "all_reduce"] == [], calls
        assert any(c[0] == "reduce" and c[1] == torch.float32 for c in calls), calls
        for name, param in engine.module.named_parameters():
            if param.dtype != torch.float32:
                continue
            grad = dict(plain.named_parameters())[name].grad.float()
            gathered = [torch.empty_like(grad) for _ in range(dist.get_world_size())]
            dist.all_gather(gathered, grad)
            assert torch.equal(safe_get_full_grad(param).cpu(), (sum(gathered) / dist.get_world_size()).cpu()), name


class KeptNormMaybeUnused(torch.nn.Module):
    """A linear layer in the training dtype, then a norm the model lists for fp32 that one step may skip."""
    _keep_in_fp32_modules_strict = ["norm"]

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(HIDDEN, HIDDEN)
        self.norm = Norm(HIDDEN)

    def forward(self, x, use_norm=True):
        h = self.lin(x)
        if use_norm:
            h = self.norm(h.float()).to(h.dtype)
        return h.float().pow(2).mean()


class TestZeRO12EmptyKeptBucket(DistributedTest):
    """The kept bucket is flushed while empty, as a contiguous bucket can be, and that issues nothing: a kept
    parameter larger than reduce_bucket_size comes first in backward (the HF Trainer's "auto" bucket is hidden
    size squared), or a backward makes no kept gradient (a kept module a step skips)."""
    world_size = 2

    @pytest.mark.parametrize("overlap_comm", [True, False], ids=["overlap_comm", "no_overlap_comm"])
    @pytest.mark.parametrize("stage", ["zero1", "zero2"])
    def test_kept_parameter_larger_than_the_bucket(self, stage, overlap_comm):
        config = _stage_config(stage)
        config["zero_optimization"].update(overlap_comm=overlap_comm, reduce_bucket_size=4)
        engine = _stage_engine(stage, config)
        losses = _train(engine, config, steps=2)
        assert all(torch.isfinite(torch.tensor(losses))), losses
        _check_kept_and_updated(engine)

    @pytest.mark.parametrize("stage", ["zero1", "zero2"])
    def test_backward_without_kept_gradients(self, stage):
        config = _stage_config(stage, keep=["norm"])
        config["zero_optimization"].update(overlap_comm=True)
        torch.manual_seed(42)
        model = KeptNormMaybeUnused()
        engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
        assert engine.module.norm.weight.dtype == torch.float32
        for step, use_norm in enumerate((False, True)):
            loss = engine(_batch(step, config), use_norm=use_norm)
            engine.backward(loss)
            engine.step()
            assert torch.isfinite(loss), step
        weight = engine.module.norm.weight
        assert weight.dtype == torch.float32
        assert torch.equal(weight.detach().cpu(), safe_get_full_fp32_param(weight).cpu())


class TestStagesCheckpoint(DistributedTest):
    world_size = 2

    @pytest.mark.parametrize("stage", list(STAGES))
    def test_round_trip_is_exact_and_training_continues(self, stage, tmp_path):
        config = _stage_config(stage)
        engine = _stage_engine(stage, config)
        _train(engine, config, steps=2)
        engine.save_checkpoint(str(tmp_path))
        saved = _snapshot(engine)
        saved_state = whole_state(engine)

        torch.manual_seed(7)
        loaded = _stage_engine(stage, config)
        loaded.load_checkpoint(str(tmp_path))
        _check_same(saved, _snapshot(loaded))
        check_whole_state(whole_state(loaded), saved_state)
        check_masters_own_their_states(loaded)
        _check_dtypes(loaded.module, _listed_names(loaded.module), torch.bfloat16)

        # both continue the same way, as the optimizer makes it of the loaded state
        continuation = Continuation(loaded)
        assert _train(engine, config, steps=2) == _train(loaded, config, steps=2)
        continuation.check(steps=2)
        _check_same(_snapshot(engine), _snapshot(loaded))
        check_whole_state(whole_state(loaded), whole_state(engine), "two more steps")
        _check_kept_and_updated(loaded)

    @pytest.mark.parametrize("stage", ZERO_CHECKPOINTS)
    def test_zero_to_fp32_is_exact(self, stage, tmp_path):
        config = _stage_config(stage)
        engine = _stage_engine(stage, config)
        _train(engine, config, steps=2)
        engine.save_checkpoint(str(tmp_path))
        masters = _masters(engine)
        values = {name: _gathered(param) for name, param in engine.module.named_parameters()}
        assert {name for name, value in values.items() if value.dtype == torch.float32} == _listed_names(engine.module)
        if dist.get_rank() == 0:
            from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
            state_dict = get_fp32_state_dict_from_zero_checkpoint(str(tmp_path))
            for name, master in masters.items():
                assert torch.equal(state_dict[name], master), name
                if values[name].dtype == torch.float32:
                    assert torch.equal(state_dict[name], values[name]), name
        dist.barrier()


class TestStagesTransformers(DistributedTest):
    """A tiny DeepSeek-V3 (``_keep_in_fp32_modules_strict``: ``gate.weight``, the router of each MoE layer, and
    ``e_score_correction_bias``) loaded with ``from_pretrained`` and trained: the routers hold the file's exact fp32
    values, and their Adam updates, which bf16 could not hold."""
    world_size = 2

    @pytest.mark.parametrize("stage", list(STAGES))
    def test_router_weights_load_exact_and_train(self, stage, tmp_path):
        transformers = pytest.importorskip("transformers")
        safetensors_torch = pytest.importorskip("safetensors.torch")
        if not tiny_hf_models.has_model("deepseek_v3"):
            pytest.skip(f"transformers {transformers.__version__} has no DeepSeek-V3")
        if dist.get_rank() == 0:
            tiny_hf_models.save_tiny_model("deepseek_v3", tmp_path, seed=3)
        dist.barrier()
        saved = safetensors_torch.load_file(str(tmp_path / "model.safetensors"))
        routers = sorted(name for name in saved if name.endswith("gate.weight"))
        assert len(routers) == 2 and not any(torch.equal(saved[n], saved[n].bfloat16().float()) for n in routers)

        config = _stage_config(stage, keep="auto")
        config["train_micro_batch_size_per_gpu"] = 2
        model_cls = tiny_hf_models.model_class("deepseek_v3")
        if stage == "zero3_offload":
            from transformers.integrations import HfDeepSpeedConfig
            dschf = HfDeepSpeedConfig(config)  # noqa: F841 (alive while the model loads: zero.Init)
        model = model_cls.from_pretrained(str(tmp_path), dtype=torch.bfloat16)
        engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
        params = dict(engine.module.named_parameters())
        for name, param in params.items():
            want = torch.float32 if name in routers else torch.bfloat16
            assert _storage_dtype(param) == want, f"{name} is {_storage_dtype(param)}, not {want}"
        before = {name: _gathered(params[name]) for name in routers}
        for name in routers:
            assert torch.equal(before[name], saved[name]), f"{name} is not the file's fp32 value"

        losses = []
        for step in range(3):
            gen = torch.Generator().manual_seed(100 * step + dist.get_rank())
            ids = torch.randint(0, tiny_hf_models.VOCAB, (2, 8), generator=gen)
            loss = engine(input_ids=ids, labels=ids).loss
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
        assert all(torch.isfinite(torch.tensor(losses))), losses
        masters = _masters(engine)
        for name in routers:
            after = _gathered(params[name])
            assert after.dtype == torch.float32 and torch.equal(after, masters[name]), name
            below = (after != before[name]) & (after.bfloat16() == before[name].bfloat16())
            assert below.any(), f"{name}: no update below bf16's resolution survived"


class TinySinkNet(torch.nn.Module):
    """A listed parameter of 2 elements: at data-parallel size 4, ZeRO-3 partitions of ranks 2 and 3 hold only
    padding of it."""
    _keep_in_fp32_modules_strict = ["sink"]

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(HIDDEN, HIDDEN)
        self.sink = torch.nn.Parameter(torch.full((2, ), 8.0))

    def forward(self, x):
        return ((self.lin(x) + self.sink.sum().to(x.dtype))**2).float().mean()


class TestStage3ReleasedGradientsRecordTheirStream(DistributedTest):
    """ZeRO-3 frees each gradient it has reduced: on a GPU the reduction read it on the reduction stream, so the
    caching allocator must not hand its block back to the compute stream before that read ran (record_stream). The
    kept bucket has no contiguous buffer, so its reduction reads every kept gradient itself, also on a rank whose
    partition of it is padding only (contains_real_data false), which stock reaches only without
    contiguous_gradients. On the CPU the accelerator is synchronized: the test runs partition_grads as on a device
    that is not, and checks that every gradient it frees recorded the current stream first."""
    world_size = 4

    def test_every_freed_gradient_records_the_stream(self):
        from deepspeed.accelerator import get_accelerator
        config = _config(keep="auto")
        with deepspeed.zero.Init(config_dict_or_path=config):
            model = TinySinkNet()
        engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
        optimizer = engine.optimizer
        partition_grads = optimizer.partition_grads
        freed, recorded = [], []

        def spied(params, grad_partitions):
            accelerator = get_accelerator()
            synchronized, record_stream = accelerator.is_synchronized_device, torch.Tensor.record_stream
            accelerator.is_synchronized_device = lambda: False
            torch.Tensor.record_stream = lambda tensor, stream: recorded.append(tensor)
            freed.extend((param, param.grad) for param in params if param.grad is not None)
            try:
                return partition_grads(params, grad_partitions)
            finally:
                accelerator.is_synchronized_device, torch.Tensor.record_stream = synchronized, record_stream

        optimizer.partition_grads = spied
        batch = torch.randn(2, HIDDEN, generator=torch.Generator().manual_seed(dist.get_rank())).bfloat16()
        engine.backward(engine(batch))
        sink = engine.module.sink
        padding_only = sink.partition_numel() * dist.get_rank() >= sink.ds_numel
        assert any(param is sink for param, _ in freed), "the sink's gradient was not freed by partition_grads"
        for param, grad in freed:
            assert any(tensor is grad for tensor in recorded), \
                f"a gradient of {tuple(param.ds_shape)} was freed without record_stream (padding only: {padding_only})"
