# Copyright (c) DeepSpeed Team.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""A rank that holds only padding of a kept group resumes as the others do.

The resume matrix (every stage, optimizer and path, with the whole-state oracle) is test_checkpoint_conformance.py;
this module keeps the case it does not make: a kept group so small that at data-parallel size 4 ranks 1 to 3 hold
only its padding.
"""

import pytest
import torch

from unit.checkpoint._keep_in_fp32_whole_state import (Continuation, base_optimizer, check_masters_own_their_states,
                                                       check_whole_state, whole_state)
from unit.common import DistributedTest
from unit.v1.half_precision.test_keep_in_fp32_stages import _stage_config

# the optimizer section of each optimizer; "Adam" without torch_adam is DeepSpeed's FusedAdam (its CPU build)
OPTIMIZERS = {
    "adamw": {
        "type": "AdamW",
        "params": {
            "lr": 1e-5,
            "torch_adam": True
        }
    },
    "fused_adam": {
        "type": "Adam",
        "params": {
            "lr": 1e-5
        }
    },
}


def _resume_config(stage, keep, optimizer):
    config = _stage_config(stage, keep=keep)
    config["optimizer"] = OPTIMIZERS[optimizer]
    return config


class TinyKeptNet(torch.nn.Module):
    """A kept parameter of 2 elements: at data-parallel size 4, ranks 1 to 3 hold only padding of its group."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)
        self.sink = torch.nn.Parameter(torch.full((2, ), 8.0) + 1e-4 * torch.arange(2))

    def forward(self, x):
        return ((self.lin(x) + self.sink.sum().to(x.dtype))**2).float().mean()


class TestResumeOnPaddingOnlyRanks(DistributedTest):
    """A rank that holds only padding of a kept group still steps that group's master: after a load into other flat
    groups it holds the group's states and step as the other ranks do. FusedAdam reads the step of a param group's
    last master, the kept one: without it those ranks restarted Adam's bias corrections."""
    world_size = 4

    # torch's AdamW in the fast subset, FusedAdam's CPU build in the nightly matrix
    @pytest.mark.parametrize("optimizer", [pytest.param("fused_adam", marks=pytest.mark.nightly), "adamw"])
    @pytest.mark.parametrize("stage", ["zero2", "zero1_bf16_optimizer"])
    def test_every_master_resumes(self, stage, optimizer, tmp_path):
        import deepspeed
        import deepspeed.comm as dist

        def engine(keep):
            config = _resume_config(stage, keep, optimizer)
            torch.manual_seed(0)
            model = TinyKeptNet()
            result, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
            return result

        def train(model_engine, steps):
            for step in range(steps):
                gen = torch.Generator().manual_seed(10 * step + dist.get_rank())
                model_engine.backward(model_engine(torch.randn(2, 8, generator=gen).bfloat16()))
                model_engine.step()

        saving = engine([])
        train(saving, 2)
        saving.save_checkpoint(str(tmp_path))
        saved = whole_state(saving)
        loaded = engine(["sink"])
        assert loaded.load_checkpoint(str(tmp_path))[0] is not None
        check_whole_state(whole_state(loaded), saved)
        check_masters_own_their_states(loaded)
        optimizer_state = base_optimizer(loaded).state
        assert all(optimizer_state[p] for group in base_optimizer(loaded).param_groups for p in group["params"]), \
            "a master holds no state after the load"
        continuation = Continuation(loaded)
        train(loaded, 2)
        continuation.check(steps=2)
