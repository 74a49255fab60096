# Copyright (c) DeepSpeed Team.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""Starting one training job: ``torchrun`` with ``world_size`` ranks of ``worker.py``, importing either DeepSpeed
build. The parent process (compare_pristine.py, run.py) never imports DeepSpeed: ``PYTHONPATH=build/pristine`` puts
pristine DeepSpeed 0.19.8 first, the venv's editable install (the dev tree with the patch series) is the other.
"""

import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PRISTINE = ROOT / "build" / "pristine"
DEV_TREE = ROOT / "build" / "deepspeed"
SDIST = ROOT / "build" / "cache" / "deepspeed-0.19.8.tar.gz"
BUILDS = ("pristine", "patched")
WORKER = Path(__file__).resolve().parent / "worker.py"


def dev_tree_state():
    """The patched build's version: the dev tree's commit (``build/deepspeed`` is a git repository), ``+dirty`` and
    a hash of the diff when it has uncommitted edits. It changes when the series is rebuilt during a run."""

    def git(*args):
        return subprocess.run(["git", "-C", str(DEV_TREE), *args], capture_output=True, text=True).stdout

    head = git("rev-parse", "--short=12", "HEAD").strip()
    if not head:
        return "unknown (no git repository at build/deepspeed)"
    diff = git("diff", "HEAD")
    if diff:
        import hashlib
        head += "+dirty:" + hashlib.sha1(diff.encode()).hexdigest()[:8]
    return head


def on_gpu():
    import torch
    return os.environ.get("DS_ACCELERATOR", "cuda" if torch.cuda.is_available() else "cpu") == "cuda"


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def ensure_pristine():
    """Unpack pristine DeepSpeed 0.19.8 into build/pristine from the sdist `make setup` cached, as tools/test does."""
    if (PRISTINE / "deepspeed" / "__init__.py").exists():
        return
    sdist = SDIST
    if not sdist.exists():
        raise SystemExit(f"pristine DeepSpeed not found at {PRISTINE}, nor its sdist at {sdist}: run `make setup`")
    PRISTINE.mkdir(parents=True, exist_ok=True)
    subprocess.run(
        ["tar", "--no-same-owner", "-xzf",
         str(sdist), "-C", str(PRISTINE), "--strip-components=1"], check=True)


def build_env(build):
    """Environment of a child process that imports the given DeepSpeed build."""
    env = dict(os.environ)
    paths = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and Path(p).resolve() != PRISTINE.resolve()]
    if build == "pristine":
        ensure_pristine()
        paths.insert(0, str(PRISTINE))
    elif build != "patched":
        raise ValueError(build)
    env["PYTHONPATH"] = os.pathsep.join(paths)
    if "DS_ACCELERATOR" not in env and not on_gpu():
        env["DS_ACCELERATOR"] = "cpu"
    if env.get("DS_ACCELERATOR") == "cpu":
        env.setdefault("OMP_NUM_THREADS", "1")
    # The two builds compile their CPU comm op from different source paths; in one extensions folder each would
    # rebuild it (half a minute) whenever the other had run last.
    base = Path(os.environ.get("TORCH_EXTENSIONS_DIR") or (ROOT / "build" / "cache" / "torch_extensions"))
    env["TORCH_EXTENSIONS_DIR"] = str(base / build)
    env.setdefault("TRANSFORMERS_VERBOSITY", "error")
    env.setdefault("PYTHONWARNINGS", "ignore")
    return env


_SHM_BUILT = set()


def prepare_build(build):
    """Import the build once and build its CPU shared-memory comm op (a JIT extension) before several ranks do."""
    if build in _SHM_BUILT:
        return
    code = ("import deepspeed, sys\n"
            "from deepspeed.accelerator import get_accelerator\n"
            "if get_accelerator().device_name() == 'cpu':\n"
            "    from deepspeed.comm.torch import build_shm_op\n"
            "    build_shm_op()\n"
            "print(deepspeed.__version__, deepspeed.__path__[0])\n")
    out = subprocess.run([sys.executable, "-c", code],
                         env=build_env(build),
                         capture_output=True,
                         text=True,
                         timeout=900)
    if out.returncode != 0:
        raise SystemExit(f"importing the {build} DeepSpeed failed:\n{out.stderr[-4000:]}")
    _SHM_BUILT.add(build)
    return out.stdout.strip().splitlines()[-1]


def remove_shm_segments(port, addr="127.0.0.1"):
    """Unlink the shared-memory segments the ranks of a finished job left behind.

    DeepSpeed's CPU comm op (csrc/cpu/comm/shm.cpp) creates one segment of 66 MiB per rank in /dev/shm, named
    after the master address and port, and never unlinks it: without this, every job would leave
    world_size x 66 MiB of RAM in use until the machine restarts.
    """
    shm = Path("/dev/shm")
    if not shm.is_dir():
        return
    for segment in shm.glob(f"deepspeed_allreduce_buffer_{os.getuid()}_{addr}_{port}_*"):
        try:
            segment.unlink()
        except OSError:
            pass


def launch(spec, build, world_size, job_dir, timeout=1200, extra_env=None):
    """Run one training job with the given build: ``torchrun --nproc-per-node world_size worker.py SPEC``, one
    process per rank (gloo on the CPU, NCCL on CUDA), with ``extra_env`` added to their environment. Returns the
    ranks' results (``rank<r>.json``).

    torchrun stops the other ranks when one fails; its own output goes to ``torchrun.log``, each rank's to
    ``rank<r>.log`` in ``job_dir``.
    """
    assert "deepspeed" not in sys.modules, "the parent process imported DeepSpeed: pristine and series would mix"
    job_dir = Path(job_dir)
    job_dir.mkdir(parents=True, exist_ok=True)
    for old in job_dir.glob("rank*.json"):
        old.unlink()
    spec = dict(spec, build=build, job_dir=str(job_dir))
    spec_path = job_dir / "spec.json"
    spec_path.write_text(json.dumps(spec, indent=1))
    prepare_build(build)
    env = dict(build_env(build), **(extra_env or {}))
    # The CPU accelerator counts its devices from LOCAL_SIZE (DeepSpeed's own launcher sets it; torchrun does not).
    env["LOCAL_SIZE"] = str(world_size)
    port = _free_port()
    command = [
        sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node",
        str(world_size), "--master-addr", "127.0.0.1", "--master-port",
        str(port),
        str(WORKER),
        str(spec_path)
    ]
    failed = None
    with open(job_dir / "torchrun.log", "w") as log:
        # its own process group, so that a timeout stops torchrun and its ranks together
        proc = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            if proc.wait(timeout=timeout) != 0:
                failed = f"torchrun exited with {proc.returncode}"
        except subprocess.TimeoutExpired:
            failed = f"timed out after {timeout} s"
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        except BaseException:  # interrupted: stop the ranks too
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            raise
    remove_shm_segments(port)
    if failed:
        logs = ["torchrun.log"] + [f"rank{rank}.log" for rank in range(world_size)]
        tails = "".join(f"\n--- {name} (tail) ---\n" + (job_dir / name).read_text()[-3000:] for name in logs
                        if (job_dir / name).exists())
        raise RuntimeError(f"{build} job in {job_dir} failed: {failed}{tails}")
    return [json.loads((job_dir / f"rank{rank}.json").read_text()) for rank in range(world_size)]
