# Copyright (c) DeepSpeed Team.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""Parameters a model names for fp32 stay in fp32 with the Muon optimizer (by config, and as ``MuonWithAuxAdam``),
updated by the rule their group asks for: Muon for matrices, the auxiliary Adam for the rest, at ZeRO-1/2 and ZeRO-3.
"""

import pytest
import torch

import deepspeed
from deepspeed.utils import safe_get_full_fp32_param
from unit.checkpoint._keep_in_fp32_whole_state import check_masters_own_their_states, check_whole_state, whole_state
from unit.common import DistributedTest
from unit.v1.half_precision.test_keep_in_fp32_modules import (HIDDEN, LISTED, SinkNet, _build, _config,
                                                              _check_kept_and_updated, _gathered, _train)
from unit.v1.half_precision.test_keep_in_fp32_stages import _check_dtypes as check_dtypes

LR = 1e-5


class RouterNet(SinkNet):
    """SinkNet with a listed matrix (a router's weight, which Muon updates) next to its listed vectors (Adam's)."""
    _keep_in_fp32_modules_strict = LISTED + ["router"]

    def __init__(self):
        super().__init__()
        self.router = torch.nn.Linear(HIDDEN, HIDDEN, bias=False)

    def forward(self, x, grad_boost=0.0):
        gate = torch.softmax(self.router(x.float()), dim=-1).to(x.dtype)
        return super().forward(x * gate, grad_boost)


def _muon_config(stage, keep="auto", offload_optimizer=False):
    config = _config(keep=keep)
    config["zero_optimization"] = {"stage": stage}
    if stage == 3:
        # ZeRO-3's Muon reduces whole gradients (it refuses reduce_scatter)
        config["zero_optimization"].update(stage3_param_persistence_threshold=0, reduce_scatter=False)
    if offload_optimizer:
        config["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}
        config["zero_force_ds_cpu_optimizer"] = False
    config["optimizer"] = {"type": "Muon", "params": {"lr": LR}}
    return config


def _client_muon(model):
    from deepspeed.runtime.zero.muon.muon_optimizer import MuonWithAuxAdam
    for param in model.parameters():
        param.use_muon = len(getattr(param, "ds_shape", param.shape)) == 2  # a ZeRO-3 parameter's data is empty
    return MuonWithAuxAdam([{
        "params": [p for p in model.parameters() if p.use_muon == use_muon],
        "use_muon": use_muon,
        "lr": LR
    } for use_muon in (True, False)])


def _initialize(config, client_optimizer=False):
    model = _build(config, model_cls=RouterNet, zero_init=config["zero_optimization"]["stage"] == 3)
    if client_optimizer:
        config = dict(config)
        del config["optimizer"]
        engine, _, _, _ = deepspeed.initialize(model=model, optimizer=_client_muon(model), config=config)
    else:
        engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    return engine


def _kept(model):
    return {name for name, _ in model.named_parameters() if any(k in name for k in ("sink", "norm", "router"))}


def _check_dtypes(model):
    check_dtypes(model, _kept(model), torch.bfloat16)


def _values(model):
    return {name: _gathered(param) for name, param in model.named_parameters()}


def _check_first_step_rules(before, after):
    """Adam's first step moves every element by lr (its update is m / sqrt(v) = sign(g)); Muon's is an orthogonalized
    matrix, whose elements differ in size. Kept in fp32, both show exactly."""
    sinks = (after["attn.sinks"] - before["attn.sinks"]).abs()
    assert torch.allclose(sinks, torch.full_like(sinks, LR), rtol=0.1), f"the sinks did not take Adam's step: {sinks}"
    router = (after["router.weight"] - before["router.weight"]).abs()
    assert router.max() > 1.5 * router.min() and router.max() > LR / 10, f"the router did not take Muon's: {router}"


class TestMuonKeepsListedParams(DistributedTest):
    world_size = 2

    @pytest.mark.parametrize("keep, stage", [
        ("auto", 2),
        (LISTED + ["router"], 3),
        *[
            pytest.param(keep, stage, marks=pytest.mark.nightly)
            for keep, stage in (("auto", 1), ("auto", 3), (LISTED + ["router"], 1), (LISTED + ["router"], 2))
        ],
    ])
    def test_by_config(self, keep, stage):
        # ZeRO-1, 2 and 3, "auto" and an explicit list (two in the fast subset, the others nightly: Muon's steps
        # take seconds on the CPU)
        config = _muon_config(stage, keep)
        engine = _initialize(config)
        _check_dtypes(engine.module)
        assert engine.module.router.weight.use_muon and not engine.module.attn.sinks.use_muon
        before = _values(engine.module)
        _train(engine, config, steps=1)
        _check_first_step_rules(before, _values(engine.module))
        losses = _train(engine, config, steps=2)
        assert all(torch.isfinite(torch.tensor(losses)))
        _check_dtypes(engine.module)
        _check_kept_and_updated(engine)
        router = _gathered(engine.module.router.weight)
        assert torch.equal(router, safe_get_full_fp32_param(engine.module.router.weight).cpu())
        assert not torch.equal(router, router.bfloat16().float()), "the router is on the bf16 grid"

    @pytest.mark.parametrize("stage", [pytest.param(2, marks=pytest.mark.nightly), 3])
    def test_muon_with_aux_adam(self, stage):
        config = _muon_config(stage)
        engine = _initialize(config, client_optimizer=True)
        _check_dtypes(engine.module)
        before = _values(engine.module)
        _train(engine, config, steps=1)
        _check_first_step_rules(before, _values(engine.module))
        _train(engine, config, steps=1)
        _check_kept_and_updated(engine)

    @pytest.mark.nightly
    def test_with_optimizer_offload(self):
        config = _muon_config(2, offload_optimizer=True)
        engine = _initialize(config)
        _check_dtypes(engine.module)
        before = _values(engine.module)
        _train(engine, config, steps=1)
        _check_first_step_rules(before, _values(engine.module))
        _check_kept_and_updated(engine)


class TestMuonCheckpoint(DistributedTest):
    world_size = 2

    @pytest.mark.parametrize("stage", [pytest.param(2, marks=pytest.mark.nightly), 3])
    def test_round_trip_is_exact(self, stage, tmp_path):
        """Save after 2 steps; a new engine loads it: its next 2 steps are bit for bit those of the saving engine
        (losses and every parameter), Muon's momentum and Adam's moments restored."""
        config = _muon_config(stage)
        engine = _initialize(config)
        _train(engine, config, steps=2)
        engine.save_checkpoint(str(tmp_path))
        saved = _values(engine.module)
        saved_state = whole_state(engine)
        losses = _train(engine, config, steps=2)
        after = _values(engine.module)
        after_state = whole_state(engine)
        del engine

        torch.manual_seed(7)
        loaded = _initialize(config)
        loaded.load_checkpoint(str(tmp_path))
        _check_dtypes(loaded.module)
        for name, value in _values(loaded.module).items():
            assert value.dtype == saved[name].dtype and torch.equal(value, saved[name]), f"{name} after the load"
        check_whole_state(whole_state(loaded), saved_state)
        check_masters_own_their_states(loaded)
        # ZeRO applies Muon's momentum (momentum_buffer in the optimizer's state) to the gradient before the step, so
        # a replay of the step alone (Continuation) cannot reproduce it: the run that never stopped is the reference
        assert _train(loaded, config, steps=2) == losses
        check_whole_state(whole_state(loaded), after_state, "two more steps")
        for name, value in _values(loaded.module).items():
            assert torch.equal(value, after[name]), f"{name} differs 2 steps after the load"

    # RouterNet's forward needs its router in fp32: each list keeps it
    @pytest.mark.parametrize(
        "saved_keep, loaded_keep",
        [(["router"], "auto"), pytest.param("auto", ["router"], marks=pytest.mark.nightly)],
        ids=["more_kept", "less_kept"])
    @pytest.mark.parametrize("stage", [pytest.param(2, marks=pytest.mark.nightly), 3])
    def test_other_layout_loads_the_whole_state(self, stage, saved_keep, loaded_keep, tmp_path):
        """Saved keeping one list, loaded keeping another: at ZeRO-3 the whole state (Muon's momentum, Adam's moments,
        the steps, every master) as saved, and training goes on. ZeRO-1/2 hold Muon's momentum as whole parameters
        (those of each rank's partition), not laid out as the fp32 partition: the load refuses to move it, on every
        rank, naming the way out, where it would have scattered it."""
        config = _muon_config(stage, keep=saved_keep)
        engine = _initialize(config)
        _train(engine, config, steps=2)
        engine.save_checkpoint(str(tmp_path))
        saved_state = whole_state(engine)
        del engine

        config = _muon_config(stage, keep=loaded_keep)
        torch.manual_seed(7)
        loaded = _initialize(config)
        if stage != 3:
            with pytest.raises(ValueError, match="'momentum_buffer' .* not laid out as the partition"):
                loaded.load_checkpoint(str(tmp_path))
            return
        loaded.load_checkpoint(str(tmp_path))
        check_whole_state(whole_state(loaded), saved_state)
        check_masters_own_their_states(loaded)
        assert all(torch.isfinite(torch.tensor(_train(loaded, config, steps=2))))
