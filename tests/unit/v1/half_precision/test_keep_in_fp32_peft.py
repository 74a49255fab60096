# Copyright (c) DeepSpeed Team.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""A model wrapped by PEFT keeps in fp32 the tensors the unwrapped model keeps.

PEFT renames what it wraps: LoRA on the router ``gate`` (an ``nn.Linear``) gives ``gate.base_layer.weight``, and
``modules_to_save=["gate"]`` gives ``gate.original_module.weight`` and ``gate.modules_to_save.default.weight``. The
model's list names ``gate.weight``, which DeepSpeed matches against the names without PEFT's wrapper segments. Plain
PyTorch with PEFT keeps these weights in fp32 too, since transformers loaded them in fp32.

* ``RouterNet``, a torch model that lists its ``nn.Linear`` router as the MoE models of transformers list theirs,
  with LoRA on the router, under ZeRO-3 and ZeRO-2 bf16: the router's frozen ``base_layer.weight`` is fp32 and exact
  through training and in the zero_to_fp32 export; LoRA's adapters train in bf16, as every adapter does.
* A tiny DeepSeek-V3 loaded by ``from_pretrained`` under ``zero.Init``, with LoRA on ``o_proj`` and
  ``modules_to_save=["gate"]``, under ZeRO-3 bf16: the frozen original router and its copy that trains are fp32;
  the original stays exact, the copy takes Adam's updates below bf16 resolution, and the export returns both exactly.
* Which names a pattern matches, with and without the wrappers, without DeepSpeed's engine.

Router weights are ``8.0 + k * 1e-4`` (k counts the elements): bf16 holds 8.0, 8.0625, ... there, so it rounds all
but the first.
"""

import pytest
import torch

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

import deepspeed  # noqa: E402
import deepspeed.comm as dist  # noqa: E402
from deepspeed.accelerator import get_accelerator  # noqa: E402
from deepspeed.runtime.keep_in_fp32 import keep_in_fp32_pattern, params_to_keep_in_fp32, unmatched_names  # noqa: E402
from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint  # noqa: E402
from unit import tiny_hf_models  # noqa: E402
from unit.common import DistributedTest  # noqa: E402

HIDDEN, EXPERTS, BATCH = 16, 4, 4
VOCAB, SEQ = tiny_hf_models.VOCAB, 8
STEPS = 2
LR = 1e-3  # an Adam step moves a parameter by about LR: below half a bf16 unit in the last place at 8 (1/32)


def _router_values(shape, offset=0.0):
    """``8.0 + offset + k * 1e-4``: values that bf16 rounds (all but the first, for offset 0)."""
    return 8.0 + offset + torch.arange(torch.Size(shape).numel(), dtype=torch.float32).view(shape) * 1e-4


class RouterNet(torch.nn.Module):
    """A router ``gate``, an ``nn.Linear`` (so that LoRA wraps it), listed for fp32 as transformers' MoE models list
    theirs, and computed in fp32 as they compute theirs, after a layer that trains in the training dtype."""
    _keep_in_fp32_modules_strict = ["gate.weight"]

    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(HIDDEN, HIDDEN)
        self.gate = torch.nn.Linear(HIDDEN, EXPERTS, bias=False)
        with torch.no_grad():
            self.gate.weight.copy_(_router_values(self.gate.weight.shape))

    def forward(self, x, y):
        logits = self.gate(torch.tanh(self.proj(x)).float())
        return torch.nn.functional.cross_entropy(logits, y)


def _lora(model, **kwargs):
    torch.manual_seed(0)
    return peft.get_peft_model(model, peft.LoraConfig(r=2, lora_alpha=4, init_lora_weights=False, **kwargs))


def _config(stage):
    return {
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
        # release every parameter after use, so that the gathers below see real partitions
        "zero_optimization": {
            "stage": stage,
            "stage3_param_persistence_threshold": 0
        },
        "bf16": {
            "enabled": True
        },
    }


def _stored_dtype(param):
    """The dtype a parameter is stored in: its partition under ZeRO-3."""
    return getattr(param, "ds_tensor", param).dtype


def _full_values(engine, names):
    """The full values of the parameters ``names`` of ``engine.module``, as stored; a collective call."""
    params = dict(engine.module.named_parameters())
    with deepspeed.zero.GatheredParameters([params[name] for name in names]):
        return {name: params[name].data.detach().clone().cpu() for name in names}


def _export(engine, path):
    """``engine``'s checkpoint in ``path``, as zero_to_fp32 exports it (every rank reads it)."""
    engine.save_checkpoint(str(path))
    dist.barrier()
    return get_fp32_state_dict_from_zero_checkpoint(str(path))


def _check_dtypes(engine, kept, adapters=True):
    """The parameters ``kept`` are stored in fp32, every other floating parameter of the model in bf16, and LoRA's
    adapters too if ``adapters``. (PEFT makes adapters fp32, and the engine leaves the parameters of a model built
    under zero.Init in the dtype they have: adapters added to such a model train in fp32, kept or not.)"""
    for name, param in engine.module.named_parameters():
        if "lora_" in name and not adapters:
            continue
        expected = torch.float32 if name in kept else torch.bfloat16
        assert _stored_dtype(param) == expected and param.dtype == expected, (name, param.dtype, _stored_dtype(param))


class TestLoraOnListedRouter(DistributedTest):
    world_size = 2
    timeout = 300

    @pytest.mark.parametrize("stage", [3, 2])
    def test_base_layer_kept_and_exported_exactly(self, stage, tmp_path):
        model = _lora(RouterNet(), target_modules=["gate", "proj"])
        name = "base_model.model.gate.base_layer.weight"
        exact = dict(model.named_parameters())[name].detach().clone()
        engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=_config(stage))
        _check_dtypes(engine, {name})
        assert torch.equal(_full_values(engine, [name])[name], exact), "the router is rounded"

        adapters = [n for n, p in engine.module.named_parameters() if p.requires_grad]
        assert adapters and all("lora_" in n for n in adapters), adapters
        before = _full_values(engine, adapters)
        gen = torch.Generator().manual_seed(1234 + dist.get_rank())
        device = get_accelerator().current_device_name()
        for _ in range(STEPS):
            x = torch.randn(BATCH, HIDDEN, generator=gen).to(device, torch.bfloat16)
            y = torch.randint(0, EXPERTS, (BATCH, ), generator=gen).to(device)
            loss = engine(x, y)
            engine.backward(loss)
            engine.step()
            assert torch.isfinite(loss)
        after = _full_values(engine, adapters + [name])
        assert any(not torch.equal(before[n], after[n]) for n in adapters), "LoRA did not train"
        _check_dtypes(engine, {name})
        assert torch.equal(after[name], exact), "the frozen router changed"

        exported = _export(engine, tmp_path)
        assert exported[name].dtype == torch.float32 and torch.equal(exported[name], exact), \
            (exported[name] - exact).abs().max()


class TestModulesToSaveDeepseekV3(DistributedTest):
    world_size = 2
    timeout = 300

    def test_router_copy_and_original_kept_and_exported_exactly(self, tmp_path):
        if not hasattr(transformers, "DeepseekV3ForCausalLM"):
            pytest.skip(f"transformers {transformers.__version__} has no DeepSeek-V3")
        path = tmp_path / "model"
        exact = {}
        model = tiny_hf_models.tiny_model("deepseek_v3")
        with torch.no_grad():
            for layer, decoder in enumerate(model.model.layers):
                decoder.mlp.gate.weight.copy_(_router_values(decoder.mlp.gate.weight.shape, offset=layer))
                exact[f"model.layers.{layer}.mlp.gate.weight"] = decoder.mlp.gate.weight.detach().clone()
        if dist.get_rank() == 0:
            model.save_pretrained(str(path))
        dist.barrier()
        del model

        config = _config(3)
        # transformers holds only a weak reference to it: it must stay alive while the model is created.
        hf_ds_config = transformers.integrations.HfDeepSpeedConfig(config)
        model = transformers.DeepseekV3ForCausalLM.from_pretrained(str(path), dtype=torch.bfloat16)
        model = _lora(model, target_modules=["o_proj"], modules_to_save=["gate"])
        engine, _, _, _ = deepspeed.initialize(model=model,
                                               model_parameters=[p for p in model.parameters() if p.requires_grad],
                                               config=config)
        del hf_ds_config
        originals = {f"base_model.model.{n[:-len('weight')]}original_module.weight": v for n, v in exact.items()}
        copies = {f"base_model.model.{n[:-len('weight')]}modules_to_save.default.weight": v for n, v in exact.items()}
        names = sorted(originals) + sorted(copies)
        _check_dtypes(engine, set(names), adapters=False)
        loaded = _full_values(engine, names)
        for name, value in {**originals, **copies}.items():
            assert torch.equal(loaded[name], value), f"{name} is rounded: {(loaded[name] - value).abs().max()}"

        gen = torch.Generator().manual_seed(1234 + dist.get_rank())
        device = get_accelerator().current_device_name()
        before = loaded
        for step in range(STEPS):
            ids = torch.randint(0, VOCAB, (2, SEQ), generator=gen).to(device)
            loss = engine(input_ids=ids, labels=ids).loss
            engine.backward(loss)
            engine.step()
            assert torch.isfinite(loss)
            after = _full_values(engine, names)
            for name in copies:
                changed = after[name] != before[name]
                below_resolution = changed & (after[name].bfloat16() == before[name].bfloat16())
                assert below_resolution.any(), f"step {step}: {name} took no update below bf16 resolution"
            before = after
        _check_dtypes(engine, set(names), adapters=False)
        for name, value in originals.items():
            assert torch.equal(after[name], value), f"the frozen {name} changed"

        exported = _export(engine, tmp_path / "ckpt")
        for name in names:
            assert exported[name].dtype == torch.float32, (name, exported[name].dtype)
            assert torch.equal(exported[name], after[name]), f"{name}: {(exported[name] - after[name]).abs().max()}"


def _kept(model, setting):
    names = {id(p): n for n, p in model.named_parameters()}
    pattern = keep_in_fp32_pattern(model, setting, torch.bfloat16)
    return sorted(names[id(p)] for p in params_to_keep_in_fp32(model, pattern)) if pattern is not None else []


class TestNames:
    """Which parameters a setting selects, on the model and on it wrapped by PEFT."""

    def test_unwrapped(self):
        model = RouterNet()
        assert _kept(model, "auto") == _kept(model, ["gate.weight"]) == ["gate.weight"]
        assert _kept(model, ["gate"]) == ["gate.weight"]
        assert _kept(model, ["proj"]) == ["proj.bias", "proj.weight"]

    def test_lora(self):
        model = _lora(RouterNet(), target_modules=["gate", "proj"])
        router = "base_model.model.gate.base_layer.weight"
        assert _kept(model, "auto") == _kept(model, ["gate.weight"]) == [router]
        assert unmatched_names(model, ["gate.weight", "proj.bias"]) == []
        # LoRA's adapters are not the model's: they are kept only by a pattern that names them, not by one that
        # names the module they adapt
        assert _kept(model, ["gate"]) == [router]
        assert _kept(model, ["gate.lora_"]) == [f"base_model.model.gate.lora_{ab}.default.weight" for ab in "AB"]
        # the names the model gives, not PEFT's wrappers
        assert unmatched_names(model, ["base_layer"]) == ["base_layer"]

    def test_modules_to_save(self):
        model = _lora(RouterNet(), target_modules=["proj"], modules_to_save=["gate"])
        kept = [
            f"base_model.model.gate.{wrapped}.weight" for wrapped in ("modules_to_save.default", "original_module")
        ]
        assert _kept(model, "auto") == _kept(model, ["gate.weight"]) == _kept(model,
                                                                              ["^base_model.model.gate"]) == kept
        assert _kept(model,
                     ["proj"]) == ["base_model.model.proj.base_layer.bias", "base_model.model.proj.base_layer.weight"]
