# Copyright (c) DeepSpeed Team.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""Parameters kept in fp32 (``data_types.keep_in_fp32_modules``) next to the ZeRO-3 settings that meet them.

hpZ (secondary partitions), an fp32 ``communication_data_type`` (one gradient bucket for both dtypes), an fp32
``grad_accum_dtype``, expert parallelism, several optimizer parameter groups, tied weights with one name listed,
and frozen listed parameters: in each, the kept parameters stay fp32, hold their exact values and take updates
below bf16's resolution while the rest trains in bf16.

Where it can be exact, it is: at world size 2 a reduced gradient is (g0 + g1) / 2, which a plain copy of the model
computes bit for bit from each rank's batch, so the kept parameters' gradients are compared with torch.equal.
"""

import pytest
import torch

import deepspeed
import deepspeed.comm as dist
from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_grad
from unit.common import DistributedTest
from unit.v1.half_precision.test_keep_in_fp32_modules import (HIDDEN, SINK_VALUES, SinkNet, _batch, _build,
                                                              _check_dtypes, _check_kept_and_updated, _config, _engine,
                                                              _gathered, _listed_names, _train)

BF16 = torch.bfloat16


def _replica(engine, model_cls, **kwargs):
    """A plain (unpartitioned) copy of ``engine.module``: every parameter's full value, in its dtype."""
    params = dict(engine.module.named_parameters())
    replica = model_cls(**kwargs)
    for name, p in replica.named_parameters():
        p.data = _gathered(params[name])
        p.requires_grad_(params[name].requires_grad)
    for name, b in replica.named_buffers():
        b.data = engine.module.get_buffer(name).detach().clone()
    return replica


def _reference_grads(replica, config, micro_steps=(0, )):
    """The gradients ZeRO-3 should hold after these micro steps, computed by ``replica`` from every rank's batch:
    per micro step the mean over the ranks (of the loss divided by the number of micro steps, as the engine scales
    it), rounded to the parameter's dtype, then summed over the micro steps in fp32."""
    world_size = dist.get_world_size()
    params = {name: p for name, p in replica.named_parameters() if p.requires_grad}
    total = {}
    for step in micro_steps:
        per_rank = []
        for rank in range(world_size):
            gen = torch.Generator().manual_seed(1000 * step + rank)
            x = torch.randn(2, HIDDEN, generator=gen).to(BF16)
            loss = replica(x) / len(micro_steps)
            per_rank.append(dict(zip(params, torch.autograd.grad(loss, list(params.values())))))
        for name in params:
            mean = sum((g[name].float() for g in per_rank[1:]), per_rank[0][name].float()) / world_size
            mean = mean.to(params[name].dtype)
            total[name] = mean.float() if name not in total else total[name] + mean.float()
    return total


def _check_grads(engine, expected, exact=True):
    """The reduced gradients of the kept parameters equal ``expected`` (bit for bit when ``exact``); the others
    agree to bf16's precision."""
    for name, p in engine.module.named_parameters():
        if not p.requires_grad:
            assert safe_get_full_grad(p) is None, name
            continue
        grad = safe_get_full_grad(p)
        if p.ds_tensor.dtype == torch.float32:
            if exact:
                assert torch.equal(grad, expected[name]), f"{name}: {grad} != {expected[name]}"
            else:
                scale = expected[name].abs().max()
                torch.testing.assert_close(grad, expected[name], rtol=0, atol=1e-6 * scale, msg=name)
        else:
            torch.testing.assert_close(grad, expected[name], rtol=2e-2, atol=1e-3, msg=name)


def _step_with_exact_grads(engine, config, model_cls=SinkNet, exact=True, **kwargs):
    """One optimizer step (all its micro steps), checking the reduced gradients before it against a replica's."""
    ga = engine.gradient_accumulation_steps()
    expected = _reference_grads(_replica(engine, model_cls, **kwargs), config, micro_steps=range(ga))
    for micro in range(ga):
        loss = engine(_batch(micro, config))
        engine.backward(loss)
        if micro < ga - 1:
            engine.step()
    _check_grads(engine, expected, exact=exact)
    engine.step()


def _check_secondary_partitions(model, kept, hpz):
    """Every parameter's secondary partition has its dtype and holds its slice of the full value exactly."""
    rank_in_group = dist.get_rank() % hpz
    for name, p in model.named_parameters():
        secondary = p.ds_secondary_tensor
        assert secondary is not None, f"{name} has no secondary partition"
        want = torch.float32 if name in kept else BF16
        assert secondary.dtype == want, f"the secondary partition of {name} is {secondary.dtype}, not {want}"
        full = _gathered(p).view(-1)
        start = secondary.numel() * rank_in_group
        numel = max(0, min(full.numel() - start, secondary.numel()))
        assert torch.equal(secondary[:numel], full[start:start + numel]), f"{name}: secondary partition differs"


class TestHierarchicalPartitioning(DistributedTest):
    """hpZ: every rank also holds a secondary partition of each parameter, over its hpZ group of 2 ranks, that
    backward gathers from; the secondary partitions of kept parameters are fp32 and exact too."""
    world_size = 4

    def test_secondary_partitions_are_fp32(self):
        hpz = 2
        config = _config(zero_hpz_partition_size=hpz)
        engine = _engine(config)
        model = engine.module
        kept = _listed_names(model)
        _check_dtypes(model, kept, BF16)

        expected = _reference_grads(_replica(engine, SinkNet), config)
        loss = engine(_batch(0, config))
        # the first forward releases every module's parameters to their secondary partitions
        _check_secondary_partitions(model, kept, hpz)
        engine.backward(loss)  # which gathers from them
        # four ranks sum their gradients in an order of gloo's: close, not bit for bit
        _check_grads(engine, expected, exact=False)
        engine.step()

        loss = engine(_batch(1, config))
        engine.backward(loss)
        _check_secondary_partitions(model, kept, hpz)  # made from the updated values
        engine.step()
        _check_kept_and_updated(engine)


class TestSharedGradientBuckets(DistributedTest):
    """Gradient reduction and accumulation settings that put both dtypes through one fp32 path."""
    world_size = 2

    @staticmethod
    def _trains_exactly(config):
        engine = _engine(config)
        _check_dtypes(engine.module, _listed_names(engine.module), BF16)
        _step_with_exact_grads(engine, config)
        losses = _train(engine, config, steps=1)
        assert all(torch.isfinite(torch.tensor(losses)))
        _check_kept_and_updated(engine)

    def test_fp32_communication_data_type(self):
        """Both dtypes reduce their gradients in the one fp32 bucket."""
        config = _config()
        config["communication_data_type"] = "fp32"
        self._trains_exactly(config)

    def test_fp32_grad_accum_dtype(self):
        """The bf16 parameters accumulate their gradients in fp32 as well, over two micro steps."""
        config = _config(ga=2)
        config["data_types"] = {"grad_accum_dtype": "fp32"}
        self._trains_exactly(config)


def _adam_w_step(value, grad, group):
    """What torch's AdamW makes of ``value`` in its first step with ``grad`` and the hyperparameters of
    ``group``."""
    p = torch.nn.Parameter(value.clone())
    p.grad = grad.clone()
    hyper = {k: group[k] for k in ("lr", "betas", "eps", "weight_decay", "amsgrad")}
    torch.optim.AdamW([p], **hyper, foreach=False).step()
    return p.detach()


DECAY = 0.5  # a step then decays a weight w by lr * DECAY * w, many times the last bit of w


class TestParamGroups(DistributedTest):
    """transformers' decay / no-decay split: two parameter groups, a listed parameter in each, and each listed
    parameter takes its own group's weight decay."""
    world_size = 2

    def test_decay_and_no_decay(self):
        config = _config()
        model = _build(config)
        no_decay = ["bias", "norm.weight", "sink_gate"]
        named = list(model.named_parameters())
        groups = [
            {
                "params": [p for n, p in named if not any(k in n for k in no_decay)],
                "weight_decay": DECAY
            },
            {
                "params": [p for n, p in named if any(k in n for k in no_decay)],
                "weight_decay": 0.0
            },
        ]
        engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=groups, config=config)
        kept = _listed_names(model)
        _check_dtypes(model, kept, BF16)
        assert [g["weight_decay"] for g in engine.optimizer.param_groups] == [DECAY, 0.0]
        assert isinstance(engine.optimizer.optimizer, torch.optim.AdamW)
        # attn.sinks decays, the other kept parameters do not
        decay_of = {n: (DECAY if not any(k in n for k in no_decay) else 0.0) for n, _ in named}
        assert {decay_of[n] for n in kept} == {0.0, DECAY}

        params = dict(model.named_parameters())
        kept = sorted(kept)  # the same order on every rank: each read is a collective
        before = {n: safe_get_full_fp32_param(params[n]) for n in kept}
        expected = _reference_grads(_replica(engine, SinkNet), config)
        loss = engine(_batch(0, config))
        engine.backward(loss)
        _check_grads(engine, expected)
        grads = {n: safe_get_full_grad(params[n]) for n in kept}
        engine.step()
        group = dict(engine.optimizer.param_groups[0])
        told_apart = set()
        for n in kept:
            after = safe_get_full_fp32_param(params[n])
            want = _adam_w_step(before[n], grads[n], {**group, "weight_decay": decay_of[n]})
            other = _adam_w_step(before[n], grads[n], {**group, "weight_decay": DECAY - decay_of[n]})
            # the optimizer steps on the flat sub-group, whose vectorized kernels may round the last bit of an
            # element differently from a step on the parameter alone
            torch.testing.assert_close(after, want, rtol=3e-7, atol=1e-10, msg=f"{n}: not the step of its group")
            if not torch.allclose(want, other, rtol=3e-6, atol=0):  # norm.bias is zero, and decays to zero
                told_apart.add(n)
        assert {"attn.sinks", "attn.sink_gate", "norm.weight"} <= told_apart, told_apart
        losses = _train(engine, config, steps=1)
        assert all(torch.isfinite(torch.tensor(losses)))
        _check_kept_and_updated(engine)


class RecordingLinear(torch.nn.Linear):
    """Computes in the dtype of its weight, and records the weight it sees."""

    def forward(self, h):
        self.seen = self.weight.detach().clone()
        return super().forward(h.to(self.weight.dtype))


class TiedNet(torch.nn.Module):
    """``out.weight`` is ``emb.weight``: one parameter with two names."""

    def __init__(self):
        super().__init__()
        self.emb = RecordingLinear(HIDDEN, HIDDEN, bias=False)
        self.mid = RecordingLinear(HIDDEN, HIDDEN)
        self.out = RecordingLinear(HIDDEN, HIDDEN, bias=False)
        self.out.weight = self.emb.weight

    def forward(self, x):
        return self.out(self.mid(self.emb(x))).float().pow(2).mean()


TIED_VALUES = 0.5 + 1e-4 * torch.arange(HIDDEN * HIDDEN, dtype=torch.float32).view(HIDDEN, HIDDEN)


class TestTiedWeights(DistributedTest):
    """A tied weight is one parameter: listing either of its names keeps it in fp32, under both. ``out.weight``
    is the name that ``named_parameters()`` does not yield."""
    world_size = 2

    def test_one_name_listed(self):
        for listed in ("emb.weight", "out.weight"):
            config = _config(keep=[listed])
            with deepspeed.zero.Init(config_dict_or_path=config):
                model = TiedNet()
            with deepspeed.zero.GatheredParameters([model.emb.weight], modifier_rank=0):
                if dist.get_rank() == 0:
                    model.emb.weight.data.copy_(TIED_VALUES)
            engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
            tied = model.emb.weight
            assert model.out.weight is tied
            assert tied.dtype == tied.ds_tensor.dtype == torch.float32, listed
            assert model.mid.weight.ds_tensor.dtype == model.mid.bias.ds_tensor.dtype == BF16
            assert torch.equal(_gathered(model.out.weight), TIED_VALUES), listed

            _step_with_exact_grads(engine, config, model_cls=TiedNet)  # the fp32 gradient holds both uses
            loss = engine(_batch(1, config))
            engine.backward(loss)
            engine.step()

            master = safe_get_full_fp32_param(tied)
            with torch.no_grad():
                engine(_batch(9, config))
            for module in (model.emb, model.out):
                assert module.seen.dtype == torch.float32, listed
                assert torch.equal(module.seen, master), f"{listed}: a forward saw another value than the master"
            assert torch.equal(_gathered(model.emb.weight), master), listed
            assert torch.equal(_gathered(model.out.weight), master), listed
            assert not torch.equal(master, TIED_VALUES), f"{listed}: the tied weight did not move"
            assert (master - TIED_VALUES).abs().max() < 1e-3
            assert not torch.equal(master, master.bfloat16().float()), f"{listed}: the tied weight is on the bf16 grid"


class TestFrozen(DistributedTest):
    """A frozen listed parameter stays fp32 at its exact value; the rest trains. Once with one of them frozen,
    once with every listed parameter frozen (no fp32 sub-group left to train)."""
    world_size = 2

    def test_frozen_listed_params(self):
        for frozen in (["attn.sinks"], ["attn.sinks", "attn.sink_gate", "norm.weight", "norm.bias"]):
            config = _config()
            model = _build(config)
            for name, p in model.named_parameters():
                p.requires_grad_(name not in frozen)
            trainable = [p for p in model.parameters() if p.requires_grad]
            engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=trainable, config=config)
            kept = _listed_names(model)
            _check_dtypes(model, kept, BF16)
            before = {name: _gathered(p) for name, p in model.named_parameters()}
            masters = {name: safe_get_full_fp32_param(p) for name, p in model.named_parameters() if p.requires_grad}
            assert torch.equal(before["attn.sinks"], SINK_VALUES)

            _step_with_exact_grads(engine, config)
            losses = _train(engine, config, steps=1)
            assert all(torch.isfinite(torch.tensor(losses)))

            for name, p in model.named_parameters():
                value = _gathered(p)
                assert value.dtype == p.ds_tensor.dtype == (torch.float32 if name in kept else BF16), name
                if name in frozen:
                    assert torch.equal(value, before[name]), f"frozen {name} changed"
                    continue
                master = safe_get_full_fp32_param(p)
                assert not torch.equal(master, masters[name]), f"{name} did not train"
                assert torch.equal(value, master.to(value.dtype)), name
                if name in kept:
                    assert torch.equal(value, master), name
                    assert not torch.equal(value, value.bfloat16().float()), f"{name} is on the bf16 grid"
            assert torch.equal(_gathered(model.attn.sinks), SINK_VALUES)


EXPERTS, FFN = 2, 4
GATE_VALUES = 0.25 + 1e-4 * torch.arange(EXPERTS * HIDDEN, dtype=torch.float32).view(EXPERTS, HIDDEN)
W2_VALUES = 0.125 + 1e-4 * torch.arange(EXPERTS * HIDDEN * FFN, dtype=torch.float32).view(EXPERTS, HIDDEN, FFN)


class Experts(torch.nn.Module):
    """SwiGLU experts stored as 3-D tensors, as transformers 5 stores them."""

    def __init__(self):
        super().__init__()
        self.w1 = torch.nn.Parameter(torch.randn(EXPERTS, FFN, HIDDEN) * 0.3)
        self.w2 = torch.nn.Parameter(torch.randn(EXPERTS, HIDDEN, FFN) * 0.3)
        self.w3 = torch.nn.Parameter(torch.randn(EXPERTS, FFN, HIDDEN) * 0.3)


class MoEBlock(torch.nn.Module):
    """A top-1 MoE block; AutoEP replaces it (and its forward) with an expert-parallel layer."""

    def __init__(self):
        super().__init__()
        self.gate = torch.nn.Linear(HIDDEN, EXPERTS, bias=False)
        self.experts = Experts()

    def forward(self, h):
        raise AssertionError("AutoEP did not replace the MoE block")


class MoENet(torch.nn.Module):

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(HIDDEN, HIDDEN)
        self.moe = MoEBlock()
        self.out = torch.nn.Linear(HIDDEN, 3)

    def forward(self, x):
        h = self.lin(x)
        return self.out(h + self.moe(h)).float().pow(2).mean()


def _gate_input_dtype(router, x):
    """The dtype of the input AutoEP's router hands its gate."""
    seen = []
    handle = router.gate.register_forward_pre_hook(lambda module, args: seen.append(args[0].dtype))
    try:
        router(x)
    finally:
        handle.remove()
    return seen[0]


class TestAutoEPRouterInput:
    """AutoEP's router projects in fp32 when its gate is kept in fp32, and hands its gate the activations as stock
    0.19.8 does otherwise: under DeepSpeed's torch autocast (fp32 weights, bf16 activations) no fp32 copy of the
    router's input is made."""

    def _router(self, dtype):
        from deepspeed.moe.ep_router import TokenChoiceTopKRouter
        torch.manual_seed(0)
        return TokenChoiceTopKRouter(HIDDEN, EXPERTS, None, None, 1, "softmax", False, 1.0, False).to(dtype)

    def test_autocast_nothing_kept(self):
        router = self._router(torch.float32)
        x = torch.randn(4, HIDDEN).to(BF16)
        with torch.autocast("cpu", dtype=BF16):
            assert _gate_input_dtype(router, x) == BF16

    def test_kept_gate(self):
        from deepspeed.runtime.keep_in_fp32 import keep_param_in_fp32
        router = self._router(BF16)
        keep_param_in_fp32(router.gate.weight, BF16)
        assert _gate_input_dtype(router, torch.randn(4, HIDDEN).to(BF16)) == torch.float32


class TestExpertParallel(DistributedTest):
    """ZeRO-3 with expert parallelism: AutoEP, the MoE that ZeRO-3 takes in 0.19.8 (the engine refuses
    deepspeed.moe.layer.MoE under ZeRO-3, _validate_zero3_moe_compatibility). The router's weight and one expert
    weight are listed; 2 experts over 2 ranks, so each rank holds one expert and its own expert-data-parallel
    group."""
    world_size = 2

    def test_listed_router_and_expert_weights(self):
        config = _config(keep=["gate.weight", "experts.w2"])
        config["expert_parallel"] = {
            "enabled": True,
            "autoep_size": 2,
            "moe_layer_pattern": "moe",
            "expert_w1": "w1",
            "expert_w2": "w2",
            "expert_w3": "w3",
            "top_k": 1,
            "use_grouped_mm": False,
        }
        torch.manual_seed(42)
        with deepspeed.zero.Init(config_dict_or_path=config):
            model = MoENet()
        block = model.moe
        assert block.gate.weight.ds_tensor.dtype == block.experts.w2.ds_tensor.dtype == torch.float32
        with deepspeed.zero.GatheredParameters([block.gate.weight, block.experts.w2], modifier_rank=0):
            if dist.get_rank() == 0:
                block.gate.weight.data.copy_(GATE_VALUES)
                block.experts.w2.data.copy_(W2_VALUES)
        engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
        model = engine.module
        kept = {"moe.router.gate.weight", "moe.experts.w2"}
        params = dict(model.named_parameters())
        assert kept <= set(params), sorted(params)
        for name, param in params.items():
            want = torch.float32 if name in kept else BF16
            assert param.dtype == param.ds_tensor.dtype == want, f"{name} is {param.ds_tensor.dtype}, not {want}"
        rank = dist.get_rank()  # ep_rank: rank r holds expert r
        initial = {"moe.router.gate.weight": GATE_VALUES, "moe.experts.w2": W2_VALUES[rank:rank + 1]}
        for name in sorted(kept):
            assert torch.equal(_gathered(params[name]), initial[name]), f"{name} lost its fp32 value"

        for step in range(2):
            x = torch.randn(2, 4, HIDDEN, generator=torch.Generator().manual_seed(1000 * step + rank)).to(BF16)
            loss = engine(x)
            assert torch.isfinite(loss)
            engine.backward(loss)
            engine.step()

        for name in sorted(kept):
            param = params[name]
            value, master = _gathered(param), safe_get_full_fp32_param(param)
            assert value.dtype == master.dtype == torch.float32, name
            assert torch.equal(value, master), f"{name}: the gathered value differs from its fp32 master"
            assert not torch.equal(value, initial[name]), f"{name} did not move"
            assert (value - initial[name]).abs().max() < 1e-3, name
            assert not torch.equal(value, value.bfloat16().float()), f"{name} is on the bf16 grid"
