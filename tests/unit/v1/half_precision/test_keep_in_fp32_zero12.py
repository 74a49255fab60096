# Copyright (c) DeepSpeed Team.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""ZeRO-1 and ZeRO-2 keep the parameters a model names for fp32 in fp32: what test_keep_in_fp32_stages.py does not
cover for them.

- A checkpoint lays out its fp32 partitions and optimizer states per group of one dtype: one saved keeping other
  parameters in fp32 loads parameter by parameter, every master and Adam moment exact; ds_to_universal with
  checkpoint.load_universal moves it exactly too.
- The kept groups are partitioned over the data parallel ranks like every other group: optimizer memory divides by
  the data parallel size, kept parameters included.
- offload_states: test_keep_in_fp32_offload_states.py; elastic_checkpoint and MoE expert param groups:
  test_keep_in_fp32_features.py.
- The gradient reduction options train with the kept parameters exact: the other gradients reduced in fp32 too
  (communication_data_type fp32, also with overlap_comm), overlap_comm, contiguous_gradients off,
  round_robin_gradients.
"""

import os

import pytest
import torch

import deepspeed
import deepspeed.comm as dist
from deepspeed.checkpoint.constants import UNIVERSAL_CHECKPOINT_INFO
from unit.checkpoint._keep_in_fp32_checkpoint_run import to_universal
from unit.checkpoint._keep_in_fp32_whole_state import (Continuation, check_masters_own_their_states,
                                                       check_whole_state, whole_state)
from unit.common import DistributedTest
from unit.v1.half_precision.test_keep_in_fp32_modules import (SINK_VALUES, SinkNet, SinkNetWithExtra, _build, _engine,
                                                              _gathered, _listed_names, _sinks, _train)
from unit.v1.half_precision.test_keep_in_fp32_stages import (_backend_spy, _check_dtypes, _check_kept_and_updated,
                                                             _masters, _stage_config, _stage_engine)

TAG = "global_step2"
# ZeRO-2 in the fast subset, ZeRO-1 in the nightly matrix
STAGES = ["zero2", pytest.param("zero1", marks=pytest.mark.nightly)]


def _save(stage, keep, save_dir):
    """Train two steps with data_types.keep_in_fp32_modules ``keep`` and save a checkpoint that ds_to_universal can
    convert; returns the whole state (_keep_in_fp32_whole_state.py)."""
    config = _stage_config(stage, keep=keep)
    engine = _stage_engine(stage, config)
    _train(engine, config, steps=2)
    engine.save_checkpoint(save_dir, tag=TAG, client_state={UNIVERSAL_CHECKPOINT_INFO: {}})
    return whole_state(engine)


def _check_loaded(engine, config, saved):
    """The whole state as ``saved``, each parameter at its master (rounded unless kept), and two more steps are what
    the optimizer makes of the loaded state and train the kept parameters in fp32."""
    check_whole_state(whole_state(engine), saved)
    check_masters_own_their_states(engine)
    for name, param in engine.module.named_parameters():
        master = saved["params"][name]["states"]["master"]
        assert torch.equal(_gathered(param), master.to(param.dtype)), f"{name} is not its master"
    continuation = Continuation(engine)
    _train(engine, config, steps=2)
    continuation.check(steps=2)
    if _sinks(engine.module).dtype == torch.float32:
        _check_kept_and_updated(engine)


def _check_loaded_exactly(stage, keep, save_dir, saved):
    """Load ``save_dir`` keeping ``keep`` and check it (_check_loaded)."""
    config = _stage_config(stage, keep=keep)
    engine = _stage_engine(stage, config)
    load_path, _ = engine.load_checkpoint(save_dir)
    assert load_path is not None
    _check_loaded(engine, config, saved)


class TestCheckpointOfOtherLayout(DistributedTest):
    world_size = 2

    @pytest.mark.parametrize("stage", STAGES)
    def test_other_kept_groups_load_per_param(self, stage, tmp_path):
        # [] has the layout of 0.19.8: nothing kept, one group per param group
        saves = {"auto": str(tmp_path / "auto"), "none": str(tmp_path / "none")}
        saved = {}
        for keep, name in (("auto", "auto"), ([], "none")):
            saved[name] = _save(stage, keep, saves[name])
        for keep, other in (("auto", "none"), ([], "auto")):
            _check_loaded_exactly(stage, keep, saves[other], saved[other])

    def test_other_params_kept_in_as_many_groups_load_per_param(self, tmp_path):
        # ["sink"] and ["norm"] each keep one group of each param group: the parameters in it tell them apart
        save_dir = str(tmp_path / "sink")
        saved = _save("zero2", ["sink"], save_dir)
        _check_loaded_exactly("zero2", ["norm"], save_dir, saved)

    @pytest.mark.parametrize("saved_keep", [[], "auto"], ids=["saved_keeping_nothing", "saved_keeping"])
    @pytest.mark.parametrize("stage", STAGES + ["zero1_bf16_optimizer"])
    def test_universal_checkpoint_loads_keeping(self, stage, saved_keep, tmp_path):
        # saved with nothing kept (the layout of 0.19.8), or keeping the model's list, loaded keeping the model's
        # list
        save_dir = str(tmp_path / "ckpt")
        saved = _save(stage, saved_keep, save_dir)
        if dist.get_rank() == 0:
            to_universal(save_dir, TAG)
        dist.barrier()

        config = _stage_config(stage)
        config["checkpoint"] = {"load_universal": True}
        engine = _stage_engine(stage, config)
        load_path, _ = engine.load_checkpoint(save_dir)
        assert load_path is not None and f"{TAG}_universal" in load_path, load_path
        _check_dtypes(engine.module, _listed_names(engine.module), torch.bfloat16)
        sinks = _gathered(_sinks(engine.module))
        assert not torch.equal(sinks, sinks.bfloat16().float()), "the loaded sinks are on the bf16 grid"
        _check_loaded(engine, config, saved)
        after = _gathered(_sinks(engine.module))
        assert not torch.equal(after, sinks) and torch.equal(after.bfloat16(), sinks.bfloat16())


class TestCheckpointEngineWithoutMmap(DistributedTest):
    """A checkpoint engine written for ``CheckpointEngine.load(path, map_location)`` (out of tree, before ``load`` took
    ``mmap``) loads a checkpoint of other flat groups: the other rank's file it needs is read whole."""
    world_size = 2

    def test_other_kept_groups_load(self, tmp_path):
        from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine

        class LoadWithoutMmap(TorchCheckpointEngine):

            def load(self, path, map_location=None):
                self.paths.append(path)
                return torch.load(path, map_location=map_location, weights_only=False)

        save_dir = str(tmp_path / "ckpt")
        saved = _save("zero2", [], save_dir)
        config = _stage_config("zero2")
        engine = _stage_engine("zero2", config)
        engine.checkpoint_engine = LoadWithoutMmap()
        engine.checkpoint_engine.paths = []
        load_path, _ = engine.load_checkpoint(save_dir)
        assert load_path is not None
        other = f"zero_pp_rank_{1 - dist.get_rank()}_"
        assert any(other in os.path.basename(path) for path in engine.checkpoint_engine.paths)
        _check_loaded(engine, config, saved)


# DeepSpeed's communication backend's collectives: those that carry Python objects, and those that carry tensors
OBJECT_COLLECTIVES = ("broadcast_object_list", "all_gather_object", "gather_object", "scatter_object_list")
TENSOR_COLLECTIVES = ("all_reduce", "broadcast", "all_gather", "all_gather_into_tensor", "reduce_scatter_tensor",
                      "reduce", "send", "recv", "isend", "irecv", "all_to_all_single")


class TestResumeReadsOwnShare(DistributedTest):
    """Loading a checkpoint saved in other flat groups (stock 0.19.8's layout into kept groups, and back) moves no
    optimizer state between ranks: each rank reads the pieces of the parameters it needs from the saving ranks' files,
    and the collectives of the load carry at most the kept parameters' values (their update after the load) and the
    engine's own few scalars. Masters and Adam moments are exact."""
    world_size = 2

    @pytest.mark.parametrize("saved_keep, loaded_keep", [([], "auto"), ("auto", [])], ids=["upgrade", "downgrade"])
    @pytest.mark.parametrize("stage", ["zero1", "zero2", "zero1_bf16_optimizer"])
    def test_no_optimizer_state_crosses_ranks(self, stage, saved_keep, loaded_keep, tmp_path):
        save_dir = str(tmp_path / "ckpt")
        saved = _save(stage, saved_keep, save_dir)
        config = _stage_config(stage, keep=loaded_keep)
        engine = _stage_engine(stage, config)
        kept_bytes = sum(p.numel() * 4 for p in engine.module.parameters() if p.dtype == torch.float32)
        calls = []

        def record(name, args, kwargs):
            tensors = [a for a in list(args) + list(kwargs.values()) if torch.is_tensor(a)]
            calls.append((name, sum(t.numel() * t.element_size() for t in tensors[:1])))

        with _backend_spy(OBJECT_COLLECTIVES + TENSOR_COLLECTIVES, record):
            load_path, _ = engine.load_checkpoint(save_dir)
        assert load_path is not None
        objects = [name for name, _ in calls if name in OBJECT_COLLECTIVES]
        assert not objects, f"the load sent Python objects between ranks: {objects}"
        moved = sum(nbytes for _, nbytes in calls)
        assert moved <= kept_bytes + 64 * len(calls), f"{moved} bytes moved between ranks: {calls}"
        _check_loaded(engine, config, saved)


class TestResumeRefusesBadInput(DistributedTest):
    """A load into other flat groups that cannot be done is an error that names what differs, raised before
    anything is written: this rank's fp32 partitions keep their values and the optimizer holds no state, and every
    rank raises it. The checkpoint's param_shapes do not match its files; the checkpoint was saved from another
    model. (A rank that cannot read its own file raises there what 0.19.8 raises, before it knows the layout.)"""
    world_size = 2

    def _load_fails(self, save_dir, match, model_cls=SinkNet, **kwargs):
        engine = _engine(_stage_config("zero2", keep="auto"), model_cls, zero_init=False)
        partitions = [t.clone() for t in engine.optimizer.single_partition_of_fp32_groups]
        with pytest.raises(ValueError, match=match) as error:
            engine.load_checkpoint(save_dir, **kwargs)
        for before, after in zip(partitions, engine.optimizer.single_partition_of_fp32_groups):
            assert torch.equal(before, after), "the failed load wrote into the fp32 partitions"
        assert not any(engine.optimizer.optimizer.state.values()), "the failed load set optimizer states"
        # every rank raises the same error
        messages = [None] * dist.get_world_size()
        dist.all_gather_object(messages, str(error.value))
        assert len(set(messages)) == 1, messages

    def test_param_shapes_that_do_not_match_the_files(self, tmp_path):
        save_dir = str(tmp_path / "ckpt")
        _save("zero2", [], save_dir)
        dist.barrier()
        if dist.get_rank() == 0:
            path = os.path.join(save_dir, TAG, "mp_rank_00_model_states.pt")
            checkpoint = torch.load(path, weights_only=False)
            checkpoint["param_shapes"] = [dict(reversed(shapes.items())) for shapes in checkpoint["param_shapes"]]
            torch.save(checkpoint, path)
        dist.barrier()
        self._load_fails(save_dir, "not saved together")

    def test_checkpoint_of_another_model(self, tmp_path):
        save_dir = str(tmp_path / "ckpt")
        _save("zero2", [], save_dir)
        self._load_fails(save_dir,
                         r"holds no fp32 master of \['extra'\]: it was saved from another model",
                         model_cls=SinkNetWithExtra,
                         load_module_strict=False)


class CastLinear(torch.nn.Linear):
    """Computes in the dtype of its weight (fp32 when kept), as a kept lm_head does."""

    def forward(self, h):
        return super().forward(h.to(self.weight.dtype)).to(h.dtype)


class LmHeadNet(SinkNet):

    def __init__(self):
        super().__init__()
        self.out = CastLinear(self.out.in_features, 64)


class TestKeptGroupsArePartitioned(DistributedTest):
    """The groups of kept parameters are partitioned over the data parallel ranks like the others: each rank holds
    its share of their fp32 masters and optimizer states, however much of the model is kept."""
    world_size = 2

    @pytest.mark.parametrize("stage",
                             [pytest.param("zero1", marks=pytest.mark.nightly), "zero2", "zero1_bf16_optimizer"])
    def test_optimizer_states_divide_by_the_data_parallel_size(self, stage):
        # the model lists its output projection, as HY-V4 lists lm_head: 673 of 853 elements kept
        config = _stage_config(stage, keep=["out", "sink", "norm"])
        engine = _engine(config, model_cls=LmHeadNet, zero_init=False)
        total = sum(p.numel() for p in engine.module.parameters())
        kept = sum(p.numel() for p in engine.module.parameters() if p.dtype == torch.float32)
        assert kept == 673, kept
        _train(engine, config, steps=1)
        optimizer = engine.optimizer.optimizer
        masters = sum(p.numel() for group in optimizer.param_groups for p in group["params"])
        moments = sum(optimizer.state[p]["exp_avg"].numel() for group in optimizer.param_groups
                      for p in group["params"])
        # the rank's share, and the padding that aligns each flat group's partitions
        share = total / dist.get_world_size() + 4 * len(optimizer.param_groups)
        assert masters <= share and moments <= share, (masters, moments, share)

    @pytest.mark.parametrize("stage", ["zero2", "zero1_bf16_optimizer"])
    def test_zero_to_fp32_with_only_kept_params_trained(self, stage, tmp_path):
        config = _stage_config(stage)
        model = _build(config, zero_init=False)
        kept = _listed_names(model)
        for name, param in model.named_parameters():
            param.requires_grad_(name in kept)
        engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
        _train(engine, config, steps=2)
        engine.save_checkpoint(str(tmp_path))
        masters = {name: value for name, value in _masters(engine).items() if name in kept}
        if dist.get_rank() == 0:
            from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
            state_dict = get_fp32_state_dict_from_zero_checkpoint(str(tmp_path))
            for name, master in masters.items():
                assert torch.equal(state_dict[name], master), name
        dist.barrier()


# (the options, whether the fast subset runs them)
REDUCTIONS = {
    "comm_fp32": ({
        "communication_data_type": "fp32"
    }, True),
    "comm_fp32_overlap_comm": ({
        "communication_data_type": "fp32",
        "zero_optimization": {
            "overlap_comm": True
        }
    }, False),
    "overlap_comm": ({
        "zero_optimization": {
            "overlap_comm": True
        }
    }, True),
    "no_contiguous_gradients": ({
        "zero_optimization": {
            "contiguous_gradients": False
        }
    }, False),
    "round_robin_gradients": ({
        "zero_optimization": {
            "round_robin_gradients": True
        }
    }, False),
}


def _reduction_cases():
    for stage in ("zero2", "zero1"):
        for name, (_, fast) in REDUCTIONS.items():
            marks = [] if fast and stage == "zero2" else [pytest.mark.nightly]
            yield pytest.param(stage, name, marks=marks, id=f"{stage}-{name}")


class TestGradientReduction(DistributedTest):
    world_size = 2

    @pytest.mark.parametrize("stage, reduction", list(_reduction_cases()))
    def test_trains_with_kept_params_exact(self, stage, reduction):
        config = _stage_config(stage)
        options, _ = REDUCTIONS[reduction]
        for key, value in options.items():
            if isinstance(value, dict):
                config[key].update(value)
            else:
                config[key] = value
        engine = _stage_engine(stage, config)
        losses = _train(engine, config, steps=2)
        assert all(torch.isfinite(torch.tensor(losses))), losses
        _check_dtypes(engine.module, _listed_names(engine.module), torch.bfloat16)
        _check_kept_and_updated(engine)
        assert not torch.equal(_masters(engine)["attn.sinks"], SINK_VALUES)
