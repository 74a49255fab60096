# Copyright (c) DeepSpeed Team.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""Parameters a model names for fp32 stay in fp32 under ZeRO-3 with parameter offload (``offload_param``).

What test_keep_in_fp32_stages.py does not cover for ``zero3_offload``: where the offloaded partitions live, zero.Init
with ``remote_device`` cpu, models built without zero.Init, optimizer offload with fp16, and loads of checkpoints
saved with another setting. Offload to NVMe: test_keep_in_fp32_nvme.py.
"""

import os

import pytest
import torch

import deepspeed
from deepspeed.accelerator import get_accelerator
from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state
from unit.checkpoint._keep_in_fp32_whole_state import (Continuation, check_masters_own_their_states,
                                                       check_whole_state, whole_state)
from unit.common import DistributedTest
from unit.v1.half_precision.test_keep_in_fp32_modules import (SINK_VALUES, SinkNet, _batch,
                                                              _check_kept_and_updated, _check_dtypes, _config, _engine,
                                                              _gathered, _listed_names, _train)


def _offload_config(keep="auto", dtype="bf16", offload_optimizer=False, ga=1):
    zero = {"offload_param": {"device": "cpu", "pin_memory": True}, "ga": ga}
    if offload_optimizer:
        zero["offload_optimizer"] = {"device": "cpu"}
    return _config(keep=keep, dtype=dtype, **zero)


class TestZeroInitWithParamOffload(DistributedTest):
    world_size = 2

    def test_partitions_are_fp32_on_cpu_before_any_load(self):
        config = _offload_config()
        with deepspeed.zero.Init(config_dict_or_path=config):
            model = SinkNet()
        kept = _listed_names(model)
        for name, param in model.named_parameters():
            want = torch.float32 if name in kept else torch.bfloat16
            assert param.ds_tensor.dtype == want and param.ds_tensor.device.type == "cpu", name
        # what a checkpoint load (from_pretrained) writes into them stays exact
        with deepspeed.zero.GatheredParameters([model.attn.sinks], modifier_rank=0):
            model.attn.sinks.data.copy_(SINK_VALUES)
        assert torch.equal(_gathered(model.attn.sinks), SINK_VALUES)

    def test_kept_partitions_stay_pinned(self):
        # DeepSpeed's own page-locking (mlock) pins host memory without a GPU; torch's pinning needs one
        os.environ.update(DS_PIN_MEMORY_BACKEND="native", DS_PIN_MEMORY_REGISTER_DEVICE="0")
        config = _offload_config()
        with deepspeed.zero.Init(config_dict_or_path=config):
            model = SinkNet()
        model.attn.sinks.requires_grad_(False)  # frozen: the optimizer never moves it into a buffer of its own
        engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
        kept = _listed_names(model)
        assert "attn.sinks" in kept
        for name, param in engine.module.named_parameters():
            # asked of a view: the partition object keeps the mark of its first, pinned storage after a .data swap
            assert get_accelerator().is_pinned(param.ds_tensor.view(-1)), f"{name}'s partition is not pinned"
            assert param.ds_tensor.dtype == (torch.float32 if name in kept else torch.bfloat16), name

    def test_partitions_returned_to_the_training_dtype_stay_pinned(self):
        """A partition zero.Init kept in fp32 that the run does not keep goes back to the training dtype pinned, so
        that its copies to the device stay asynchronous."""
        os.environ.update(DS_PIN_MEMORY_BACKEND="native", DS_PIN_MEMORY_REGISTER_DEVICE="0")
        with deepspeed.zero.Init(config_dict_or_path=_offload_config()):
            model = SinkNet()
        assert model.attn.sinks.ds_tensor.dtype == torch.float32
        model.attn.sinks.requires_grad_(False)  # frozen: the optimizer never moves it into a buffer of its own
        config = _offload_config(keep=[])
        engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
        sinks = engine.module.attn.sinks
        assert sinks.dtype == torch.bfloat16 and sinks.ds_tensor.dtype == torch.bfloat16
        assert get_accelerator().is_pinned(sinks.ds_tensor.view(-1)), "the sinks' partition is no longer pinned"
        assert sinks.ds_tensor.ds_pinned_tensor.dtype == torch.bfloat16, "the fp32 pinned copy is still held"


class TestOffloadedLayout(DistributedTest):
    """The kept partitions are offloaded to an fp32 CPU buffer of their own; the training-dtype buffer holds the
    others, as it holds every parameter when nothing is kept."""
    world_size = 2

    @pytest.mark.parametrize("zero_init, offload_optimizer", [(True, False), (False, True),
                                                              pytest.param(True, True, marks=pytest.mark.nightly),
                                                              pytest.param(False, False, marks=pytest.mark.nightly)])
    def test_kept_partitions_in_an_fp32_cpu_buffer(self, zero_init, offload_optimizer):
        config = _offload_config(offload_optimizer=offload_optimizer)
        engine = _engine(config, zero_init=zero_init)
        optimizer = engine.optimizer
        kept = _listed_names(engine.module)
        _check_dtypes(engine.module, kept, torch.bfloat16)
        assert torch.equal(_gathered(engine.module.attn.sinks), SINK_VALUES)
        params = dict(engine.module.named_parameters())
        kept_numel = sum(params[name].partition_numel() for name in kept)
        other_numel = sum(p.partition_numel() for name, p in params.items() if name not in kept)
        buffer = optimizer.kept_param_flat_cpu_memory
        assert buffer.dtype == torch.float32 and buffer.device.type == "cpu" and buffer.numel() == kept_numel
        [lp_buffer] = optimizer.param_groups_fp16_flat_cpu_memory
        assert lp_buffer.dtype == torch.bfloat16 and lp_buffer.numel() == other_numel
        start, end = buffer.data_ptr(), buffer.data_ptr() + buffer.numel() * buffer.element_size()
        for name, param in params.items():
            assert (start <= param.ds_tensor.data_ptr() < end) == (name in kept), name
        # the optimizer updates an fp32 copy, as for every offloaded sub-group, and copies it back exactly
        for lp, hp in zip(optimizer.fp16_partitioned_groups_flat, optimizer.fp32_partitioned_groups_flat):
            assert lp.data_ptr() != hp.data_ptr()
        _train(engine, config, steps=2)
        _check_kept_and_updated(engine)

    def test_nothing_kept_has_one_buffer_per_group(self):
        config = _offload_config(keep=[])
        engine = _engine(config)
        optimizer = engine.optimizer
        assert not optimizer.keeps_params_in_fp32 and optimizer.kept_param_flat_cpu_memory is None
        [lp_buffer] = optimizer.param_groups_fp16_flat_cpu_memory
        assert lp_buffer.numel() == sum(p.partition_numel() for p in engine.module.parameters())
        _check_dtypes(engine.module, set(), torch.bfloat16)


class TestOffloadedTraining(DistributedTest):
    world_size = 2

    @pytest.mark.parametrize("offload_optimizer, ga", [
        pytest.param(False, 1, marks=pytest.mark.nightly), (False, 2),
        pytest.param(True, 1, marks=pytest.mark.nightly),
        pytest.param(True, 2, marks=pytest.mark.nightly)
    ])
    def test_update_survives_without_zero_init(self, offload_optimizer, ga):
        config = _offload_config(offload_optimizer=offload_optimizer, ga=ga)
        engine = _engine(config, zero_init=False)
        losses = _train(engine, config, steps=3)
        assert all(torch.isfinite(torch.tensor(losses)))
        _check_dtypes(engine.module, _listed_names(engine.module), torch.bfloat16)
        _check_kept_and_updated(engine)

    @pytest.mark.parametrize("offload_optimizer", [False, True])
    def test_fp16_overflow_in_fp32_gradient_skips_the_step(self, offload_optimizer):
        config = _offload_config(dtype="fp16", offload_optimizer=offload_optimizer)
        engine = _engine(config)
        _check_dtypes(engine.module, _listed_names(engine.module), torch.float16)
        _train(engine, config, steps=1)
        before = {name: safe_get_full_fp32_param(p) for name, p in engine.module.named_parameters()}
        scale = engine.optimizer.loss_scale
        loss = engine(_batch(1, config), grad_boost=1e30)  # only the sinks' fp32 gradient overflows
        assert torch.isfinite(loss)
        engine.backward(loss)
        engine.step()
        assert engine.skipped_steps == 1 and engine.optimizer.loss_scale == scale / 2
        for name, param in engine.module.named_parameters():
            assert torch.equal(safe_get_full_fp32_param(param), before[name]), f"{name} changed in a skipped step"
        _train(engine, config, steps=2)
        _check_kept_and_updated(engine)


def _master_and_moments(param):
    moments = [safe_get_full_optimizer_state(param, key) for key in ("exp_avg", "exp_avg_sq")]
    return [safe_get_full_fp32_param(param)] + moments


class TestOffloadedCheckpoints(DistributedTest):
    world_size = 2

    @pytest.mark.parametrize("saved_keep, loaded_keep", [([], "auto"), ("auto", []), ("auto", "auto")])
    def test_load_with_this_or_another_setting(self, saved_keep, loaded_keep, tmp_path):
        """Every master and Adam moment exact after the load; kept parameters at their master, the others at it
        rounded; the Adam step goes on from the saved one."""
        saved_config = _offload_config(keep=saved_keep, offload_optimizer=True)
        engine = _engine(saved_config)
        _train(engine, saved_config, steps=2)
        engine.save_checkpoint(str(tmp_path))
        saved = {name: _master_and_moments(p) for name, p in engine.module.named_parameters()}
        saved_state = whole_state(engine)

        config = _offload_config(keep=loaded_keep)
        torch.manual_seed(7)
        loaded = _engine(config)
        loaded.load_checkpoint(str(tmp_path))
        kept = _listed_names(loaded.module) if loaded_keep == "auto" else set()
        _check_dtypes(loaded.module, kept, torch.bfloat16)
        for name, param in loaded.module.named_parameters():
            for what, a, b in zip(("master", "exp_avg", "exp_avg_sq"), saved[name], _master_and_moments(param)):
                assert torch.equal(a, b), f"{name}: {what} differs after the load"
            value = _gathered(param)
            assert torch.equal(value, saved[name][0].to(value.dtype)), name
        check_whole_state(whole_state(loaded), saved_state)
        check_masters_own_their_states(loaded)
        continuation = Continuation(loaded)
        losses = _train(loaded, config, steps=2)
        continuation.check(steps=2)
        assert all(torch.isfinite(torch.tensor(losses)))
        optimizer = loaded.optimizer
        steps = [int(optimizer.optimizer.state[flat]["step"]) for flat in optimizer.fp32_partitioned_groups_flat]
        assert steps == [4] * len(steps), steps
        if loaded_keep == "auto":
            _check_kept_and_updated(loaded)
