# Copyright (c) DeepSpeed Team.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""``data_types.keep_in_fp32_modules`` with real transformers models loaded by ``from_pretrained`` under ZeRO-3.

Rank 0 builds a tiny DeepSeek-V4 or gpt-oss model (random init, ``torch.manual_seed``), gives the parameters the
model's lists or ``["sinks", "norm"]`` name values with fine structure (uniform in [0.5, 1.5): fp32 values that bf16 and fp16 round, and far
enough from zero that an Adam step of ``LR`` is below half a bf16/fp16 unit in the last place there) and saves it in
fp32 with ``save_pretrained`` (safetensors). It also records what transformers itself makes of the file without
DeepSpeed: the fp32 value of every parameter, and which parameters a plain ``from_pretrained(dtype=half)`` keeps in
fp32 (the model's own lists, as transformers applies them).

Every rank then loads the model with ``from_pretrained(dir, dtype=half)`` while an ``HfDeepSpeedConfig`` is alive,
so ``zero.Init`` runs and transformers' ZeRO-3 loader writes the checkpoint into the partitioned parameters. Every
parameter must then equal the plain load cast to its dtype, except those that loader is known to drop
(``DROPPED_UNDER_ZERO3``: DeepSeek-V4's final norm under transformers 5.24.0, see test_keep_in_fp32_zero3_load.py),
which are loaded by hand with ``reload_from_checkpoint``, the workaround our docs give. Then
``deepspeed.initialize``. The checks, on the gathered full parameters, against the plain load ("the file"):

* every parameter the list selects is fp32, in its partition too, and bit-exact to the file; their number equals
  the number of fp32 parameters, and for ``"auto"`` the set equals the one transformers keeps by itself;
* every other floating parameter is in the training dtype and equals the file's value rounded to it;
* three training steps give finite losses and finite parameters, and after every step each kept parameter holds
  changes the training dtype could not hold (``new != old`` where ``new.to(half) == old.to(half)``), and its
  gathered value equals its fp32 master (``safe_get_full_fp32_param``).

``keep_in_fp32_modules: []`` (and gpt-oss under bf16 ``"auto"``: its ``_keep_in_fp32_modules`` are kept only under
fp16) gives parameters all in the training dtype.
"""

import json
import re

import pytest
import torch

transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

import deepspeed  # noqa: E402
import deepspeed.comm as dist  # noqa: E402
from deepspeed.accelerator import get_accelerator  # noqa: E402
from deepspeed.utils import safe_get_full_fp32_param  # noqa: E402
from unit import tiny_hf_models  # noqa: E402
from unit.common import DistributedTest  # noqa: E402

HALF = {"bf16": torch.bfloat16, "fp16": torch.float16}
VOCAB, SEQ, BATCH = tiny_hf_models.VOCAB, 8, 2
STEPS = 3
LR = 1e-5  # an Adam step moves a parameter by about LR: below half an ulp of bf16 and fp16 in [0.5, 1.5)


def _deepseek_v4():
    return tiny_hf_models.model_class("deepseek_v4"), tiny_hf_models.deepseek_v4_config()


def _gpt_oss():
    return tiny_hf_models.model_class("gpt_oss"), tiny_hf_models.gpt_oss_config()


MODELS = {"deepseek_v4": _deepseek_v4, "gpt_oss": _gpt_oss}

needs_deepseek_v4 = pytest.mark.skipif(not hasattr(transformers, "DeepseekV4ForCausalLM"),
                                       reason=f"transformers {transformers.__version__} has no DeepSeek-V4")
needs_gpt_oss = pytest.mark.skipif(not hasattr(transformers, "GptOssForCausalLM"),
                                   reason=f"transformers {transformers.__version__} has no gpt-oss")


def _pattern(names):
    """The names matched the way transformers matches its fp32 lists (``*`` is any characters, re.search)."""
    return re.compile("|".join(name.replace("*", ".*") for name in sorted(names))) if names else None


def _model_lists(model_cls, half):
    names = set(getattr(model_cls, "_keep_in_fp32_modules_strict", None) or [])
    if half == torch.float16:
        names |= set(getattr(model_cls, "_keep_in_fp32_modules", None) or [])
    return names


def _selected(model, model_cls, keep, half):
    """Names of the floating parameters ``keep`` (the config's setting) selects for fp32, by our own matching."""
    pattern = _pattern(_model_lists(model_cls, half) if keep == "auto" else keep)
    if pattern is None:
        return set()
    return {name for name, p in model.named_parameters() if p.is_floating_point() and pattern.search(name)}


def _ds_config(half, keep):
    config = {
        "train_micro_batch_size_per_gpu": BATCH,
        "gradient_accumulation_steps": 1,
        "steps_per_print": 1000,
        "optimizer": {
            "type": "Adam",
            "params": {
                "lr": LR,
                "torch_adam": True
            }
        },
        "zero_optimization": {
            "stage": 3,
            # release every parameter after use, so that the gathers below see real partitions
            "stage3_param_persistence_threshold": 0,
        },
        half: {
            "enabled": True
        },
    }
    if half == "fp16":
        config["fp16"]["initial_scale_power"] = 8
    if keep != "auto":  # "auto" is the default: leave it out, as users do
        config["data_types"] = {"keep_in_fp32_modules": keep}
    return config


def _allow_fp16_on_cpu():
    # The CPU accelerator reports fp16 as unsupported unless oneDNN has fp16 kernels; plain torch runs the tiny fp16
    # models here fine, so let DeepSpeed accept the config.
    accelerator = get_accelerator()
    if accelerator.device_name() == "cpu" and not accelerator.is_fp16_supported():
        accelerator.is_fp16_supported = lambda: True


# The tensors transformers' ZeRO-3 loader drops from a save_pretrained checkpoint (transformers 5.24.0, a known issue:
# test_keep_in_fp32_zero3_load.py shows it). They keep their initial values; the tests load them by hand below.
DROPPED_UNDER_ZERO3 = {"deepseek_v4": ["model.norm.weight"]}


def reload_from_checkpoint(model, checkpoint_dir, names):
    """Copy the parameters ``names`` from the safetensors checkpoint in ``checkpoint_dir`` into a ZeRO-3 model.

    Call it on every rank right after ``from_pretrained``, before ``deepspeed.initialize`` (or the Trainer) makes
    the optimizer's copies. Rank 0 reads each tensor and writes it under ``GatheredParameters(modifier_rank=0)``,
    which hands it to the other ranks' partitions. Names the checkpoint does not have are skipped (an original
    DeepSeek-V4 checkpoint names the final norm ``norm.weight``, which loads right). Returns the names copied.
    """
    import json
    import os

    import deepspeed
    import torch
    from safetensors import safe_open

    index = os.path.join(checkpoint_dir, "model.safetensors.index.json")
    if os.path.exists(index):  # a sharded checkpoint
        with open(index) as f:
            file_of = json.load(f)["weight_map"]
    else:
        with safe_open(os.path.join(checkpoint_dir, "model.safetensors"), framework="pt") as f:
            file_of = dict.fromkeys(f.keys(), "model.safetensors")
    params = dict(model.named_parameters())
    copied = []
    for name in names:
        if name not in file_of:
            continue
        param = params[name]
        with deepspeed.zero.GatheredParameters(param, modifier_rank=0):
            if torch.distributed.get_rank() == 0:
                with safe_open(os.path.join(checkpoint_dir, file_of[name]), framework="pt") as f:
                    param.data.copy_(f.get_tensor(name))
        copied.append(name)
    return copied


def differs_from(model, reference):
    """The names of the parameters of a ZeRO-3 ``model`` whose full value is not ``reference[name]`` cast to the
    dtype it holds; a collective call."""
    named = list(model.named_parameters())
    with deepspeed.zero.GatheredParameters([p for _, p in named]):
        return {name for name, p in named if not torch.equal(p.data.cpu(), reference[name].to(p.dtype))}


def _save_model(path, arch, half, keep):
    """Rank 0: build, save with save_pretrained, record what a plain from_pretrained loads from it (the reference:
    fp32, and equal to what was saved). Then all ranks meet."""
    if dist.get_rank() == 0:
        model_cls, config = MODELS[arch]()
        torch.manual_seed(0)
        model = model_cls(config)
        fine = _pattern(_model_lists(model_cls, torch.float16) | {"sinks", "norm"})
        with torch.no_grad():
            for name, p in model.named_parameters():
                if fine.search(name):
                    p.copy_(torch.rand_like(p) + 0.5)
        model.save_pretrained(str(path))
        written = {name: p.detach().clone() for name, p in model.named_parameters()}
        assert all(p.dtype == torch.float32 for p in written.values())

        # The file holds the fp32 values (DeepSeek-V4 is saved mostly under its original checkpoint names, which
        # from_pretrained maps back; the names both use are compared directly).
        saved = safetensors_torch.load_file(str(path / "model.safetensors"))
        assert all(t.dtype == torch.float32 for t in saved.values() if t.is_floating_point())
        common = set(saved) & set(written)
        assert common, "no parameter is saved under its model name"
        for name in common:
            assert torch.equal(saved[name], written[name]), name
        plain = model_cls.from_pretrained(str(path), dtype=torch.float32)
        reference = {name: p.detach().clone() for name, p in plain.named_parameters()}
        assert set(reference) == set(written)
        for name, p in reference.items():
            assert torch.equal(p, written[name]), f"transformers loads {name} differently from what was saved"

        # What transformers keeps in fp32 by itself, without DeepSpeed.
        plain = model_cls.from_pretrained(str(path), dtype=HALF[half])
        by_transformers = sorted(name for name, p in plain.named_parameters() if p.dtype == torch.float32)
        torch.save(reference, path / "reference.pt")
        with open(path / "kept_by_transformers.json", "w") as f:
            json.dump(by_transformers, f)
        del model, plain
    dist.barrier()
    reference = torch.load(path / "reference.pt")
    with open(path / "kept_by_transformers.json") as f:
        by_transformers = set(json.load(f))
    return reference, by_transformers


def _full_values(params):
    """The full (gathered) values of ``params``, as stored, copies on the CPU; a collective call."""
    with deepspeed.zero.GatheredParameters(params):
        return [p.data.detach().cpu().clone() for p in params]


def _check_and_train(tmp_path, arch, half, keep):
    half_dtype = HALF[half]
    path = tmp_path / arch
    reference, by_transformers = _save_model(path, arch, half, keep)

    if half == "fp16":
        _allow_fp16_on_cpu()
    ds_config = _ds_config(half, keep)
    # transformers holds only a weak reference to it: it must stay alive while the model is created.
    hf_ds_config = transformers.integrations.HfDeepSpeedConfig(ds_config)
    assert transformers.integrations.is_deepspeed_zero3_enabled()
    model_cls = MODELS[arch]()[0]
    model = model_cls.from_pretrained(str(path), dtype=half_dtype)
    assert all(hasattr(p, "ds_id") for p in model.parameters()), "zero.Init did not partition the parameters"
    # Everything equals a plain from_pretrained but the tensors of the known issue, which are loaded by hand as our
    # docs tell users to (before deepspeed.initialize, so that the optimizer starts from them).
    dropped = DROPPED_UNDER_ZERO3.get(arch, [])
    wrong = differs_from(model, reference)
    assert wrong <= set(dropped), f"from_pretrained under ZeRO-3 loads {sorted(wrong - set(dropped))} wrong"
    assert reload_from_checkpoint(model, str(path), dropped) == dropped
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds_config)
    del hf_ds_config

    named = [(name, p) for name, p in engine.module.named_parameters() if p.is_floating_point()]
    kept = _selected(engine.module, model_cls, keep, half_dtype)
    if keep == "auto":
        assert kept == by_transformers, (sorted(kept ^ by_transformers), "our matching differs from transformers'")
    assert set(reference) == {name for name, _ in named}

    # Loading: kept parameters fp32 and exact, the others in the training dtype and equal to the file rounded (the
    # file: what a plain from_pretrained loads from it).
    fp32_count = sum(p.dtype == torch.float32 for _, p in named)
    assert fp32_count == len(kept), (fp32_count, len(kept))
    values = _full_values([p for _, p in named])
    for (name, p), value in zip(named, values):
        if name in kept:
            assert p.dtype == torch.float32 and p.ds_tensor.dtype == torch.float32, (name, p.dtype, p.ds_tensor.dtype)
            assert value.dtype == torch.float32, (name, value.dtype)
            assert torch.equal(value, reference[name]), f"{name} is not bit-exact to the file"
            # the fine structure is really there: the training dtype would have lost it
            assert not torch.equal(reference[name].to(half_dtype).float(), reference[name]), name
        else:
            assert p.dtype == half_dtype and p.ds_tensor.dtype == half_dtype, (name, p.dtype, p.ds_tensor.dtype)
            assert torch.equal(value, reference[name].to(half_dtype)), f"{name} differs from the file in {half}"

    # Training: finite, and every kept parameter takes changes that the training dtype could not hold.
    kept_named = [(name, p) for name, p in named if name in kept]
    before = _full_values([p for _, p in kept_named])
    gen = torch.Generator().manual_seed(1234 + dist.get_rank())
    losses = []
    for step in range(STEPS):
        ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen).to(engine.device)
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
        assert torch.isfinite(loss), (step, losses)
        after = _full_values([p for _, p in kept_named])
        for (name, p), old, new in zip(kept_named, before, after):
            assert new.dtype == torch.float32, (step, name, new.dtype)
            master = safe_get_full_fp32_param(p)
            assert master is not None and torch.equal(new, master.to(new.device).view_as(new)), \
                f"step {step}: the gathered {name} differs from its fp32 master"
            changed = new != old
            below_resolution = changed & (new.to(half_dtype) == old.to(half_dtype))
            assert below_resolution.any(), (f"step {step}: {name} changed in {int(changed.sum())} of {new.numel()} "
                                            f"elements, none of them below {half} resolution")
        before = after
    for name, value in zip((name for name, _ in named), _full_values([p for _, p in named])):
        assert torch.isfinite(value.float()).all(), name
    if half == "fp16":
        assert engine.skipped_steps == 0, f"{engine.skipped_steps} steps skipped (loss scale overflow)"
    return kept


@needs_deepseek_v4
class TestDeepseekV4KeepInFp32(DistributedTest):
    world_size = [1, 2]
    timeout = 300

    def test_bf16_auto(self, tmp_path):
        """bf16, default "auto": the strict list (hyper-connections, sinks, position biases, norms) stays fp32."""
        kept = _check_and_train(tmp_path, "deepseek_v4", "bf16", "auto")
        assert any("attn_hc" in name for name in kept) and any("sinks" in name for name in kept)


@needs_deepseek_v4
class TestDeepseekV4KeepNothing(DistributedTest):
    world_size = 2
    timeout = 300

    def test_bf16_empty_list(self, tmp_path):
        """``keep_in_fp32_modules: []``: every floating parameter is bf16."""
        assert _check_and_train(tmp_path, "deepseek_v4", "bf16", []) == set()


@needs_gpt_oss
class TestGptOssKeepInFp32(DistributedTest):
    world_size = 2
    timeout = 300

    def test_fp16_auto(self, tmp_path):
        """fp16, "auto": gpt-oss's non-strict list (its norms) stays fp32."""
        kept = _check_and_train(tmp_path, "gpt_oss", "fp16", "auto")
        assert kept and all("norm" in name for name in kept)

    def test_bf16_auto_keeps_nothing(self, tmp_path):
        """bf16, "auto": gpt-oss has no strict list, so nothing is kept (as transformers does)."""
        assert _check_and_train(tmp_path, "gpt_oss", "bf16", "auto") == set()

    def test_bf16_explicit_list(self, tmp_path):
        """bf16 with an explicit list: the attention sinks and the norms stay fp32."""
        kept = _check_and_train(tmp_path, "gpt_oss", "bf16", ["sinks", "norm"])
        assert any("sinks" in name for name in kept) and any("norm" in name for name in kept)
