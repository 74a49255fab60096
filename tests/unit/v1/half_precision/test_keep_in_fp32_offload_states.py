# Copyright (c) DeepSpeed Team.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""``engine.offload_states()`` and ``reload_states()`` with parameters kept in fp32 (the default "auto" keeps the
sinks of SinkNet), as DeepSpeed 0.19.8 runs them with nothing kept: every state moves, the kept partitions, their
fp32 gradients and the fp32 bucket included, and training goes on exactly where it would have gone without the
round trip.

On the CPU accelerator "offloading" copies into new host buffers (pin_memory=True, the default): a state that
moved lives in new storage afterwards, which is what these tests check for the kept partitions.
"""

import pytest
import torch

from deepspeed.runtime.zero.offload_config import OffloadStateTypeEnum
from unit.common import DistributedTest
from unit.v1.half_precision.test_keep_in_fp32_modules import _config, _engine, _gathered, _train
from unit.v1.half_precision.test_keep_in_fp32_stages import _masters, _stage_config


def _offload_config(stage):
    if stage == "zero2":
        return _stage_config("zero2")
    config = _config()
    # ZeRO-3 offloads the optimizer's states only from DeepSpeed's FusedAdam
    config["optimizer"]["params"]["torch_adam"] = False
    return config


def _kept_storages(engine):
    """{name: data_ptr of the storage} of every kept parameter's partition (ZeRO-3) or flat-buffer view."""
    return {
        name: getattr(param, "ds_tensor", param).untyped_storage().data_ptr()
        for name, param in engine.module.named_parameters() if param.dtype == torch.float32
    }


def _kept_values(engine):
    """{name: the gathered value} of every kept parameter."""
    return {name: _gathered(param) for name, param in engine.module.named_parameters() if param.dtype == torch.float32}


def _check_masters_are_partitions(engine):
    """ZeRO-3: the fp32 master of each kept sub-group is its partition flat, and the partitions of its parameters
    point into it: the kept values are held once, and an update of the master is one of the parameters."""
    optimizer = engine.optimizer
    kept_sub_groups = [i for i, kept in enumerate(optimizer.group_kept_in_fp32) if kept]
    assert kept_sub_groups, "no sub-group is kept"
    for i in kept_sub_groups:
        master, flat = optimizer.fp32_partitioned_groups_flat[i], optimizer.fp16_partitioned_groups_flat[i]
        assert master.data_ptr() == flat.data_ptr(), f"sub-group {i}: its master and its partition flat are apart"
        storage = master.untyped_storage().data_ptr()
        for param in optimizer.fp16_groups[i]:
            assert param.ds_tensor.untyped_storage().data_ptr() == storage, f"sub-group {i}: a partition is apart"


class TestOffloadStates(DistributedTest):
    world_size = 2

    # ZeRO-3's case builds DeepSpeed's FusedAdam op: nightly
    @pytest.mark.parametrize("stage", ["zero2", pytest.param("zero3", marks=pytest.mark.nightly)])
    def test_round_trip_moves_kept_states_and_trains_on_exactly(self, stage):
        config = _offload_config(stage)
        engine = _engine(config, zero_init=stage == "zero3")
        _train(engine, config, 2)
        before = _kept_storages(engine)
        assert before, "nothing is kept"
        engine.offload_states()
        after = _kept_storages(engine)
        assert all(after[name] != before[name] for name in before), "the kept partitions were not moved"
        engine.reload_states()
        if stage == "zero3":
            _check_masters_are_partitions(engine)
        _train(engine, config, 2)

        reference = _engine(config, zero_init=stage == "zero3")
        _train(reference, config, 2)
        _train(reference, config, 2)
        # Values and fp32 masters after two more steps: equal only if the Adam moments came back too. (The moments
        # are not read through safe_get_full_optimizer_state: after reload_states, ZeRO-1/2 of 0.19.8 relinks the
        # parameters' fragments without their optimizer states, with or without kept parameters.)
        masters, want = _masters(engine), _masters(reference)
        for name, param in engine.module.named_parameters():
            assert torch.equal(masters[name], want[name]), name
            assert torch.equal(_gathered(param), _gathered(dict(reference.module.named_parameters())[name])), name

    # builds DeepSpeed's FusedAdam op: nightly
    @pytest.mark.nightly
    def test_hp_params_then_lp_params_keep_the_kept_values(self):
        """A kept sub-group's fp32 master is its partition flat: offloading hp_params alone, then lp_params alone, must
        neither part them nor bring back values of before the steps between."""
        config = _offload_config("zero3")
        engine = _engine(config)
        _train(engine, config, 2)
        _check_masters_are_partitions(engine)
        engine.offload_states(include=[OffloadStateTypeEnum.hp_params])
        engine.reload_states()
        before_steps = _kept_values(engine)
        _train(engine, config, 2)
        kept = _kept_values(engine)
        # the sinks moved by about lr = 1e-5 a step, far below bf16's resolution at 8.0: kept in fp32, and updated
        sinks = kept["attn.sinks"]
        assert not torch.equal(sinks, before_steps["attn.sinks"]), "the sinks did not move"
        assert not torch.equal(sinks, sinks.bfloat16().float()), "the sinks are on bf16's grid"
        engine.offload_states(include=[OffloadStateTypeEnum.lp_params])
        engine.reload_states()
        for name, value in _kept_values(engine).items():
            assert torch.equal(value, kept[name]), f"{name} is not what it was before offload_states(lp_params)"
        _check_masters_are_partitions(engine)

        # a full round trip leaves the kept values held once (whether it moves them: the test above; on the CPU a
        # reload leaves them in the pinned buffer, which a second offload_states copies into itself)
        engine.offload_states()
        engine.reload_states()
        _check_masters_are_partitions(engine)
        for name, value in _kept_values(engine).items():
            assert torch.equal(value, kept[name]), f"{name} is not what it was before offload_states()"
        _train(engine, config, 2)
        _check_masters_are_partitions(engine)

        # and training went on exactly where it would have gone without the round trips
        reference = _engine(config)
        for _ in range(3):
            _train(reference, config, 2)
        masters, want = _masters(engine), _masters(reference)
        for name, param in engine.module.named_parameters():
            assert torch.equal(masters[name], want[name]), name
            assert torch.equal(_gathered(param), _gathered(dict(reference.module.named_parameters())[name])), name
