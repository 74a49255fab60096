# Copyright (c) DeepSpeed Team.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""ZeRO-1/2 link each bf16 parameter to its own fp32 master and optimizer states (the fragments that
safe_get_full_fp32_param, safe_get_full_optimizer_state and a checkpoint's parameter slice mappings read):

- with round_robin_gradients, whose flat buffers hold the parameters in round-robin order;
- right after load_checkpoint, also in an engine whose optimizer stepped before the load, in ZeRO-1/2's optimizer
  and the BF16 optimizer;
- from a universal checkpoint, also on a rank that holds only padding of a param group.

ZeRO-3 gives each sub-group its own step from a universal checkpoint.

And zero_to_fp32 reads the BF16 optimizer's checkpoints (ZeRO-1's flat fp32 partitions, without a zero_stage).
"""

import pytest
import torch

import deepspeed
import deepspeed.comm as dist
from deepspeed.checkpoint.constants import UNIVERSAL_CHECKPOINT_INFO
from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state
from unit.common import DistributedTest
from unit.checkpoint._keep_in_fp32_checkpoint_run import to_universal


class Net(torch.nn.Module):
    """Parameters of several sizes, so that a reordering shows."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(8, 6)
        self.out = torch.nn.Linear(6, 3)

    def forward(self, x):
        return self.out(torch.relu(self.lin(x))).float().pow(2).mean()


class ScaledNet(Net):
    """With a one-element parameter, which its own param group holds: at data-parallel size 2 one rank holds only
    padding of that group."""

    def __init__(self):
        super().__init__()
        self.scale = torch.nn.Parameter(torch.tensor([1.5]))

    def forward(self, x):
        return super().forward(x) * self.scale.float()


def _engine(model_cls=Net, bf16_optimizer=False, load_universal=False, **zero):
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "steps_per_print": 1000,
        "optimizer": {
            "type": "Adam",
            "params": {
                "lr": 1e-3,
                "torch_adam": True
            }
        },
        "bf16": {
            "enabled": True
        },
        "zero_optimization": {
            "stage": 2,
            **zero
        },
    }
    if bf16_optimizer:  # ZeRO-1 with fp32 gradient accumulation
        config["zero_optimization"]["stage"] = 1
        config["data_types"] = {"grad_accum_dtype": "fp32"}
    if load_universal:
        config["checkpoint"] = {"load_universal": True}
    torch.manual_seed(42)
    model = model_cls()
    params = model.parameters()
    if model_cls is ScaledNet:
        params = [{
            "params": [p for name, p in model.named_parameters() if name != "scale"]
        }, {
            "params": [model.scale]
        }]
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=params, config=config)
    return engine


def _train(engine, steps):
    for step in range(steps):
        gen = torch.Generator().manual_seed(100 * step + dist.get_rank())
        loss = engine(torch.randn(2, 8, generator=gen).to(engine.device, torch.bfloat16))
        engine.backward(loss)
        engine.step()


def _states(engine):
    return {
        name: (safe_get_full_fp32_param(p), safe_get_full_optimizer_state(p, "exp_avg"),
               safe_get_full_optimizer_state(p, "exp_avg_sq"))
        for name, p in engine.module.named_parameters()
    }


class TestRoundRobinMasters(DistributedTest):
    world_size = 2

    def test_masters_are_their_params(self):
        engine = _engine(round_robin_gradients=True)
        for name, param in engine.module.named_parameters():
            master = safe_get_full_fp32_param(param)
            assert torch.equal(master, param.float()), f"{name}: its master is another parameter's values"


def _check_states(engine, saved):
    for name, (master, exp_avg, exp_avg_sq) in _states(engine).items():
        assert torch.equal(master, saved[name][0]), f"{name}: master"
        assert torch.equal(exp_avg, saved[name][1]), f"{name}: exp_avg is not the loaded one"
        assert torch.equal(exp_avg_sq, saved[name][2]), f"{name}: exp_avg_sq is not the loaded one"


class TestLoadedOptimizerStatesLinked(DistributedTest):
    world_size = 2

    @pytest.mark.parametrize("bf16_optimizer", [False, True])
    def test_accessors_read_the_loaded_states(self, bf16_optimizer, tmp_path):
        saver = _engine(bf16_optimizer=bf16_optimizer)
        _train(saver, 2)
        saver.save_checkpoint(str(tmp_path), tag="saved")
        saved = _states(saver)
        engine = _engine(bf16_optimizer=bf16_optimizer)
        _train(engine, 1)  # its own states, linked at its first step
        engine.load_checkpoint(str(tmp_path), tag="saved")
        _check_states(engine, saved)


class TestUniversalLoadOfPaddingOnlyPartition(DistributedTest):
    """A universal checkpoint loads into a param group of which this rank holds only padding: it has no state to
    load there. (ZeRO-1/2's optimizer: ds_to_universal does not convert a BF16 optimizer checkpoint with such a
    partition, _strip_tensor_paddings in zero_checkpoint.py.)"""
    world_size = 2

    def test_masters_are_the_saved_ones(self, tmp_path, bf16_optimizer=False):
        saver = _engine(ScaledNet, bf16_optimizer=bf16_optimizer)
        _train(saver, 2)
        saver.save_checkpoint(str(tmp_path), tag="saved", client_state={UNIVERSAL_CHECKPOINT_INFO: {}})
        saved = {name: safe_get_full_fp32_param(p) for name, p in saver.module.named_parameters()}
        if dist.get_rank() == 0:
            to_universal(str(tmp_path), tag="saved")
        dist.barrier()
        engine = _engine(ScaledNet, bf16_optimizer=bf16_optimizer, load_universal=True)
        engine.load_checkpoint(str(tmp_path))
        for name, param in engine.module.named_parameters():
            assert torch.equal(safe_get_full_fp32_param(param), saved[name]), name
        _train(engine, 1)


class TestZeRO3UniversalStepPerSubGroup(DistributedTest):
    """A ZeRO-3 universal checkpoint gives each sub-group its own step: torch's Adam advances it in place once per
    sub-group's step, so one shared step counted every sub-group each step."""
    world_size = 2

    def test_each_sub_group_counts_its_steps(self, tmp_path):
        saver = _engine(stage=3, sub_group_size=20)
        _train(saver, 2)
        saver.save_checkpoint(str(tmp_path), tag="saved")
        if dist.get_rank() == 0:
            to_universal(str(tmp_path), tag="saved")
        dist.barrier()
        engine = _engine(stage=3, sub_group_size=20, load_universal=True)
        engine.load_checkpoint(str(tmp_path))
        masters = engine.optimizer.fp32_partitioned_groups_flat
        assert len(masters) > 1, "one sub-group: nothing to share"
        steps = [engine.optimizer.optimizer.state[master]["step"] for master in masters]
        assert len({id(step) for step in steps}) == len(steps), "sub-groups share their step"
        _train(engine, 1)
        assert [int(step) for step in steps] == [3] * len(steps)


class TestZeroToFp32ReadsBF16Optimizer(DistributedTest):
    """The BF16 optimizer (ZeRO-1 with fp32 gradient accumulation) writes ZeRO-1's flat fp32 partitions; zero_to_fp32
    returns its masters, where 0.19.8 refused the checkpoint as "not a zero checkpoint"."""
    world_size = 2

    def test_returns_the_masters(self, tmp_path):
        engine = _engine(bf16_optimizer=True)
        _train(engine, 2)
        engine.save_checkpoint(str(tmp_path), tag="saved")
        masters = {name: safe_get_full_fp32_param(p) for name, p in engine.module.named_parameters()}
        if dist.get_rank() == 0:
            from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
            state_dict = get_fp32_state_dict_from_zero_checkpoint(str(tmp_path), tag="saved")
            assert state_dict.keys() == masters.keys()
            for name, master in masters.items():
                assert state_dict[name].dtype == torch.float32, name
                assert torch.equal(state_dict[name], master.cpu()), name
        dist.barrier()
