# Copyright (c) DeepSpeed Team.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""transformers' ``Trainer`` with ``deepspeed=`` (ZeRO-3, bf16, Hugging Face's dict config with "auto" values) keeps
the parameters a model's ``_keep_in_fp32_modules_strict`` names in fp32: trains, saves, resumes, and resumes a run
that pristine DeepSpeed 0.19.8 started.

Models: a tiny DeepSeek-V3 (its strict list names the router ``gate.weight``; both layers MoE) and a tiny DeepSeek-V4
(hyper-connections, sinks, norms, position biases), each built whole by a plain ``Model(config)`` in this process,
outside ``zero.Init``, and written by ``save_pretrained`` (fp32). Every Trainer run is a subprocess on 2 CPU ranks
(``python -m torch.distributed.run``, DS_ACCELERATOR=cpu, gloo, ``use_cpu=True``) running ``_trainer_run.py`` next to
this file: ``TrainingArguments(deepspeed=...)`` first, then ``from_pretrained`` (so under ``zero.Init``), 6 steps on a
tiny fixed token dataset, a Trainer checkpoint at step 3. DeepSeek-V4's final norm, which transformers 5.24.0's ZeRO-3
loader drops, is loaded by hand with ``reload_from_checkpoint`` (examples/zero3_workaround.py), so that every
parameter, the final norm included, is compared. The runs write their losses, dtypes and full values (with the fp32
masters, ``safe_get_full_fp32_param``) for the checks here. Runs are shared between the tests.

* ``test_train_and_save_model``: from_pretrained loaded every parameter (kept ones fp32 and bit-exact, the others
  the file rounded to bf16); the loss starts near ln(vocab) and falls; ``trainer.save_model()`` (with
  ``stage3_gather_16bit_weights_on_model_save``) and the step-3 checkpoint write every listed tensor in fp32, equal
  (``torch.equal``) to its fp32 master, and every other one in bf16; a plain ``from_pretrained`` of the saved model
  gets those values back.
* ``test_resume_continues_exactly``: ``resume_from_checkpoint`` of the step-3 checkpoint starts from the saved state
  and gives losses at steps 4-6 identical (``==``) to those of the uninterrupted run, rank by rank.
* ``test_resume_a_pristine_checkpoint`` (skipped without DS_PRISTINE_TREE, which ``make test`` sets): the DeepSeek-V3
  run on pristine DeepSpeed 0.19.8 (which trains the router in bf16) saves a Trainer checkpoint at step 3, at ZeRO-3
  and at ZeRO-2 (``--stage 2``: the model is loaded outside ``zero.Init``); the series resumes it: the router weights are fp32 and equal to the fp32 masters pristine saved, and the resumed losses
  continue where pristine's own run goes (not exactly: the series computes the router in fp32 from the masters).
"""

import json
import math
import os
import re
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

import deepspeed  # noqa: E402
from unit import tiny_hf_models  # noqa: E402
from unit.v1.half_precision import _trainer_run  # noqa: E402
from unit.v1.half_precision.test_keep_in_fp32_transformers import MODELS as HF_TEST_MODELS  # noqa: E402

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[3]
RUN_SCRIPT = HERE / "_trainer_run.py"
WORKAROUND = REPO / "examples" / "zero3_workaround.py"
STEPS, SAVE_STEPS = 6, 3
RUN_TIMEOUT = 300  # seconds, per Trainer run (about 20 s each on 2 cores)
PRISTINE_TREE = os.environ.get("DS_PRISTINE_TREE")


def _deepseek_v3():
    return tiny_hf_models.model_class("deepseek_v3"), tiny_hf_models.deepseek_v3_config(vocab_size=_trainer_run.VOCAB)


MODELS = {"deepseek_v3": _deepseek_v3, "deepseek_v4": HF_TEST_MODELS["deepseek_v4"]}
ALL_MODELS = [
    pytest.param(name,
                 marks=pytest.mark.skipif(not hasattr(transformers, cls),
                                          reason=f"transformers {transformers.__version__} has no {cls}"))
    for name, cls in (("deepseek_v3", "DeepseekV3ForCausalLM"), ("deepseek_v4", "DeepseekV4ForCausalLM"))
]


def _strict_pattern(model_cls):
    names = sorted(model_cls._keep_in_fp32_modules_strict)
    return re.compile("|".join(name.replace("*", ".*") for name in names))


class Results:
    """What one Trainer run wrote: ``rank[r]`` (the JSON of rank r) and the tensors of rank 0 (``pt(name)``)."""

    def __init__(self, results_dir, output_dir):
        self.dir = Path(results_dir)
        self.output_dir = Path(output_dir)
        self.rank = [json.loads((self.dir / f"rank{r}.json").read_text()) for r in range(2)]
        self.kept = self.rank[0]["kept"]

    def pt(self, name):
        return torch.load(self.dir / f"{name}.pt")

    def losses(self, rank):
        """{global step: loss} of the steps this run trained."""
        return {step: loss for step, loss in self.rank[rank]["losses"]}


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(log, argv, pristine):
    """Run _trainer_run.py on 2 ranks with torch.distributed.run; its output goes to ``log``."""
    env = dict(os.environ, DS_ACCELERATOR="cpu")
    env.setdefault("OMP_NUM_THREADS", "1")
    if pristine:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (PRISTINE_TREE, env.get("PYTHONPATH")) if p)
        env["TORCH_EXTENSIONS_DIR"] = str(REPO / "build" / "torch_extensions" / "pristine")
    else:
        env.setdefault("TORCH_EXTENSIONS_DIR", str(REPO / "build" / "torch_extensions" / "dev"))
    if not (Path(env["TORCH_EXTENSIONS_DIR"]) / "deepspeed_shm_comm" / "deepspeed_shm_comm.so").exists():
        # Build the CPU comm op once here rather than in both ranks at a time.
        subprocess.run([sys.executable, "-c", "from deepspeed.comm.torch import build_shm_op; build_shm_op()"],
                       env=env,
                       check=True,
                       stdout=subprocess.DEVNULL)
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
        str(_free_port()),
        str(RUN_SCRIPT), *argv
    ]
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            rc = proc.wait(timeout=RUN_TIMEOUT)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # the launcher and the ranks it started
            proc.wait()
            rc = f"killed after {RUN_TIMEOUT} s"
    if rc != 0:
        noise = ("FutureWarning", "return func(", "warnings.warn")
        lines = [
            line for line in Path(log).read_text().splitlines() if line.strip() and not any(n in line for n in noise)
        ]
        pytest.fail(f"Trainer run failed ({rc}): {' '.join(argv)}\n" + "\n".join(lines[-60:]), pytrace=False)


class Runs:
    """The saved tiny models and the Trainer runs, each made once (on first use) and shared by the tests."""

    def __init__(self, root):
        self.root = Path(root)
        self._cache = {}

    def _once(self, key, make):
        if key not in self._cache:
            try:
                self._cache[key] = make()
            except BaseException as e:  # a failed run fails every test that needs it, without running it again
                self._cache[key] = e
                raise
        if isinstance(self._cache[key], BaseException):
            raise self._cache[key]
        return self._cache[key]

    def model(self, arch):
        """The tiny model's directory, written by save_pretrained from a plain Model(config), with ``reference``:
        the values a plain fp32 from_pretrained loads from it."""

        def make():
            model_cls, config = MODELS[arch]()
            torch.manual_seed(0)
            model = model_cls(config)
            path = self.root / arch
            model.save_pretrained(str(path))
            assert not transformers.integrations.is_deepspeed_zero3_enabled()
            plain = model_cls.from_pretrained(str(path), dtype=torch.float32)
            reference = {name: p.detach().clone() for name, p in plain.named_parameters()}
            assert all(torch.equal(reference[name], p) for name, p in model.named_parameters())
            return path, reference

        return self._once(("model", arch), make)

    def run(self, arch, name, resume=None, pristine=False, save_model=False, stage=3):

        def make():
            out, results = self.root / "runs" / name, self.root / "results" / name
            argv = [
                "--model", arch, "--model-dir",
                str(self.model(arch)[0]), "--output-dir",
                str(out), "--results",
                str(results), "--max-steps",
                str(STEPS), "--save-steps",
                str(SAVE_STEPS), "--workaround",
                str(WORKAROUND), "--stage",
                str(stage)
            ]
            if resume is not None:
                argv += ["--resume", str(resume)]
            if save_model:
                argv += ["--save-model", str(out / "final")]
            _launch(self.root / f"{name}.log", argv, pristine)
            return Results(results, out)

        return self._once(("run", name), make)

    def fresh(self, arch):
        """The series: an uninterrupted run, then save_model."""
        return self.run(arch, f"{arch}_fresh", save_model=True)

    def resumed(self, arch):
        """The series, resumed from the fresh run's step-3 checkpoint."""
        return self.run(arch, f"{arch}_resumed", resume=self.fresh(arch).output_dir / f"checkpoint-{SAVE_STEPS}")

    def pristine(self, arch, stage=3):
        """Pristine DeepSpeed 0.19.8: an uninterrupted run."""
        return self.run(arch, f"{arch}_pristine_zero{stage}", pristine=True, stage=stage)

    def upgraded(self, arch, stage=3):
        """The series, resumed from pristine's step-3 checkpoint."""
        return self.run(arch,
                        f"{arch}_upgraded_zero{stage}",
                        resume=self.pristine(arch, stage).output_dir / f"checkpoint-{SAVE_STEPS}",
                        stage=stage)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return Runs(tmp_path_factory.mktemp("keep_in_fp32_trainer"))


def _check_dtypes(results, kept, when):
    """Every rank: the kept parameters are fp32 (and their partitions), every other one bf16."""
    for rank in range(2):
        dtypes = results.rank[rank][when]
        for name, (dtype, partition_dtype) in dtypes.items():
            want = "torch.float32" if name in kept else "torch.bfloat16"
            assert dtype == partition_dtype == want, (when, rank, name, dtype, partition_dtype)


def _check_trains(results, steps):
    """Every rank: one finite loss per step of ``steps``, near ln(vocab) at step 1 (a model that holds the file's
    values, not garbage), falling over the run."""
    for rank in range(2):
        losses = results.losses(rank)
        assert sorted(losses) == list(steps), (rank, losses)
        assert all(math.isfinite(loss) for loss in losses.values()), (rank, losses)
        if steps[0] == 1:
            assert abs(losses[1] - math.log(_trainer_run.VOCAB)) < 0.5, (rank, losses)
        assert losses[steps[-1]] < losses[steps[0]] - 0.1, (rank, losses)


def _check_saved_file(path, values, kept, kept_buffers):
    """The safetensors file ``path`` (save_model's) holds every kept parameter in fp32, equal to its fp32 master in
    ``values`` ({name: (full value, master)}), and every other floating tensor in bf16; the other parameters saved
    under their own names equal their full bf16 values. DeepSeek-V4 saves most tensors under its original checkpoint
    names: a kept parameter saved under another name is found among the fp32 tensors by its value."""
    saved = safetensors_torch.load_file(str(path))
    fp32 = {name: t for name, t in saved.items() if t.dtype == torch.float32}
    others = {t.dtype for t in saved.values() if t.is_floating_point() and t.dtype != torch.float32}
    assert others <= {torch.bfloat16}, others
    assert len(fp32) == len(kept) + kept_buffers, (len(fp32), len(kept), kept_buffers, sorted(fp32))
    for name in kept:
        master = values[name][1]
        assert master is not None and master.dtype == torch.float32, name
        if name in saved:
            assert saved[name].dtype == torch.float32, (name, saved[name].dtype)
            assert torch.equal(saved[name], master), f"{name} in {path} differs from its fp32 master"
        else:
            hits = [key for key, t in fp32.items() if t.shape == master.shape and torch.equal(t, master)]
            assert hits, f"{path} has no fp32 tensor equal to the master of {name}"
    for name, (value, _) in values.items():
        if name not in kept and name in saved:
            assert saved[name].dtype == torch.bfloat16 and torch.equal(saved[name], value), name


@pytest.mark.parametrize("arch", ALL_MODELS)
def test_train_and_save_model(runs, arch):
    model_cls = MODELS[arch]()[0]
    path, reference = runs.model(arch)
    results = runs.fresh(arch)
    kept = set(results.kept)
    # The run used the DeepSpeed under test and kept what the strict list names (for DeepSeek-V3: the routers).
    assert all(r["deepspeed"] == deepspeed.__path__[0] for r in results.rank), [r["deepspeed"] for r in results.rank]
    pattern = _strict_pattern(model_cls)
    assert kept == {name for name in reference if pattern.search(name)} and kept
    if arch == "deepseek_v3":
        assert "gate.weight" in model_cls._keep_in_fp32_modules_strict
        assert kept == {f"model.layers.{i}.mlp.gate.weight" for i in range(2)}
    _check_dtypes(results, kept, "begin_dtypes")
    _check_dtypes(results, kept, "end_dtypes")

    # from_pretrained under zero.Init (and, for DeepSeek-V4's final norm, the workaround) loaded the file: kept
    # parameters exactly, the others rounded to bf16.
    begin = results.pt("begin")
    assert set(begin) == set(reference)
    for name, (value, master) in begin.items():
        if name in kept:
            assert value.dtype == torch.float32 and torch.equal(value, reference[name]), name
            assert torch.equal(master, value), name
        else:
            assert value.dtype == torch.bfloat16 and torch.equal(value, reference[name].to(torch.bfloat16)), name
    _check_trains(results, range(1, STEPS + 1))

    # save_model: the gathered 16-bit state dict holds the kept parameters in fp32, equal to their masters.
    final = results.pt("final")
    for name, (value, master) in final.items():
        if name in kept:
            assert value.dtype == torch.float32 and torch.equal(value, master), name
        else:
            assert value.dtype == torch.bfloat16 and torch.equal(value, master.to(torch.bfloat16)), name
    model = model_cls(MODELS[arch]()[1])
    kept_buffers = sum(1 for name, b in model.named_buffers()
                       if b.is_floating_point() and pattern.search(name) and name in model.state_dict())
    _check_saved_file(results.output_dir / "final" / "model.safetensors", final, kept, kept_buffers)
    # The Trainer checkpoint of step 3 holds the model the same way.
    _check_saved_file(results.output_dir / f"checkpoint-{SAVE_STEPS}" / "model.safetensors",
                      results.pt(f"masters_step{SAVE_STEPS}"), kept, kept_buffers)
    # What users get back from the saved model (transformers maps DeepSeek-V4's names).
    plain = model_cls.from_pretrained(str(results.output_dir / "final"), dtype=torch.float32)
    for name, p in plain.named_parameters():
        value, master = final[name]
        assert torch.equal(p.data, master if name in kept else value.float()), name


@pytest.mark.parametrize("arch", ALL_MODELS)
def test_resume_continues_exactly(runs, arch):
    fresh, resumed = runs.fresh(arch), runs.resumed(arch)
    kept = set(fresh.kept)
    assert all(r["begin_step"] == SAVE_STEPS for r in resumed.rank)
    _check_dtypes(resumed, kept, "begin_dtypes")
    # The loaded state is the saved one: values and masters, bit for bit.
    saved, loaded = fresh.pt(f"masters_step{SAVE_STEPS}"), resumed.pt("begin")
    for name, (value, master) in loaded.items():
        assert torch.equal(value, saved[name][0]) and torch.equal(master, saved[name][1]), name
    # Same data order, RNG and optimizer state: the same losses, exactly.
    for rank in range(2):
        want = {step: loss for step, loss in fresh.losses(rank).items() if step > SAVE_STEPS}
        assert resumed.losses(rank) == want, (rank, resumed.losses(rank), want)


@pytest.mark.skipif(not PRISTINE_TREE, reason="DS_PRISTINE_TREE (pristine DeepSpeed 0.19.8, set by make test) unset")
@pytest.mark.skipif(not hasattr(transformers, "DeepseekV3ForCausalLM"), reason="no DeepSeek-V3 in transformers")
# ZeRO-3 in the fast subset; ZeRO-2's upgrade is also the conformance matrix's (test_checkpoint_conformance.py)
@pytest.mark.parametrize("stage", [3, pytest.param(2, marks=pytest.mark.nightly)], ids=["zero3", "zero2"])
def test_resume_a_pristine_checkpoint(runs, stage):
    arch = "deepseek_v3"
    pristine, upgraded = runs.pristine(arch, stage), runs.upgraded(arch, stage)
    kept = set(upgraded.kept)
    tree = os.path.realpath(PRISTINE_TREE)
    assert all(os.path.realpath(r["deepspeed"]).startswith(tree + os.sep) for r in pristine.rank)
    assert all(r["deepspeed"] == deepspeed.__path__[0] for r in upgraded.rank)
    # Pristine trains the routers in bf16 (from fp32 masters) and learns.
    _check_dtypes(pristine, set(), "end_dtypes")
    _check_trains(pristine, range(1, STEPS + 1))

    # The series resumes at step 3 with the routers in fp32, equal to the masters pristine saved; every other
    # parameter holds pristine's master rounded to bf16, as pristine's own run did.
    assert all(r["begin_step"] == SAVE_STEPS for r in upgraded.rank)
    _check_dtypes(upgraded, kept, "begin_dtypes")
    _check_dtypes(upgraded, kept, "end_dtypes")
    saved, loaded = pristine.pt(f"masters_step{SAVE_STEPS}"), upgraded.pt("begin")
    for name, (value, master) in loaded.items():
        assert torch.equal(master, saved[name][1]), f"{name}: the master differs from the one pristine saved"
        if name in kept:
            assert value.dtype == torch.float32 and torch.equal(value, saved[name][1]), name
        else:
            assert torch.equal(value, saved[name][0]), name

    # The loss continues where pristine's own run goes: close at the first resumed step (the routers compute from
    # their fp32 masters now, not from those rounded to bf16), far closer than a restart would be.
    _check_trains(upgraded, range(SAVE_STEPS + 1, STEPS + 1))
    for rank in range(2):
        ours, theirs = upgraded.losses(rank), pristine.losses(rank)
        first = SAVE_STEPS + 1
        assert abs(ours[first] - theirs[first]) < 2e-3, (rank, ours, theirs)
        assert abs(ours[first] - theirs[first]) < 0.1 * abs(theirs[first] - theirs[1]), (rank, ours, theirs)
        for step in range(first, STEPS + 1):
            assert abs(ours[step] - theirs[step]) < 2e-2, (rank, step, ours, theirs)
