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
