# Copyright (c) DeepSpeed Team.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""Checkpoints of runs that keep parameters in fp32 (``data_types.keep_in_fp32_modules``): what the conformance matrix
(test_checkpoint_conformance.py: every stage, optimizer and path, the upgrade from stock DeepSpeed 0.19.8 and
universal checkpoints included) does not make.

- Upgrade: a ZeRO-2 checkpoint that pristine DeepSpeed 0.19.8 saved with round_robin_gradients, and a stage-0 fp16
  one (in a subprocess with the pristine tree named by ``$DS_PRISTINE_TREE`` on PYTHONPATH; skipped without it),
  load into a run that keeps the listed parameters in fp32 with every master and Adam moment exact.
- Universal checkpoints with frozen parameters: a world-size-3 save, converted by ds_to_universal, loads at world
  size 2 with the same list and with others, every master and moment exact; at another data-parallel size a ZeRO-2
  checkpoint moves through ds_to_universal with no optimizer state crossing ranks (nightly).
- zero_to_fp32: trainable and frozen parameters, kept in fp32 or not, come back exactly in every export path.

A universal checkpoint does not restore frozen parameters under ZeRO-3, with or without the series: a strict xfail
says where. The universal tests with frozen parameters pass because the loading run builds them as the saving run did.

The model, config and the saving script are in ``_keep_in_fp32_checkpoint_run.py`` next to this file; the saves
that several tests share are made once per module, by that script under ``torch.distributed.run``.
"""

import glob
import os
import subprocess
import sys

import pytest
import torch

import deepspeed
from unit.checkpoint._keep_in_fp32_whole_state import (Continuation, check_masters_own_their_states, check_whole_state,
                                                       whole_state)
from unit.common import DistributedTest, _free_port
from unit.checkpoint._keep_in_fp32_checkpoint_run import (NORM_VALUES, SINK_VALUES, STEPS, TAG, config, engine,
                                                          pristine_tree, gathered, snapshot, train)

SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_keep_in_fp32_checkpoint_run.py")
KEPT_AUTO = {"attn.sinks", "attn.sink_gate", "norm.weight", "norm.bias"}  # what SinkNet lists ("sink", "norm")
# (data_types.keep_in_fp32_modules of the run that loads, the parameters it keeps in fp32)
LOADS = [("auto", KEPT_AUTO), ([], set()), (["sink"], {"attn.sinks", "attn.sink_gate"})]
FROZEN = ("norm.weight", "lin.weight")  # in the world-size-3 save: a listed parameter and one trained in bf16


def _save_in_subprocess(out, world_size, *args, pristine_tree=None):
    """Run the saving script on ``world_size`` ranks (torch.distributed.run, gloo) into ``out``; returns its
    reference (``out/reference.pt``). With ``pristine_tree``, ``import deepspeed`` there is pristine 0.19.8; else it
    is the DeepSpeed this process imported."""
    env = dict(os.environ, DS_ACCELERATOR="cpu", LOCAL_SIZE=str(world_size), OMP_NUM_THREADS="1")
    if pristine_tree is not None:
        env["PYTHONPATH"] = pristine_tree
        # the pristine tree's own cache of its JIT-built CPU comm op: <repo>/build/pristine -> <repo>/build/...
        repo = os.path.dirname(os.path.dirname(pristine_tree))
        env["TORCH_EXTENSIONS_DIR"] = os.path.join(repo, "build", "torch_extensions", "pristine")
        package_dir = os.path.join(pristine_tree, "deepspeed")
    else:
        package_dir = os.path.dirname(os.path.abspath(deepspeed.__file__))
        env["PYTHONPATH"] = os.pathsep.join([os.path.dirname(package_dir)] +
                                            [p for p in [os.environ.get("PYTHONPATH")] if p])
    port = _free_port()
    command = [
        sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc_per_node",
        str(world_size), "--master_addr", "127.0.0.1", "--master_port",
        str(port), SCRIPT,
        str(out), *args
    ]
    try:
        result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=400)
    finally:
        # DeepSpeed's CPU comm op leaves a shared-memory buffer per rank (66 MiB each)
        for path in glob.glob(f"/dev/shm/deepspeed_allreduce_buffer_{os.getuid()}_*_{port}_*"):
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
    output = f"{' '.join(command)}\n{result.stdout[-6000:]}\n{result.stderr[-6000:]}"
    assert result.returncode == 0, f"the saving script failed:\n{output}"
    reference = torch.load(os.path.join(out, "reference.pt"), weights_only=False)
    assert os.path.dirname(os.path.abspath(reference["deepspeed_file"])) == package_dir, \
        f"the script imported {reference['deepspeed_file']}, not the DeepSpeed in {package_dir}"
    assert f"from {reference['deepspeed_file']}" in result.stdout, output
    assert reference["world_size"] == world_size and reference["global_steps"] == STEPS
    return reference


@pytest.fixture(scope="module")
def pristine_save_round_robin(tmp_path_factory):
    """A ZeRO-2 checkpoint that pristine DeepSpeed 0.19.8 saved at world size 2 with round_robin_gradients (nothing
    kept): its flat groups hold the parameters in round-robin order, as its param_shapes list them, and its
    param_slice_mappings place them in their original order."""
    tree = pristine_tree()
    out = tmp_path_factory.mktemp("pristine_save_round_robin")
    reference = _save_in_subprocess(out, 2, "--stage", "2", "--round-robin", pristine_tree=tree)
    assert reference["deepspeed_version"].strip() == "0.19.8", reference["deepspeed_version"]
    return str(out)


# the fp16 optimizer whose flat masters 0.19.8 lays out per param group (the conformance matrix trains in bf16):
# (config(), the saving script's options)
FLAT_MASTERS = {
    "zero0_fp16": (dict(stage=0, dtype="fp16"), ["--stage", "0", "--dtype", "fp16"]),
}


@pytest.fixture(scope="module", params=[pytest.param("zero0_fp16", marks=pytest.mark.nightly)])
def pristine_save_flat_masters(request, tmp_path_factory):
    """A checkpoint of FP16_Optimizer at stage 0 in fp16 that pristine DeepSpeed 0.19.8 saved at world size 2 (nothing
    kept); returns (its directory, the key of FLAT_MASTERS)."""
    tree = pristine_tree()
    out = tmp_path_factory.mktemp(f"pristine_save_{request.param}")
    reference = _save_in_subprocess(out, 2, *FLAT_MASTERS[request.param][1], pristine_tree=tree)
    assert reference["deepspeed_version"].strip() == "0.19.8", reference["deepspeed_version"]
    half = torch.float16 if request.param == "zero0_fp16" else torch.bfloat16
    for name, entry in reference["params"].items():
        assert entry["value"].dtype == half, f"pristine 0.19.8 kept {name} in {entry['value'].dtype}"
    return str(out), request.param


@pytest.fixture(scope="module")
def zero2_stock_layout_save_ws3(tmp_path_factory):
    """A ZeRO-2 checkpoint saved at world size 3 keeping nothing (the layout of 0.19.8), and its universal
    conversion."""
    out = tmp_path_factory.mktemp("zero2_ws3")
    _save_in_subprocess(out, 3, "--universal", "--stage", "2", "--keep", "[]")
    return str(out)


@pytest.fixture(scope="module")
def frozen_save_ws3(tmp_path_factory):
    """A checkpoint saved at world size 3 with the model's list and FROZEN frozen, and its universal conversion."""
    out = tmp_path_factory.mktemp("frozen_ws3")
    reference = _save_in_subprocess(out, 3, "--universal", "--frozen", ",".join(FROZEN))
    assert {name for name, entry in reference["params"].items() if not entry["requires_grad"]} == set(FROZEN)
    return str(out)


def _reference(save_dir):
    return torch.load(os.path.join(save_dir, "reference.pt"), weights_only=False)


def _check_loaded(model_engine, reference, kept):
    """The whole state as the saving run's (``reference``: its reference.pt), every optimizer state of every
    parameter, ``step`` included, with no state tensor shared between masters; the parameters in ``kept`` held in
    fp32 at their master exactly, the others in bf16 at it rounded; frozen parameters at their saved value (rounded
    to bf16 unless kept)."""
    check_whole_state(whole_state(model_engine), reference["whole_state"])
    check_masters_own_their_states(model_engine)
    saved = reference["params"]
    restored = snapshot(model_engine)
    assert set(restored) == set(saved)
    half = torch.float16 if model_engine.fp16_enabled() else torch.bfloat16
    for name, param in model_engine.module.named_parameters():
        want = torch.float32 if name in kept else half
        stored = getattr(param, "ds_tensor", param)  # the partition under ZeRO-3
        assert stored.dtype == want, f"{name}: stored in {stored.dtype}, expected {want}"
        assert param.requires_grad == saved[name]["requires_grad"], name
        value = restored[name]["value"]
        assert value.dtype == want, f"{name} is {value.dtype}, expected {want}"
        if not param.requires_grad:
            assert torch.equal(value, saved[name]["value"].to(want)), f"{name}: frozen value differs"
            continue
        for key in ("master", "exp_avg", "exp_avg_sq"):
            got = restored[name][key]
            assert got.dtype == torch.float32 and torch.equal(got, saved[name][key]), \
                f"{name}: {key} differs after the load"
        assert torch.equal(value, saved[name]["master"].to(want)), \
            f"{name}: the loaded value is not its master{' rounded' if want != torch.float32 else ''}"


def _check_training_continues(model_engine, kept):
    """Two more steps: finite losses; each master is what its optimizer makes of the loaded state (Continuation); the
    kept parameters take updates far below bf16's resolution, and the forward pass sees their masters exactly."""
    before = snapshot(model_engine)
    continuation = Continuation(model_engine)
    losses = train(model_engine, first_step=STEPS)
    continuation.check(steps=STEPS)
    assert all(torch.isfinite(torch.tensor(losses))), losses
    after = snapshot(model_engine)
    for name in kept:
        value = after[name]["value"]
        assert value.dtype == torch.float32, name
        want = after[name]["master"] if after[name]["requires_grad"] else before[name]["value"]
        assert torch.equal(value, want), f"{name}: the gathered value is not its fp32 master"
    if "attn.sinks" in kept:
        old, new = before["attn.sinks"]["master"], after["attn.sinks"]["master"]
        assert not torch.equal(old, new), "the sinks did not move"
        assert (new - old).abs().max() < 1e-3, "the sinks moved by more than two Adam steps can"
        assert not torch.equal(new, new.bfloat16().float()), "the sinks are on the bf16 grid"
        assert torch.equal(new.bfloat16(), old.bfloat16()), "updates this small do not show in bf16"


def _resume(run_config, ckpt, saved):
    """An engine of ``run_config`` that loaded ``ckpt`` (at step STEPS), with every parameter's master and Adam
    moments as ``saved`` has them; returns it and the path it loaded."""
    loaded = engine(run_config)
    load_path, _ = loaded.load_checkpoint(ckpt)
    assert load_path is not None
    assert loaded.global_steps == STEPS
    _check_loaded(loaded, saved, KEPT_AUTO)
    return loaded, load_path


class TestUpgradeFromPristineRoundRobin(DistributedTest):
    """A ZeRO-2 checkpoint that pristine DeepSpeed 0.19.8 saved with round_robin_gradients resumes keeping the
    model's list (the default), every state exact: its flat groups are read as its param_shapes lay them out, not as
    its param_slice_mappings say (0.19.8 wrote those in the parameters' original order). Its own accessors read the
    same wrong slices, so the truth is the same checkpoint resumed keeping nothing (0.19.8's layout, and the fixed
    links of pull request 2), whose masters round to the values pristine's parameters held."""
    world_size = 2

    def test_pristine_checkpoint_loads_with_optimizer_states(self, pristine_save_round_robin):
        saved = _reference(pristine_save_round_robin)
        ckpt = os.path.join(pristine_save_round_robin, "ckpt")
        same_layout = engine(config(keep=[], stage=2, round_robin=True))
        assert same_layout.load_checkpoint(ckpt)[0] is not None
        truth = whole_state(same_layout)
        for name, entry in truth["params"].items():
            assert torch.equal(entry["states"]["master"].bfloat16(), saved["params"][name]["value"]), name

        loaded = engine(config(stage=2, round_robin=True))  # "auto": the sinks and the norm in fp32
        assert loaded.load_checkpoint(ckpt)[0] is not None
        check_whole_state(whole_state(loaded), truth)
        check_masters_own_their_states(loaded)
        _check_training_continues(loaded, KEPT_AUTO)


class TestUpgradeFromPristineFlatMasters(DistributedTest):
    """A checkpoint of FP16_Optimizer at stage 0 in fp16 saved by pristine DeepSpeed 0.19.8 holds one flat fp32 master
    per param group; a run that keeps the model's list holds the kept parameters in sub-groups of their own.
    engine.load_checkpoint() moves each parameter's master and Adam moments to where this run holds them, exactly
    (the bf16 stage-0 and BF16-optimizer upgrades are the conformance matrix's stock_to_list cells)."""
    world_size = 2

    def test_pristine_checkpoint_loads_with_optimizer_states(self, pristine_save_flat_masters):
        save_dir, kind = pristine_save_flat_masters
        saved = _reference(save_dir)
        sinks = saved["params"]["attn.sinks"]
        assert not torch.equal(sinks["master"], sinks["master"].bfloat16().float())

        # "auto": the sinks and the norm in fp32
        loaded, _ = _resume(config(**FLAT_MASTERS[kind][0]), os.path.join(save_dir, "ckpt"), saved)
        assert type(loaded.optimizer).__name__ == "FP16_Optimizer"
        # Adam's step is carried
        steps = {int(state["step"]) for state in loaded.optimizer.optimizer.state.values()}
        assert steps == {STEPS + 1}, steps  # the fp16 optimizers step once at init
        _check_training_continues(loaded, KEPT_AUTO)


def _check_universal(save_dir):
    """Load ``save_dir``'s universal checkpoint once per setting in LOADS (with the parameters frozen that were
    frozen there, built with the saved values: the load does not restore them, see
    TestUniversalCheckpointFrozenParams), check it and train on."""
    saved = _reference(save_dir)
    frozen = [name for name, entry in saved["params"].items() if not entry["requires_grad"]]
    for keep, kept in LOADS:
        model_engine = engine(config(keep=keep, load_universal=True), frozen=frozen)
        load_path, _ = model_engine.load_checkpoint(os.path.join(save_dir, "ckpt"))
        try:
            assert load_path is not None and f"{TAG}_universal" in load_path, load_path
            assert model_engine.global_steps == STEPS
            _check_loaded(model_engine, saved, kept)
            _check_training_continues(model_engine, kept)
        except AssertionError as e:
            raise AssertionError(f"saved at world size {saved['world_size']}, loaded at "
                                 f"{model_engine.world_size} with keep_in_fp32_modules={keep!r}: {e}") from e


class TestUniversalCheckpoint(DistributedTest):
    """A world-size-3 save with frozen parameters, converted by ds_to_universal, loads at world size 2 (3 -> 2) with
    the same list and with others (the conformance matrix's universal cells have no frozen parameters)."""
    world_size = 2

    def test_load_universal(self, frozen_save_ws3):
        _check_universal(frozen_save_ws3)


# nightly: the fast subset checks the upgrade resume's traffic without ds_to_universal (test_keep_in_fp32_zero12.py's
# TestResumeReadsOwnShare)
@pytest.mark.nightly
class TestUniversalResumeReadsOwnShare(DistributedTest):
    """At another data-parallel size (3 -> 2), a ZeRO-2 checkpoint of 0.19.8's layout moves into kept groups through
    ds_to_universal with no optimizer state crossing ranks: each rank reads its parameters' fragments, and the
    collectives of the load carry at most the parameters' values (the all-gather of the partitions set from their
    masters, as stock's load makes) and a few scalars. Every master and moment is exact."""
    world_size = 2

    def test_no_optimizer_state_crosses_ranks(self, zero2_stock_layout_save_ws3):
        from unit.v1.half_precision.test_keep_in_fp32_stages import _backend_spy
        from unit.v1.half_precision.test_keep_in_fp32_zero12 import OBJECT_COLLECTIVES, TENSOR_COLLECTIVES
        saved = _reference(zero2_stock_layout_save_ws3)
        model_engine = engine(config(keep="auto", load_universal=True, stage=2))
        param_bytes = sum(p.numel() * p.element_size() for p in model_engine.module.parameters())
        calls = []

        def record(name, args, kwargs):
            tensors = [a for a in list(args) + list(kwargs.values()) if torch.is_tensor(a)]
            calls.append((name, sum(t.numel() * t.element_size() for t in tensors[:1])))

        with _backend_spy(OBJECT_COLLECTIVES + TENSOR_COLLECTIVES, record):
            load_path, _ = model_engine.load_checkpoint(os.path.join(zero2_stock_layout_save_ws3, "ckpt"))
        assert load_path is not None and f"{TAG}_universal" in load_path, load_path
        objects = [name for name, _ in calls if name in OBJECT_COLLECTIVES]
        assert not objects, f"the load sent Python objects between ranks: {objects}"
        moved = sum(nbytes for _, nbytes in calls)
        assert moved <= param_bytes + 64 * len(calls), f"{moved} bytes moved between ranks: {calls}"
        _check_loaded(model_engine, saved, KEPT_AUTO)
        _check_training_continues(model_engine, KEPT_AUTO)


class TestUniversalCheckpointFrozenParams(DistributedTest):
    """A universal checkpoint gives back the frozen parameters too, the kept ones in fp32."""
    world_size = 1

    @pytest.mark.xfail(strict=True,
                       reason="ZeRO-3 universal checkpoints hold no frozen parameters: ds_to_universal's ZeRO-3 "
                       "branch converts only the optimizer's param_shapes (checkpoint/ds_to_universal.py:1328), the "
                       "universal load fills only the trainable self.fp16_groups (runtime/zero/stage3.py:3810) and "
                       "skips load_module_state_dict, which applies frozen_param_fragments (runtime/engine.py:4738, "
                       "4382), so a frozen parameter keeps the loading run's initial value. Pristine 0.19.8 does the "
                       "same; not caused by the series.")
    def test_frozen_params_restored(self, frozen_save_ws3):
        import deepspeed.comm as dist
        saved = _reference(frozen_save_ws3)
        model_engine = engine(config(load_universal=True), frozen=FROZEN)
        # other initial values than the saving run had, as a model built another way would have
        for name, param in model_engine.module.named_parameters():
            if name in FROZEN:
                with deepspeed.zero.GatheredParameters([param], modifier_rank=0):
                    if dist.get_rank() == 0:
                        param.data.add_(0.5)
        model_engine.load_checkpoint(os.path.join(frozen_save_ws3, "ckpt"))
        for name in FROZEN:
            value = gathered(dict(model_engine.module.named_parameters())[name])
            want = saved["params"][name]["value"]
            assert value.dtype == want.dtype and torch.equal(value, want), f"frozen {name} was not restored"


def _run_recovery_script(ckpt_dir, out_dir, *flags):
    """The zero_to_fp32.py that save_checkpoint copied into ``ckpt_dir``, in a fresh process, as a user runs it."""
    script = os.path.join(ckpt_dir, "zero_to_fp32.py")
    assert os.path.isfile(script), f"save_checkpoint did not copy zero_to_fp32.py into {ckpt_dir}"
    result = subprocess.run([sys.executable, script, ckpt_dir, out_dir, *flags],
                            env=dict(os.environ, DS_ACCELERATOR="cpu"),
                            capture_output=True,
                            text=True,
                            timeout=300)
    assert result.returncode == 0, f"{script} {' '.join(flags)} failed:\n{result.stdout}\n{result.stderr}"


def _read_single_file(out_dir, safe):
    files = os.listdir(out_dir)
    if safe:
        from safetensors.torch import load_file
        assert files == ["model.safetensors"], files
        return load_file(os.path.join(out_dir, "model.safetensors"))
    assert files == ["pytorch_model.bin"], files
    return torch.load(os.path.join(out_dir, "pytorch_model.bin"), map_location="cpu", weights_only=True)


class TestZeroToFp32(DistributedTest):
    """zero_to_fp32 on the world-size-3 checkpoint: kept parameters trainable (the sinks) and frozen (the norm's
    weight), next to trainable and frozen bf16 ones, come back exactly in every export path."""
    world_size = 1  # reads the checkpoint only

    def test_every_export_is_exact(self, frozen_save_ws3, tmp_path):
        from deepspeed.utils.zero_to_fp32 import (convert_zero_checkpoint_to_fp32_state_dict,
                                                  get_fp32_state_dict_from_zero_checkpoint)

        saved = _reference(frozen_save_ws3)
        # what the checkpoint must give back, in the dtype it holds: masters (fp32), frozen values in their dtype
        # (the kept norm weight fp32), buffers
        holds = {
            name: entry["master"] if entry["requires_grad"] else entry["value"]
            for name, entry in saved["params"].items()
        }
        holds.update(saved["buffers"])
        for name in KEPT_AUTO:
            assert holds[name].dtype == torch.float32, f"the saving run did not keep {name} in fp32"
        assert torch.equal(holds["norm.weight"], NORM_VALUES)
        assert holds["lin.weight"].dtype == torch.bfloat16
        sinks = holds["attn.sinks"]
        assert not torch.equal(sinks, sinks.bfloat16().float())
        assert not torch.equal(sinks, SINK_VALUES)
        ckpt = os.path.join(frozen_save_ws3, "ckpt")

        def check(state_dict, what):
            # the kept parameters come back fp32 in every path; the dtype of a frozen bf16 one is zero_to_fp32's
            # choice (fp32, as its other values, with get_fp32_state_dict_from_zero_checkpoint's dtype argument,
            # tested in test_convert_checkpoint.py), its value is exact
            assert set(state_dict) == set(holds), f"{what}: keys {sorted(state_dict)}"
            for name, want in holds.items():
                got = state_dict[name]
                if not isinstance(got, torch.Tensor):
                    got = got.contiguous()  # a lazy-mode GatheredTensor
                if want.dtype == torch.float32:
                    assert got.dtype == torch.float32, f"{what}: {name} is {got.dtype}, expected torch.float32"
                assert got.shape == want.shape, f"{what}: {name} has shape {tuple(got.shape)}"
                assert torch.equal(got.to(want.dtype), want), f"{what}: {name} differs"

        failures = []

        def attempt(fn, *args):
            try:
                fn(*args)
            except AssertionError as e:
                failures.append(str(e))

        def convert(out, safe):
            convert_zero_checkpoint_to_fp32_state_dict(ckpt, out, safe_serialization=safe)
            check(_read_single_file(out, safe), f"convert(safe_serialization={safe})")

        def script(out):
            _run_recovery_script(ckpt, out, "--safe_serialization")
            check(_read_single_file(out, True), "zero_to_fp32.py --safe_serialization")

        attempt(lambda: check(get_fp32_state_dict_from_zero_checkpoint(ckpt), "eager"))
        attempt(lambda: check(get_fp32_state_dict_from_zero_checkpoint(ckpt, lazy_mode=True), "lazy"))
        for safe in (False, True):
            attempt(convert, str(tmp_path / f"convert-{safe}"), safe)
        attempt(script, str(tmp_path / "script"))
        assert not failures, "\n".join(failures)
