# Copyright (c) DeepSpeed Team.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""A ZeRO-3 load that moves a checkpoint's states into other sub-groups (another ``data_types.keep_in_fp32_modules``)
does what a load of the same sub-groups does at its edges:

- it fails on every rank where one rank finds its file cannot be loaded, with that rank's error: no rank goes on to
  wait for the others at a later collective (here rank 1's file holds a sub-group of another size than the
  checkpoint's parameters; rank 0's file is fine);
- a checkpoint saved before the first step (no optimizer state yet) gives the run its saved param groups'
  hyperparameters, as stock's load does;
- with pipeline_loading_checkpoint, where the ranks load one after the other, it makes no collective (it would wait
  for a rank that waits for it);
- it says so, once, on rank 0, at info level: how many parameters it moves, from which kept list to which.
"""

import glob
import os

import pytest
import torch

import deepspeed.comm as dist
from deepspeed.checkpoint.constants import FP32_FLAT_GROUPS, OPTIMIZER_STATE_DICT
from deepspeed.utils import safe_get_full_fp32_param
from unit.common import DistributedTest
from unit.v1.half_precision.test_keep_in_fp32_modules import _config, _engine, _info_logged, _train


def _save_keeping_nothing(tmp_path):
    """A checkpoint of one step keeping nothing in fp32 (the sub-groups of DeepSpeed 0.19.8): its folder, and the
    engine that saved it."""
    save_dir = str(tmp_path / "ckpt")
    config = _config(keep=[])
    engine = _engine(config)
    _train(engine, config, steps=1)
    engine.save_checkpoint(save_dir, tag="step1")
    return save_dir, engine


class TestZero3Remap(DistributedTest):
    world_size = 2

    def test_every_rank_raises_the_first_error(self, tmp_path):
        save_dir, _ = _save_keeping_nothing(tmp_path)
        dist.barrier()
        if dist.get_rank() == 0:
            (path, ) = glob.glob(os.path.join(save_dir, "step1", "*zero_pp_rank_1_*optim_states.pt"))
            checkpoint = torch.load(path, weights_only=False)
            flat_groups = checkpoint[OPTIMIZER_STATE_DICT][FP32_FLAT_GROUPS]
            flat_groups[0] = flat_groups[0][:-1].clone()
            torch.save(checkpoint, path)
        dist.barrier()

        loaded = _engine(_config(keep="auto"))  # keeps the sinks: other sub-groups than the checkpoint's
        with pytest.raises(RuntimeError, match="failed on data parallel rank 1: .*other sizes than its parameters"):
            loaded.load_checkpoint(save_dir, tag="step1")

    def test_hyperparameters_of_a_checkpoint_without_state(self, tmp_path):
        save_dir = str(tmp_path / "ckpt")
        config = _config(keep=[])
        config["optimizer"]["params"].update(lr=2e-5, betas=[0.8, 0.9], weight_decay=0.125)
        engine = _engine(config)
        engine.save_checkpoint(save_dir, tag="step0")  # before any step: the optimizer holds no state
        saved = [{
            key: value
            for key, value in group.items() if key != "params"
        } for group in engine.optimizer.optimizer.param_groups]

        loaded = _engine(_config(keep="auto"))
        assert loaded.load_checkpoint(save_dir, tag="step0")[0] is not None
        got = [{
            key: value
            for key, value in group.items() if key != "params"
        } for group in loaded.optimizer.optimizer.param_groups]
        assert got == saved

    def test_serial_load(self, tmp_path):
        """With pipeline_loading_checkpoint the ranks of a node load one after the other (each waits for the one
        before it): a load into other sub-groups makes no collective that would wait for the next one."""
        save_dir, engine = _save_keeping_nothing(tmp_path)
        saved = {name: safe_get_full_fp32_param(param) for name, param in engine.module.named_parameters()}

        loaded = _engine(_config(keep="auto", pipeline_loading_checkpoint=True))
        assert loaded.load_checkpoint(save_dir, tag="step1")[0] is not None
        for name, param in loaded.module.named_parameters():
            assert torch.equal(safe_get_full_fp32_param(param), saved[name]), name

    def test_a_load_into_other_sub_groups_says_so(self, tmp_path):
        save_dir, _ = _save_keeping_nothing(tmp_path)

        for keep in ("auto", []):
            loaded = _engine(_config(keep=keep))
            kept = sorted(name for name, param in loaded.module.named_parameters()
                          if param.ds_tensor.dtype == torch.float32)
            with _info_logged() as records:
                assert loaded.load_checkpoint(save_dir, tag="step1")[0] is not None
            said = [
                record.getMessage() for record in records
                if "keep_in_fp32_modules: the checkpoint" in record.getMessage()
            ]
            expected = [
                f"keep_in_fp32_modules: the checkpoint kept 0 parameters in fp32 (data_types.keep_in_fp32_modules "
                f"[]), this run keeps {len(kept)} ('auto'): the fp32 masters and optimizer states of {len(kept)} "
                f"parameters move between the flat groups of the training dtype and of fp32 ({', '.join(kept[:3])}, ...)."
            ] if keep == "auto" and dist.get_rank() == 0 else []
            assert len(kept) > 3 if keep == "auto" else not kept
            assert said == expected, (said, expected)
