# Copyright (c) DeepSpeed Team.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""A resume continues as if the job had never stopped, whatever each run keeps in fp32
(``data_types.keep_in_fp32_modules``), in every stage and with every optimizer.

A run trains two steps and saves; a new engine loads it, keeping the same parameters in fp32 or others (the
checkpoint then holds other flat groups than the run, and the load moves each parameter's state to where this run
holds it). The oracle is the whole state (``_keep_in_fp32_whole_state.py``): after the load every state the
optimizer keeps for each parameter (``step`` included), its param group's hyperparameters, the loss scaler, the lr
scheduler and the engine's counters are the saved ones exactly, no two masters share a state tensor, and after two
more steps each master is what its optimizer makes of the loaded state and the gradients it was given, its ``step``
the loaded count plus two. With the same list the resumed run also equals the run that never stopped, bit for bit.
"""

import pytest
import torch

from unit.checkpoint._keep_in_fp32_whole_state import (Continuation, base_optimizer, check_masters_own_their_states,
                                                       check_whole_state, whole_state)
from unit.common import DistributedTest
from unit.v1.half_precision.test_keep_in_fp32_modules import _config, _engine, _train
from unit.v1.half_precision.test_keep_in_fp32_stages import STAGES, _stage_config, _stage_engine

# (the saving run's list, the loading run's): the same ones, and each way between layouts
PATHS = {
    "same": ("auto", "auto"),
    "none_to_auto": ([], "auto"),
    "auto_to_none": ("auto", []),
    "sink_to_norm": (["sink"], ["norm"]),
}
# the optimizer section of each optimizer; "Adam" without torch_adam is DeepSpeed's FusedAdam (its CPU build), or
# DeepSpeedCPUAdam under optimizer offload
OPTIMIZERS = {
    "adamw": {
        "type": "AdamW",
        "params": {
            "lr": 1e-5,
            "torch_adam": True
        }
    },
    "adam": {
        "type": "Adam",
        "params": {
            "lr": 1e-5,
            "torch_adam": True,
            "adam_w_mode": False
        }
    },
    "sgd": {
        "type": "SGD",
        "params": {
            "lr": 1e-3,
            "momentum": 0.9
        }
    },
    "fused_adam": {
        "type": "Adam",
        "params": {
            "lr": 1e-5
        }
    },
}
ALL_STAGES = list(STAGES) + ["zero3"]


def _resume_config(stage, keep, optimizer):
    config = _config(keep=keep) if stage == "zero3" else _stage_config(stage, keep=keep)
    config["optimizer"] = OPTIMIZERS[optimizer]
    config["zero_allow_untested_optimizer"] = True  # torch's SGD under ZeRO
    # a scheduler: its state and the initial_lr it adds to each param group are part of what a resume restores
    config["scheduler"] = {
        "type": "WarmupLR",
        "params": {
            "warmup_min_lr": 0,
            "warmup_max_lr": 1e-5,
            "warmup_num_steps": 10
        }
    }
    return config


def _resume_engine(stage, config):
    return _engine(config, zero_init=True) if stage == "zero3" else _stage_engine(stage, config)


def _cases():
    """make test runs torch's AdamW (the HF Trainer's optimizer) in every stage on the upgrade path, and in the same
    layout at ZeRO-2 and ZeRO-3; the nightly runs every optimizer, stage and path."""
    for optimizer in OPTIMIZERS:
        for stage in ALL_STAGES:
            for path in PATHS:
                case = (stage, optimizer, path)
                fast = optimizer == "adamw" and (path == "none_to_auto" or
                                                 (path == "same" and stage in ("zero2", "zero3")))
                yield case if fast else pytest.param(*case, marks=pytest.mark.nightly)


class TestResumeLosesNothing(DistributedTest):
    world_size = 2

    @pytest.mark.parametrize("stage, optimizer, path", list(_cases()))
    def test_whole_state_and_what_follows(self, stage, optimizer, path, tmp_path):
        saved_keep, loaded_keep = PATHS[path]
        config = _resume_config(stage, saved_keep, optimizer)
        engine = _resume_engine(stage, config)
        _train(engine, config, steps=2)
        engine.save_checkpoint(str(tmp_path))
        saved = whole_state(engine)

        torch.manual_seed(7)
        loaded_config = _resume_config(stage, loaded_keep, optimizer)
        loaded = _resume_engine(stage, loaded_config)
        load_path, _ = loaded.load_checkpoint(str(tmp_path))
        assert load_path is not None
        check_whole_state(whole_state(loaded), saved)
        check_masters_own_their_states(loaded)

        continuation = Continuation(loaded)
        losses = _train(loaded, loaded_config, steps=2)
        assert all(torch.isfinite(torch.tensor(losses))), losses
        continuation.check(steps=2)
        check_masters_own_their_states(loaded)
        if saved_keep == loaded_keep:  # the resumed run is the one that never stopped
            # (but for FusedAdam's CPU build, whose bias corrections follow the process's previous call: the last bits
            # of its masters, and so of the losses, may differ; see Continuation.check)
            fused_adam = type(base_optimizer(loaded)).__name__ == "FusedAdam"
            uninterrupted = _train(engine, config, steps=2)
            assert uninterrupted == losses or fused_adam and uninterrupted == pytest.approx(losses, rel=1e-5)
            check_whole_state(whole_state(loaded), whole_state(engine), "two more steps", fused_adam)


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
            del config["scheduler"]
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
