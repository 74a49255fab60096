# Copyright (c) DeepSpeed Team.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""Consolidating ZeRO checkpoints (``deepspeed/utils/zero_to_fp32.py``), on checkpoints written by real engines.

Every test trains a tiny model with ``deepspeed.initialize`` for a few steps, records on the ranks what the
checkpoint must give back (the fp32 master of every trainable parameter, the half-precision value of every frozen
parameter, the buffers) and calls ``engine.save_checkpoint``; rank 0 then consolidates the checkpoint and compares
with ``torch.equal``.

The contract checked: ``get_fp32_state_dict_from_zero_checkpoint`` returns every floating tensor as fp32 (frozen
parameters too, which have no fp32 master and are saved in the model's dtype), or in ``dtype`` when one is given;
``dtype=None`` and ``lazy_mode=True`` return what the checkpoint holds; the file exports are fp32; and the engine's
own ZeRO-3 load with ``load_optimizer_states=False`` does not materialize an fp32 copy of the frozen weights.
"""

import contextlib
import io
import json
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

import deepspeed
import deepspeed.comm as dist
from deepspeed.accelerator import get_accelerator
from deepspeed.utils import safe_get_full_fp32_param
from deepspeed.utils.zero_to_fp32 import (convert_zero_checkpoint_to_fp32_state_dict,
                                          get_fp32_state_dict_from_zero_checkpoint)
from unit.common import DistributedTest

HALF = {"bf16": torch.bfloat16, "fp16": torch.float16}
VOCAB, HIDDEN, INNER = 37, 13, 17  # odd sizes: the ZeRO partitions of every tensor need padding
STEPS = 3
SHARD = "1KB"  # the smallest size split_torch_state_dict_into_shards takes; the models here are a few KB


class TinyNet(torch.nn.Module):
    """Embedding, LayerNorm, a trainable and a frozen Linear, an output head tied to the embedding (optionally),
    a half-precision buffer, an integer buffer and a non-persistent one."""

    def __init__(self, half_dtype, tied=True):
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, HIDDEN)
        self.norm = torch.nn.LayerNorm(HIDDEN)
        self.proj = torch.nn.Linear(HIDDEN, INNER)
        self.frozen = torch.nn.Linear(INNER, HIDDEN)
        self.frozen.requires_grad_(False)
        self.head = torch.nn.Linear(HIDDEN, VOCAB, bias=False)
        if tied:
            self.head.weight = self.embed.weight
        self.register_buffer("offset", torch.linspace(-1, 1, HIDDEN).to(half_dtype))
        self.register_buffer("counts", torch.arange(5))
        self.register_buffer("scratch", torch.ones(3), persistent=False)

    def param_groups(self):
        decay = [self.proj.weight, self.proj.bias]
        no_decay = [self.embed.weight, self.norm.weight, self.norm.bias]
        if self.head.weight is not self.embed.weight:
            no_decay.append(self.head.weight)
        return [{"params": no_decay, "weight_decay": 0.0}, {"params": decay, "weight_decay": 0.1, "lr": 2e-2}]

    def forward(self, ids):
        h = self.embed(ids) + self.offset.to(self.embed.weight.dtype)
        h = self.frozen(F.relu(self.proj(self.norm(h))))
        logits = self.head(h)
        return F.cross_entropy(logits.float().reshape(-1, VOCAB), ids.reshape(-1))


class LoraNet(torch.nn.Module):
    """A frozen base Linear with a trainable low-rank adapter next to it."""

    def __init__(self):
        super().__init__()
        self.base = torch.nn.Linear(32, 24)
        self.base.requires_grad_(False)
        self.lora_a = torch.nn.Linear(32, 3, bias=False)
        self.lora_b = torch.nn.Linear(3, 24, bias=False)

    def forward(self, x):
        x = x.to(self.base.weight.dtype)
        return (self.base(x) + self.lora_b(self.lora_a(x))).float().pow(2).mean()


def _ds_config(stage, half):
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "steps_per_print": 1000,
        "optimizer": {
            "type": "Adam",
            "params": {
                "lr": 1e-2,
                "torch_adam": True
            }
        },
        "zero_optimization": {
            "stage": stage
        },
        half: {
            "enabled": True
        },
    }
    if half == "fp16":
        config["fp16"]["initial_scale_power"] = 8
    if stage == 3:
        # release every parameter after use, so that the checkpoint and the gathers below see real partitions
        config["zero_optimization"]["stage3_param_persistence_threshold"] = 0
    return config


def _allow_fp16_on_cpu():
    # The CPU accelerator reports fp16 as unsupported unless oneDNN has fp16 kernels; plain torch runs the tiny fp16
    # models here fine, so let the engine accept the config.
    accelerator = get_accelerator()
    if accelerator.device_name() == "cpu" and not accelerator.is_fp16_supported():
        accelerator.is_fp16_supported = lambda: True


def _train(model, stage, half, batch_fn, params=None):
    if half == "fp16":
        _allow_fp16_on_cpu()
    params = params if params is not None else [p for p in model.parameters() if p.requires_grad]
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=params, config=_ds_config(stage, half))
    gen = torch.Generator().manual_seed(1234 + dist.get_rank())
    for _ in range(STEPS):
        loss = engine(batch_fn(gen).to(engine.device))
        engine.backward(loss)
        engine.step()
    return engine


def _token_batch(gen):
    return torch.randint(0, VOCAB, (2, 6), generator=gen)


def _reference(engine):
    """What the checkpoint must give back, by state_dict key; a collective call (gathers under ZeRO-3).

    Trainable parameters: their fp32 master. Frozen parameters: their (half-precision) value in the model. Buffers:
    as the model holds them. Returns (values, names of the frozen parameters)."""
    module = engine.module
    values, frozen = {}, set()
    for name, param in module.named_parameters(remove_duplicate=False):
        if param.requires_grad:
            master = safe_get_full_fp32_param(param)
            assert master is not None and master.dtype == torch.float32, name
            values[name] = master.detach().cpu().clone()
        else:
            with deepspeed.zero.GatheredParameters(param):
                values[name] = param.detach().cpu().clone()
            frozen.add(name)
    persistent = set(module.state_dict().keys())
    for name, buf in module.named_buffers():
        if name in persistent:
            values[name] = buf.detach().cpu().clone()
    assert set(values) == persistent, (sorted(values), sorted(persistent))
    return values, frozen


def _train_and_save(model, stage, half, ckpt_dir, batch_fn=_token_batch, params=None):
    engine = _train(model, stage, half, batch_fn, params)
    reference, frozen = _reference(engine)
    half_dtype = HALF[half]
    for name, value in reference.items():
        if name in frozen:
            assert value.dtype == half_dtype, (name, value.dtype)
        elif value.is_floating_point() and value.dtype == torch.float32 and name.endswith("weight"):
            # the masters moved off the half-precision grid, so they are told apart from a half copy upcast
            assert not torch.equal(value, value.to(half_dtype).float()), f"{name}: master is not finer than {half}"
    engine.save_checkpoint(ckpt_dir)
    dist.barrier()
    return engine, reference, frozen


def _check(state_dict, reference, frozen, dtype, what, exclude_frozen=False):
    """Keys, dtypes and values of a consolidated ``state_dict`` against ``reference``.

    ``dtype``: the dtype every floating tensor must have, or None for "what the checkpoint holds": the model's
    half precision for frozen parameters, fp32 for the rest (masters, and buffers, which zero_to_fp32 upcasts)."""
    expected_keys = {k for k in reference if not (exclude_frozen and k in frozen)}
    assert set(state_dict) == expected_keys, f"{what}: keys {sorted(state_dict)} != {sorted(expected_keys)}"
    for name in sorted(expected_keys):
        want, got = reference[name], state_dict[name]
        if hasattr(got, "contiguous") and not isinstance(got, torch.Tensor):
            got = got.contiguous()  # a lazy-mode GatheredTensor
        if not want.is_floating_point():
            want_dtype = want.dtype
        elif dtype is not None:
            want_dtype = dtype
        else:
            want_dtype = want.dtype if name in frozen else torch.float32
        assert got.dtype == want_dtype, f"{what}: {name} is {got.dtype}, expected {want_dtype}"
        assert got.shape == want.shape, f"{what}: {name} has shape {tuple(got.shape)}, expected {tuple(want.shape)}"
        assert torch.equal(got, want.to(want_dtype)), f"{what}: {name} differs from the model's value"


def _read_export(out_dir, safe, sharded):
    """Load what convert_zero_checkpoint_to_fp32_state_dict / zero_to_fp32.py wrote to ``out_dir``."""
    if safe:
        from safetensors.torch import load_file
        load, single, index = load_file, "model.safetensors", "model.safetensors.index.json"
    else:
        load = lambda path: torch.load(path, map_location="cpu", weights_only=True)
        single, index = "pytorch_model.bin", "pytorch_model.bin.index.json"
    files = sorted(os.listdir(out_dir))
    if not sharded:
        assert files == [single], files
        return load(os.path.join(out_dir, single))
    assert index in files, files
    with open(os.path.join(out_dir, index)) as f:
        weight_map = json.load(f)["weight_map"]
    shards = sorted(set(weight_map.values()))
    assert len(shards) > 1, f"expected several shards, got {shards}"
    assert sorted(files) == sorted(shards + [index]), files
    state_dict = {}
    for shard in shards:
        part = load(os.path.join(out_dir, shard))
        assert {k for k, v in weight_map.items() if v == shard} == set(part), shard
        state_dict.update(part)
    return state_dict


def _run_recovery_script(ckpt_dir, out_dir, *flags):
    """Run the zero_to_fp32.py that save_checkpoint copied into ``ckpt_dir``, as a user would."""
    script = os.path.join(ckpt_dir, "zero_to_fp32.py")
    assert os.path.isfile(script), f"save_checkpoint did not copy zero_to_fp32.py into {ckpt_dir}"
    env = dict(os.environ, DS_ACCELERATOR="cpu")
    result = subprocess.run([sys.executable, script, ckpt_dir, out_dir, *flags],
                            env=env,
                            capture_output=True,
                            text=True,
                            timeout=300)
    assert result.returncode == 0, f"{script} {' '.join(flags)} failed:\n{result.stdout}\n{result.stderr}"


# (world_size, stage, half, tied, zero_to_fp32.py flags). Together: both stages and half precisions, world sizes 1-3,
# tied and untied heads, and the script with and without safetensors, sharding, a tag and --exclude_frozen_parameters.
# Tied models are exported to torch files only: convert_zero_checkpoint_to_state_dict hands safetensors' save_file
# the tied names as one shared tensor, which save_file refuses ("Some tensors share memory").
ROUND_TRIP_CASES = [
    (1, 2, "bf16", True, ["--max_shard_size", SHARD]),
    (2, 2, "fp16", False, ["--safe_serialization"]),
    (3, 2, "bf16", False, ["--safe_serialization", "--max_shard_size", SHARD, "--exclude_frozen_parameters"]),
    (1, 3, "fp16", False, ["--safe_serialization", "--max_shard_size", SHARD]),
    (2, 3, "bf16", True, ["-t", f"global_step{STEPS}"]),
    (3, 3, "bf16", False, ["--safe_serialization"]),
    (3, 3, "fp16", True, ["--max_shard_size", SHARD, "--exclude_frozen_parameters"]),
]


def _case_id(case):
    world_size, stage, half, tied, _ = case
    return f"ws{world_size}-zero{stage}-{half}-{'tied' if tied else 'untied'}"


class TestRoundTrip(DistributedTest):
    """Every export path of a real checkpoint gives back the model's values, in the dtype it promises."""

    @pytest.mark.parametrize("world_size, stage, half, tied, script_flags",
                             ROUND_TRIP_CASES,
                             ids=[_case_id(c) for c in ROUND_TRIP_CASES])
    def test_round_trip(self, world_size, stage, half, tied, script_flags, tmp_path):
        torch.manual_seed(0)
        model = TinyNet(HALF[half], tied=tied)
        ckpt = str(tmp_path / "ckpt")
        _, reference, frozen = _train_and_save(model, stage, half, ckpt, params=model.param_groups())
        assert {"frozen.weight", "frozen.bias"} == frozen
        assert torch.equal(reference["head.weight"], reference["embed.weight"]) == tied

        rank = dist.get_rank()
        failures = []

        def attempt(what, fn):
            try:
                fn()
            except AssertionError as e:
                failures.append(f"{what}: {e}")

        if rank == 0:
            # in memory, eager: everything fp32
            attempt(
                "eager", lambda: _check(get_fp32_state_dict_from_zero_checkpoint(ckpt), reference, frozen, torch.
                                        float32, "eager"))
            # in memory, lazy: what the checkpoint holds
            attempt(
                "lazy", lambda: _check(get_fp32_state_dict_from_zero_checkpoint(ckpt, lazy_mode=True), reference,
                                       frozen, None, "lazy"))
            # files, written in this process
            for safe in ([False] if tied else [False, True]):
                for sharded in (False, True):
                    what = f"convert_zero_checkpoint_to_fp32_state_dict(safe={safe}, sharded={sharded})"
                    out = str(tmp_path / f"convert-{safe}-{sharded}")

                    def convert_and_check(out=out, safe=safe, sharded=sharded, what=what):
                        convert_zero_checkpoint_to_fp32_state_dict(ckpt,
                                                                   out,
                                                                   max_shard_size=SHARD if sharded else None,
                                                                   safe_serialization=safe)
                        _check(_read_export(out, safe, sharded), reference, frozen, torch.float32, what)

                    attempt(what, convert_and_check)

        if rank == world_size - 1:
            # the recovery script in the checkpoint folder, in a fresh process
            out = str(tmp_path / "script")
            what = f"zero_to_fp32.py {' '.join(script_flags)}"

            def script_and_check():
                _run_recovery_script(ckpt, out, *script_flags)
                exported = _read_export(out, "--safe_serialization" in script_flags, "--max_shard_size"
                                        in script_flags)
                _check(exported, reference, frozen, torch.float32, what, "--exclude_frozen_parameters" in script_flags)

            attempt(what, script_and_check)

        assert not failures, "\n".join(failures)


class TestFrozenParamDtype(DistributedTest):
    """The eager path upcasts frozen half-precision parameters; lazy mode and ``dtype=None`` keep them."""

    @pytest.mark.parametrize("world_size, stage, half", [(1, 2, "bf16"),
                                                         pytest.param(1, 2, "fp16", marks=pytest.mark.nightly),
                                                         pytest.param(2, 3, "bf16", marks=pytest.mark.nightly),
                                                         (2, 3, "fp16")])
    def test_eager_upcasts_frozen_params(self, world_size, stage, half, tmp_path):
        torch.manual_seed(0)
        ckpt = str(tmp_path / "ckpt")
        _, reference, frozen = _train_and_save(TinyNet(HALF[half]), stage, half, ckpt)
        if dist.get_rank() != 0:
            return
        state_dict = get_fp32_state_dict_from_zero_checkpoint(ckpt)
        for name in sorted(frozen):
            assert state_dict[name].dtype == torch.float32, f"frozen {name} came back as {state_dict[name].dtype}"
        _check(state_dict, reference, frozen, torch.float32, "eager")
        # dtype names another precision: every floating tensor in it, the integer buffer untouched
        _check(get_fp32_state_dict_from_zero_checkpoint(ckpt, dtype=torch.bfloat16), reference, frozen, torch.bfloat16,
               "eager, dtype=torch.bfloat16")

    @pytest.mark.parametrize("world_size, stage", [(1, 2), (2, 3)])
    def test_lazy_keeps_frozen_bf16(self, world_size, stage, tmp_path):
        torch.manual_seed(0)
        ckpt = str(tmp_path / "ckpt")
        _, reference, frozen = _train_and_save(TinyNet(torch.bfloat16), stage, "bf16", ckpt)
        if dist.get_rank() != 0:
            return
        state_dict = get_fp32_state_dict_from_zero_checkpoint(ckpt, lazy_mode=True)
        for name in sorted(frozen):
            assert state_dict[name].dtype == torch.bfloat16, f"lazy frozen {name} is {state_dict[name].dtype}"
        _check(state_dict, reference, frozen, None, "lazy")

    @pytest.mark.parametrize("world_size, stage", [(1, 3), (2, 2)])
    def test_dtype_none_keeps_checkpoint_dtypes(self, world_size, stage, tmp_path):
        torch.manual_seed(0)
        ckpt = str(tmp_path / "ckpt")
        _, reference, frozen = _train_and_save(TinyNet(torch.bfloat16), stage, "bf16", ckpt)
        if dist.get_rank() != 0:
            return
        printed = io.StringIO()
        with contextlib.redirect_stdout(printed):
            state_dict = get_fp32_state_dict_from_zero_checkpoint(ckpt, dtype=None)
        # the frozen parameters are what the checkpoint holds, bf16, and the log does not call them fp32
        assert "Reconstructed Frozen state dict" in printed.getvalue(), printed.getvalue()
        assert "Frozen fp32" not in printed.getvalue(), printed.getvalue()
        assert state_dict["frozen.weight"].dtype == torch.bfloat16
        assert state_dict["proj.weight"].dtype == torch.float32
        _check(state_dict, reference, frozen, None, "dtype=None")


class TestEngineLoadKeepsFrozenDtype(DistributedTest):
    """ZeRO-3 ``load_checkpoint(load_optimizer_states=False)`` builds its state dict with
    get_fp32_state_dict_from_zero_checkpoint; it must not materialize an fp32 copy of the frozen weights."""
    world_size = 2

    def test_zero3_load_without_optimizer_keeps_frozen_bf16(self, tmp_path):
        import deepspeed.runtime.engine as engine_module

        torch.manual_seed(0)
        ckpt = str(tmp_path / "ckpt")
        _, reference, frozen = _train_and_save(TinyNet(torch.bfloat16), 3, "bf16", ckpt)

        torch.manual_seed(1)  # a fresh engine with other values, so that the load visibly changes them
        fresh = _train(TinyNet(torch.bfloat16), 3, "bf16", _token_batch)

        calls = []
        original = engine_module.get_fp32_state_dict_from_zero_checkpoint

        def spy(*args, **kwargs):
            state_dict = original(*args, **kwargs)
            calls.append({name: tensor.dtype for name, tensor in state_dict.items()})
            return state_dict

        engine_module.get_fp32_state_dict_from_zero_checkpoint = spy
        try:
            load_path, _ = fresh.load_checkpoint(ckpt, load_optimizer_states=False, load_lr_scheduler_states=False)
        finally:
            engine_module.get_fp32_state_dict_from_zero_checkpoint = original
        assert load_path is not None
        assert len(calls) == 1, f"the engine built its state dict {len(calls)} times through zero_to_fp32"
        dtypes = calls[0]
        for name in sorted(frozen):
            assert dtypes[name] == torch.bfloat16, f"the engine load materialized frozen {name} as {dtypes[name]}"
        assert dtypes["proj.weight"] == torch.float32

        # and the load itself is right: frozen weights as saved, trainable ones the masters in bf16
        for name, param in fresh.module.named_parameters():
            with deepspeed.zero.GatheredParameters(param):
                value = param.detach().cpu().clone()
            assert torch.equal(value, reference[name].to(value.dtype)), f"{name} not restored by load_checkpoint"


class TestLoraExport(DistributedTest):
    """LoRA shape: a frozen bf16 base and a small trainable adapter, exported with the checkpoint's own
    zero_to_fp32.py and loaded strictly into a fresh fp32 model."""
    world_size = 2

    @pytest.mark.parametrize("stage", [2, 3])
    def test_lora_export_loads_into_fp32_model(self, stage, tmp_path):
        from safetensors.torch import load_file

        torch.manual_seed(0)
        ckpt = str(tmp_path / "ckpt")
        _, reference, frozen = _train_and_save(LoraNet(),
                                               stage,
                                               "bf16",
                                               ckpt,
                                               batch_fn=lambda g: torch.randn((2, 32), generator=g))
        assert frozen == {"base.weight", "base.bias"}
        if dist.get_rank() != 0:
            return
        out = str(tmp_path / "export")
        _run_recovery_script(ckpt, out, "--safe_serialization")
        state_dict = load_file(os.path.join(out, "model.safetensors"))
        assert {name: t.dtype for name, t in state_dict.items()} == {name: torch.float32 for name in reference}

        fresh = LoraNet()  # fp32
        fresh.load_state_dict(state_dict, strict=True)
        for name, value in fresh.state_dict().items():
            assert value.dtype == torch.float32
            assert torch.equal(value, reference[name].float()), f"{name} differs after export and load"
