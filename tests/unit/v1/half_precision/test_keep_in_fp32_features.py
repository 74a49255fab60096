# Copyright (c) DeepSpeed Team.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""The features that hold parameters of one dtype, and so cannot keep a parameter in fp32: ZeRO++ quantized weights
and gradients, SuperOffload, ZenFlow, DeepCompile, bf16/fp16 master weights, ZeRO-1/2's
elastic_checkpoint and MoE expert param groups, FusedLamb and optimizer.legacy_fusion without ZeRO.

With the default ``"auto"`` a model that lists parameters trains with any of them as DeepSpeed 0.19.8 trains it: the
parameters the feature would round train in the training dtype, with one warning that names the feature and the
parameters. An explicit list is refused at ``deepspeed.initialize``, naming both ways out.
"""

import pytest
import torch

import deepspeed
from unit.common import DistributedTest
from unit.v1.half_precision.test_keep_in_fp32_modules import MoENet, SinkNet, _build, _capture_warnings, _config, _train
from unit.v1.half_precision.test_keep_in_fp32_stages import _stage_config


# feature: (the stage, a change of its config, whether the feature trains on the CPU accelerator, as far as 0.19.8
# trains it there)
FEATURES = {
    "zero_quantized_gradients": ("zero3", lambda c: c["zero_optimization"].update(zero_quantized_gradients=True),
                                 False),
    "zero_quantized_weights": ("zero3", lambda c: c["zero_optimization"].update(zero_quantized_weights=True), False),
    "zero_quantized_nontrainable_weights":
    ("zero3", lambda c: c["zero_optimization"].update(zero_quantized_nontrainable_weights=True), False),
    "super_offload": ("zero3", lambda c: c["zero_optimization"].update(offload_optimizer={
        "device": "cpu",
        "super_offload": True
    }), False),
    "zenflow": ("zero2", lambda c: c["zero_optimization"].update(offload_optimizer={"device": "cpu"},
                                                                  zenflow={"topk_ratio": 0.5}), False),
    "bf16_master_weights_and_grads": ("zero2", lambda c: c["bf16"].update(bf16_master_weights_and_grads=True),
                                      False),
    "compile.deepcompile": ("zero3", lambda c: c.update(compile={"deepcompile": True}), False),
    "elastic_checkpoint": ("zero2", lambda c: c["zero_optimization"].update(elastic_checkpoint=True), True),
    "legacy_fusion without ZeRO": ("zero0", lambda c: c["optimizer"].update(legacy_fusion=True), False),
    "FusedLamb without ZeRO": ("zero0", lambda c: c["optimizer"].update(type="Lamb"), False),
}


# "auto" with these in the fast subset (make test), with the others in the nightly matrix
FAST_AUTO_CASES = ["zero_quantized_gradients", "compile.deepcompile", "elastic_checkpoint"]


def _feature_config(feature, keep):
    stage, change, _ = FEATURES[feature]
    if stage == "zero3":
        config = _config(keep=keep)
    else:
        config = _stage_config(stage, keep=keep)
    if change is not None:
        change(config)
    if feature in ("legacy_fusion without ZeRO", "FusedLamb without ZeRO"):
        del config["optimizer"]["params"]["torch_adam"]
    return config


class BufferOnlyNet(SinkNet):
    _keep_in_fp32_modules_strict = ["bias_buf"]


def _initialize(config, model):
    return deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)[0]


class TestFeaturesThatRoundKeptParams(DistributedTest):
    world_size = 1

    @pytest.mark.parametrize("feature", FEATURES)
    def test_explicit_list_is_refused_naming_both_ways_out(self, feature):
        config = _feature_config(feature, ["sink", "norm"])
        with pytest.raises(ValueError, match=rf"keep_in_fp32_modules keeps 4 parameters in fp32, which .*{feature}"
                           r".*To keep them in fp32: .*keep_in_fp32_modules to \[\] to train them in"):
            _initialize(config, _build(config, zero_init=False))

    @pytest.mark.parametrize("feature", [
        feature if feature in FAST_AUTO_CASES else pytest.param(feature, marks=pytest.mark.nightly)
        for feature in FEATURES
    ])
    def test_auto_trains_as_before_with_one_warning(self, feature):
        # the decision is made before the feature is set up: a feature this CPU accelerator cannot run stops after
        # it, where 0.19.8 stops too
        config = _feature_config(feature, "auto")
        records = _capture_warnings()
        trains_here = FEATURES[feature][2]
        try:
            engine = _initialize(config, _build(config, zero_init=False))
        except Exception:
            if trains_here:
                raise
            engine = None
        messages = [r.getMessage() for r in records if "keep_in_fp32_modules" in r.getMessage()]
        assert len(messages) == 1, messages
        assert "4 parameters the model names for fp32 (attn.sinks, attn.sink_gate, norm.weight, norm.bias) train " \
            f"in torch.bfloat16" in messages[0] and feature in messages[0], messages[0]
        if engine is not None:
            for name, param in engine.module.named_parameters():
                assert getattr(param, "ds_tensor", param).dtype == torch.bfloat16, name
            assert engine.module.bias_buf.dtype == torch.float32  # the buffers it names are kept
        if trains_here:
            _train(engine, config, steps=1)

    @pytest.mark.parametrize("keep", [["bias_buf"], "auto"])
    def test_a_list_of_buffers_only_asks_nothing_of_the_feature(self, keep):
        # a list that names no parameter keeps its buffers with any feature on: nothing refused, nothing warned
        config = _feature_config("elastic_checkpoint", keep)
        records = _capture_warnings()
        engine = _initialize(config, _build(config, model_cls=BufferOnlyNet, zero_init=False))
        assert not [r.getMessage() for r in records if "keep_in_fp32_modules" in r.getMessage()]
        assert engine.module.bias_buf.dtype == torch.float32
        assert engine.module.attn.sinks.dtype == torch.bfloat16
        _train(engine, config, steps=1)


def _check_moe_row(stage, keep, refusal, feature):
    """deepspeed.initialize of MoENet's expert param groups at ``stage`` keeping ``keep``, where a row of the engine's
    table names ``feature``: an explicit list is refused (``refusal``: the error's pattern), and "auto" trains every
    parameter in bf16 with one warning that names ``feature``. Returns the engine after a step, or None."""
    from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer
    config = _stage_config(stage, keep=keep)
    torch.manual_seed(42)
    model = MoENet()
    groups = split_params_into_different_moe_groups_for_optimizer({"params": list(model.parameters()), "name": "p"})
    if keep != "auto":
        with pytest.raises(ValueError, match=refusal):
            deepspeed.initialize(model=model, model_parameters=groups, config=config)
        return None
    records = _capture_warnings()
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=groups, config=config)
    messages = [r.getMessage() for r in records if "keep_in_fp32_modules" in r.getMessage()]
    assert len(messages) == 1 and feature in messages[0], messages
    for name, param in engine.module.named_parameters():
        assert param.dtype == torch.bfloat16, name
    engine.backward(engine(torch.randn(16, 8, dtype=torch.bfloat16)))
    engine.step()
    return engine


class TestKeptExpertParams(DistributedTest):
    """ZeRO-1/2 reduce the gradients of an MoE expert param group in one dtype: the expert parameters a model lists
    train in bf16 under "auto"."""
    world_size = 2

    @pytest.mark.parametrize("keep", ["auto", ["sinks"]])
    def test_expert_params(self, keep):
        _check_moe_row(
            "zero2", keep, r"the MoE expert param groups of ZeRO-2.*name no expert parameter.*"
            r"keep_in_fp32_modules to \[\]", "MoE expert param groups")


class TestBf16OptimizerWithMoELayers(DistributedTest):
    """The BF16 optimizer keeps nothing in fp32 in a model with MoE layers yet (no test runs it there): "auto" trains
    the listed parameters in bf16 with one warning, and an explicit list is refused, naming ZeRO-1's own optimizer."""
    world_size = 2

    @pytest.mark.parametrize("keep", ["auto", ["sinks"]],
                             ids=["zero1_bf16_optimizer-auto", "zero1_bf16_optimizer-list"])
    def test_moe_layers(self, keep):
        engine = _check_moe_row(
            "zero1_bf16_optimizer", keep, r"the BF16 optimizer with MoE layers.*grad_accum_dtype "
            r"bf16.*keep_in_fp32_modules to \[\]", "the BF16 optimizer with MoE layers")
        assert engine is None or type(engine.optimizer).__name__ == "BF16_Optimizer"
