# Copyright (c) DeepSpeed Team.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""Parameters a model names for fp32 stay in fp32 under ZeRO-3 with parameter offload to NVMe.

The parameter swapper holds partitions of the training dtype. The kept partitions (norms, routers, sinks: small) live
in pinned CPU memory beside the swapped ones, in the fp32 CPU buffer of parameter offload to the CPU, as partitions
too small to swap do. A real swap folder, DeepSpeed's async I/O op (libaio) on the CPU accelerator.
"""

import pytest
import torch

import deepspeed
from deepspeed.ops.op_builder import AsyncIOBuilder
from deepspeed.runtime.swap_tensor.partitioned_param_swapper import PartitionedParamStatus
from deepspeed.runtime.zero.offload_config import OffloadDeviceEnum
from unit.checkpoint._keep_in_fp32_whole_state import (Continuation, check_masters_own_their_states,
                                                       check_whole_state, whole_state)
from unit.common import DistributedTest
from unit.v1.half_precision.test_keep_in_fp32_modules import (HIDDEN, SinkNet, _check_kept_and_updated,
                                                              _config, _engine, _gathered, _listed_names, _train)
from unit.v1.half_precision.test_keep_in_fp32_param_offload import _master_and_moments

if not deepspeed.ops.__compatible_ops__[AsyncIOBuilder.NAME]:
    pytest.skip("the async I/O op is not compatible here (libaio)", allow_module_level=True)

# Nightly (make test-all): on 2 CPU cores the async I/O op's JIT build is about 3 of these tests' 4 minutes.
pytestmark = pytest.mark.nightly

WIDE = 2**17  # a partition of HIDDEN x WIDE bf16 elements at world size 2 is over the swapper's 1 MiB minimum


class SwappedNet(SinkNet):
    """SinkNet with two matrices large enough to be swapped to NVMe; its listed parameters are too small to be."""

    def __init__(self):
        super().__init__()
        self.up = torch.nn.Linear(HIDDEN, WIDE, bias=False)
        self.down = torch.nn.Linear(WIDE, HIDDEN, bias=False)

    def forward(self, x, grad_boost=0.0):
        return super().forward(x + 1e-2 * self.down(torch.relu(self.up(x))), grad_boost)


def _nvme_config(tmp_path, keep="auto", max_in_cpu=0, optimizer_device="cpu"):
    # max_in_cpu 0: no parameter partition of the training dtype is moved into CPU memory for good, so each fetch
    # and step swaps them in and out
    offload_param = {
        "device": "nvme",
        "nvme_path": str(tmp_path),
        "pin_memory": True,
        "buffer_count": 4,
        "buffer_size": 2**20,
    }
    if max_in_cpu is not None:
        offload_param["max_in_cpu"] = max_in_cpu
    offload_optimizer = {"device": optimizer_device}
    if optimizer_device == "nvme":
        offload_optimizer["nvme_path"] = str(tmp_path)
    return _config(keep=keep, offload_param=offload_param, offload_optimizer=offload_optimizer)


def _on_nvme(param):
    return param.ds_tensor.final_location == OffloadDeviceEnum.nvme


def _check_dtypes(model, kept, swapped=True):
    """The names in ``kept`` in fp32, in CPU memory; the others in bf16, and up and down swapped out if ``swapped``
    (a swapped-out partition holds the swapper's placeholder, not its values)."""
    for name, param in model.named_parameters():
        want = torch.float32 if name in kept else torch.bfloat16
        assert param.dtype == want, f"{name} is {param.dtype}, expected {want}"
        if name in kept:
            assert param.ds_tensor.dtype == torch.float32 and param.ds_tensor.device.type == "cpu", name
            assert param.ds_tensor.status == PartitionedParamStatus.AVAILABLE and not _on_nvme(param), name
        elif not _on_nvme(param):
            assert param.ds_tensor.dtype == torch.bfloat16, name
    assert _on_nvme(model.up.weight) == _on_nvme(model.down.weight) == swapped
    assert model.bias_buf.dtype == torch.float32


class TestZeroInitWithNvme(DistributedTest):
    world_size = 2

    def test_kept_partitions_are_fp32_in_cpu_memory(self, tmp_path):
        config = _nvme_config(tmp_path)
        with deepspeed.zero.Init(config_dict_or_path=config):
            model = SwappedNet()
        _check_dtypes(model, _listed_names(model))


class TestModelBuiltWithoutZeroInit(DistributedTest):
    """A model built without zero.Init is partitioned by the engine after it keeps the listed parameters in fp32: a
    kept partition large enough to be swapped stays in CPU memory in fp32, exact, since the swapper holds the
    training dtype (it would otherwise be rounded to bf16 on its way to NVMe, silently)."""
    world_size = 2

    def test_large_kept_partition_stays_exact_in_cpu_memory(self, tmp_path):
        config = _nvme_config(tmp_path, keep=["sink", "norm", "bias_buf", "up"])
        torch.manual_seed(0)
        model = SwappedNet()
        up = model.up.weight.detach().clone()
        assert not torch.equal(up, up.bfloat16().float())
        engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
        param = engine.module.up.weight
        assert param.ds_tensor.dtype == torch.float32 and not _on_nvme(param)
        assert _on_nvme(engine.module.down.weight), "the test's other matrix is not swapped: the sizes changed"
        assert torch.equal(_gathered(param), up), "the kept matrix lost its fp32 values"


class TestNvmeTraining(DistributedTest):
    world_size = 2

    @pytest.mark.parametrize("keep, optimizer_device", [("auto", "cpu"), (["sink", "norm", "bias_buf"], "cpu"),
                                                        ("auto", "nvme")])
    def test_kept_params_train_in_fp32(self, keep, optimizer_device, tmp_path):
        config = _nvme_config(tmp_path, keep=keep, optimizer_device=optimizer_device)
        engine = _engine(config, model_cls=SwappedNet)
        kept = _listed_names(engine.module)
        _check_dtypes(engine.module, kept)
        optimizer = engine.optimizer
        assert optimizer.params_in_nvme_and_cpu
        buffer = optimizer.kept_param_flat_cpu_memory
        params = dict(engine.module.named_parameters())
        assert buffer.dtype == torch.float32 and buffer.numel() == sum(params[n].partition_numel() for n in kept)
        losses = _train(engine, config, steps=3)
        assert all(torch.isfinite(torch.tensor(losses)))
        _check_dtypes(engine.module, kept)
        _check_kept_and_updated(engine)

    def test_nothing_kept_swaps_as_stock(self, tmp_path):
        config = _nvme_config(tmp_path, keep=[])
        engine = _engine(config, model_cls=SwappedNet)
        assert not engine.optimizer.keeps_params_in_fp32 and engine.optimizer.kept_param_flat_cpu_memory is None
        _check_dtypes(engine.module, set())
        _train(engine, config, steps=1)


class TestNvmeCheckpoint(DistributedTest):
    world_size = 2

    def test_round_trip_is_exact(self, tmp_path):
        """Save after 2 steps; a new engine loads it: every master and Adam moment exact, every parameter at its
        master (the kept ones) or the master rounded, and the next 2 steps bit for bit those of the saving engine."""
        # max_in_cpu at its default: the optimizer moves every partition into CPU memory for good, as 0.19.8 needs
        # to load a checkpoint (its _rigid_load_state_dict copies into each sub-group's CPU buffer)
        config = _nvme_config(tmp_path / "swap", max_in_cpu=None)
        engine = _engine(config, model_cls=SwappedNet)
        _train(engine, config, steps=2)
        engine.save_checkpoint(str(tmp_path / "ckpt"))
        saved = {name: _master_and_moments(p) for name, p in engine.module.named_parameters()}
        saved_state = whole_state(engine)
        losses = _train(engine, config, steps=2)
        after = {name: _gathered(p) for name, p in engine.module.named_parameters()}
        after_state = whole_state(engine)
        del engine

        torch.manual_seed(7)
        loaded_config = _nvme_config(tmp_path / "swap2", max_in_cpu=None)
        loaded = _engine(loaded_config, model_cls=SwappedNet)
        loaded.load_checkpoint(str(tmp_path / "ckpt"))
        kept = _listed_names(loaded.module)
        _check_dtypes(loaded.module, kept, swapped=False)
        for name, param in loaded.module.named_parameters():
            for what, a, b in zip(("master", "exp_avg", "exp_avg_sq"), saved[name], _master_and_moments(param)):
                assert torch.equal(a, b), f"{name}: {what} differs after the load"
            value = _gathered(param)
            assert torch.equal(value, saved[name][0].to(value.dtype)), name
        check_whole_state(whole_state(loaded), saved_state)
        check_masters_own_their_states(loaded)
        assert _train(loaded, loaded_config, steps=2) == losses
        check_whole_state(whole_state(loaded), after_state, "two more steps")
        for name, param in loaded.module.named_parameters():
            assert torch.equal(_gathered(param), after[name]), name
        _check_kept_and_updated(loaded)
