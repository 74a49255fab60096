# Copyright (c) DeepSpeed Team.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""ZeRO-1/2 link each bf16 parameter to its own fp32 master and optimizer states (the fragments that
safe_get_full_fp32_param, safe_get_full_optimizer_state and a checkpoint's parameter slice mappings read):

- with round_robin_gradients, whose flat buffers hold the parameters in round-robin order;
- right after load_checkpoint, also in an engine whose optimizer stepped before the load.
"""

import torch

import deepspeed
import deepspeed.comm as dist
from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state
from unit.common import DistributedTest


class Net(torch.nn.Module):
    """Parameters of several sizes, so that a reordering shows."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(8, 6)
        self.out = torch.nn.Linear(6, 3)

    def forward(self, x):
        return self.out(torch.relu(self.lin(x))).float().pow(2).mean()


def _engine(**zero):
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
    torch.manual_seed(42)
    model = Net()
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
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


class TestLoadedOptimizerStatesLinked(DistributedTest):
    world_size = 2

    def test_accessors_read_the_loaded_states(self, tmp_path):
        saver = _engine()
        _train(saver, 2)
        saver.save_checkpoint(str(tmp_path), tag="saved")
        saved = _states(saver)
        engine = _engine()
        _train(engine, 1)  # its own states, linked at its first step
        engine.load_checkpoint(str(tmp_path), tag="saved")
        for name, (master, exp_avg, exp_avg_sq) in _states(engine).items():
            assert torch.equal(master, saved[name][0]), f"{name}: master"
            assert torch.equal(exp_avg, saved[name][1]), f"{name}: exp_avg is not the loaded one"
            assert torch.equal(exp_avg_sq, saved[name][2]), f"{name}: exp_avg_sq is not the loaded one"
