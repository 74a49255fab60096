# Copyright (c) DeepSpeed Team.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""Shared code of the benchmarks: tiny models, the ZeRO-3 config, and a launcher that runs one training job with
either DeepSpeed build, one subprocess per rank.

The parent process (compare_pristine.py, run.py) never imports DeepSpeed: each job runs in fresh child processes,
``PYTHONPATH=build/pristine`` for pristine DeepSpeed 0.19.8, the venv's editable install (the dev tree with the
patch series) otherwise. Each child is this file run as ``python common.py --worker SPEC``; it trains, measures and
writes ``rank<r>.json`` (and, when asked, the final parameters) into the job's folder.
"""

import argparse
import collections
import gc
import json
import math
import os
import platform
import socket
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PRISTINE = ROOT / "build" / "pristine"
DEV_TREE = ROOT / "build" / "deepspeed"
SDIST = ROOT / "build" / "cache" / "deepspeed-0.19.8.tar.gz"
BUILDS = ("pristine", "patched")

# ---------------------------------------------------------------------------------------------------------------
# Models
# ---------------------------------------------------------------------------------------------------------------

VOCAB = 256

sys.path.insert(0, str(ROOT / "tests"))
from unit import tiny_hf_models  # noqa: E402  (the tiny transformers models the tests, demo and study share)

# The benchmark's sizes of the shared tiny models (tests/unit/tiny_hf_models.py): wider than the tests' (hidden 64,
# vocabulary 256), so that a step does some arithmetic. None: transformers' default.
HF_SIZES = {
    "deepseek_v4":
    dict(vocab_size=VOCAB,
         hidden_size=64,
         num_attention_heads=4,
         head_dim=32,
         qk_rope_head_dim=8,
         q_lora_rank=32,
         o_lora_rank=32,
         moe_intermediate_size=64,
         index_head_dim=16,
         index_topk=4,
         sliding_window=8,
         num_nextn_predict_layers=0,
         max_position_embeddings=256),
    "gpt_oss":
    dict(vocab_size=VOCAB,
         hidden_size=64,
         intermediate_size=64,
         num_attention_heads=4,
         num_key_value_heads=2,
         sliding_window=8,
         layer_types=["sliding_attention", "full_attention"],
         max_position_embeddings=None,
         rope_parameters=None),
}
HF_MODELS = tuple(HF_SIZES)


def save_hf_model(kind, directory, seed=1234):
    """Randomly initialise the tiny ``kind`` model (seeded) and save it in fp32 safetensors. Returns the folder."""
    import transformers
    directory = Path(directory)
    if (directory / "model.safetensors").exists():
        return directory
    transformers.utils.logging.disable_progress_bar()
    tiny_hf_models.save_tiny_model(kind, directory, seed=seed, **HF_SIZES[kind])
    return directory


def keep_elements_for_share(share, dim, layers, vocab=VOCAB):
    """Elements of the listed ``keep`` parameter per block so that they are ``share`` of all elements of TinyNet."""
    if not share:
        return 0
    other = 2 * vocab * dim + layers * (dim * dim + 2 * dim) + 2 * dim
    return max(1, round(share * other / (1.0 - share) / layers))


def make_tiny_net(dim, layers, keep_per_block, vocab=VOCAB):
    """A small torch language model: embedding, ``layers`` blocks of Linear + LayerNorm, head, cross-entropy loss.

    With ``keep_per_block`` > 0 each block also has a parameter ``keep`` of that many elements that scales its
    output; the benchmark lists it with ``keep_in_fp32_modules: ["keep"]``. Nothing is listed by the model itself.
    """
    import torch
    import torch.nn.functional as F

    class Block(torch.nn.Module):

        def __init__(self):
            super().__init__()
            self.proj = torch.nn.Linear(dim, dim, bias=False)
            self.norm = torch.nn.LayerNorm(dim)
            if keep_per_block:
                self.keep = torch.nn.Parameter(torch.randn(keep_per_block) * 0.1)

        def forward(self, h):
            out = torch.tanh(self.proj(self.norm(h)))
            if keep_per_block:
                out = out * (1 + self.keep.float().pow(2).mean()).to(out.dtype)
            return h + out

    class TinyNet(torch.nn.Module):

        def __init__(self):
            super().__init__()
            self.embed = torch.nn.Embedding(vocab, dim)
            self.blocks = torch.nn.ModuleList(Block() for _ in range(layers))
            self.final_norm = torch.nn.LayerNorm(dim)
            self.head = torch.nn.Linear(dim, vocab, bias=False)

        def forward(self, input_ids, labels):
            h = self.embed(input_ids)
            for block in self.blocks:
                h = block(h)
            logits = self.head(self.final_norm(h)).float()
            return F.cross_entropy(logits[:, :-1].reshape(-1, vocab), labels[:, 1:].reshape(-1))

    return TinyNet()


# ---------------------------------------------------------------------------------------------------------------
# Config and machine
# ---------------------------------------------------------------------------------------------------------------

UNSET = "<default>"  # keep_in_fp32_modules left out of the config (DeepSpeed's default, "auto")


def ds_config(micro_batch, world_size, keep=UNSET, dtype="bf16", overrides=None):
    config = {
        "train_micro_batch_size_per_gpu": micro_batch,
        "gradient_accumulation_steps": 1,
        "train_batch_size": micro_batch * world_size,
        "gradient_clipping": 1.0,
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 10**9,
        "zero_optimization": {
            "stage": 3,
            # Tiny models: gather every parameter (the default threshold, 1e5 elements, would make all of them
            # persistent, so no fetch would be measured), and several reduce buckets per step.
            "stage3_param_persistence_threshold": 0,
            "reduce_bucket_size": 50000,
            "stage3_prefetch_bucket_size": 50000,
        },
    }
    config["bf16" if dtype == "bf16" else "fp16"] = {"enabled": True}
    if dtype == "fp16":
        config["fp16"].update({"initial_scale_power": 8, "loss_scale_window": 100})
    if keep != UNSET:
        config["data_types"] = {"keep_in_fp32_modules": keep}
    for key, value in (overrides or {}).items():
        if isinstance(value, dict) and isinstance(config.get(key), dict):
            config[key].update(value)
        else:
            config[key] = value
    return config


def describe_keep(keep):
    return 'default ("auto")' if keep == UNSET else json.dumps(keep)


def machine_description():
    import torch
    info = {"python": platform.python_version(), "torch": torch.__version__, "platform": platform.platform()}
    cpu = platform.processor() or "unknown"
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    info["cpu"] = cpu
    info["cores"] = os.cpu_count()
    try:
        info["cores_usable"] = len(os.sched_getaffinity(0))
    except AttributeError:
        info["cores_usable"] = os.cpu_count()
    try:
        with open("/proc/meminfo") as f:
            info["memory_gib"] = round(int(f.readline().split()[1]) / 2**20, 1)
    except (OSError, ValueError, IndexError):
        pass
    try:
        import transformers
        info["transformers"] = transformers.__version__
    except ImportError:
        pass
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
        info["gpus"] = torch.cuda.device_count()
        info["cuda"] = torch.version.cuda
    return info


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


def machine_line(info):
    line = (f"{info['cpu']}, {info['cores']} cores ({info['cores_usable']} usable)"
            f"{', %s GiB RAM' % info['memory_gib'] if 'memory_gib' in info else ''}; "
            f"Python {info['python']}, torch {info['torch']}, transformers {info.get('transformers', '?')}")
    if "gpu" in info:
        line += f"; GPU: {info['gpus']} x {info['gpu']} (CUDA {info['cuda']})"
    return line


def on_gpu():
    import torch
    return os.environ.get("DS_ACCELERATOR", "cuda" if torch.cuda.is_available() else "cpu") == "cuda"


# ---------------------------------------------------------------------------------------------------------------
# Launcher (parent side)
# ---------------------------------------------------------------------------------------------------------------


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


def launch(spec, build, world_size, job_dir, timeout=1200):
    """Run one training job: ``world_size`` child processes of the given build. Returns the ranks' results."""
    job_dir = Path(job_dir)
    job_dir.mkdir(parents=True, exist_ok=True)
    for old in job_dir.glob("rank*.json"):
        old.unlink()
    spec = dict(spec, build=build, job_dir=str(job_dir))
    spec_path = job_dir / "spec.json"
    spec_path.write_text(json.dumps(spec, indent=1))
    prepare_build(build)
    env = build_env(build)
    env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), WORLD_SIZE=str(world_size))
    procs = []
    for rank in range(world_size):
        rank_env = dict(env, RANK=str(rank), LOCAL_RANK=str(rank), LOCAL_SIZE=str(world_size))
        log = open(job_dir / f"rank{rank}.log", "w")
        procs.append(
            (subprocess.Popen(
                [sys.executable, __file__, "--worker", str(spec_path)],
                env=rank_env,
                stdout=log,
                stderr=subprocess.STDOUT), log))
    deadline = time.time() + timeout
    failed = None
    # Wait for all ranks; if one fails, the others would wait for it in a collective: stop them.
    while failed is None and any(proc.poll() is None for proc, _ in procs):
        for rank, (proc, _) in enumerate(procs):
            if proc.poll() not in (0, None):
                failed = f"rank {rank} exited with {proc.returncode}"
                break
        if failed is None and time.time() > deadline:
            failed = f"timed out after {timeout} s"
        time.sleep(0.2)
    for rank, (proc, _) in enumerate(procs):
        if failed is None and proc.returncode != 0:
            failed = f"rank {rank} exited with {proc.returncode}"
    for proc, log in procs:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        log.close()
    remove_shm_segments(env["MASTER_PORT"])
    if failed:
        tails = "".join(f"\n--- rank{rank}.log (tail) ---\n" + (job_dir / f"rank{rank}.log").read_text()[-3000:]
                        for rank in range(world_size))
        raise RuntimeError(f"{build} job in {job_dir} failed: {failed}{tails}")
    return [json.loads((job_dir / f"rank{rank}.json").read_text()) for rank in range(world_size)]


# ---------------------------------------------------------------------------------------------------------------
# Worker (child side)
# ---------------------------------------------------------------------------------------------------------------

COMM_KINDS = {
    "all_gather_into_tensor": "all-gather",
    "all_gather": "all-gather",
    "all_gather_base": "all-gather",
    "all_gather_coalesced": "all-gather",
    "reduce_scatter_tensor": "reduce-scatter",
    "reduce_scatter": "reduce-scatter",
    "all_reduce": "all-reduce",
    "all_reduce_coalesced": "all-reduce",
    "inference_all_reduce": "all-reduce",
    "reduce": "reduce",
    "broadcast": "broadcast",
    "all_to_all_single": "all-to-all",
    "all_to_all": "all-to-all",
}


def _first_tensor(values):
    import torch
    for value in values:
        if isinstance(value, torch.Tensor):
            return value
        if isinstance(value, (list, tuple)):
            found = _first_tensor(value)
            if found is not None:
                return found
    return None


def _tensors(values):
    import torch
    for value in values:
        if isinstance(value, torch.Tensor):
            yield value
        elif isinstance(value, (list, tuple)):
            yield from _tensors(value)


class CommCounter:
    """Counts the collectives that reach DeepSpeed's communication backend, by kind and dtype.

    Wraps the backend's methods (``deepspeed.comm.comm.cdb``), which every ``deepspeed.comm`` collective calls.
    DeepSpeed's comms logger counts the same calls by name and message size but not by dtype.
    """

    def __init__(self):
        import deepspeed.comm.comm as dcomm
        self.counts = collections.Counter()
        self.bytes = collections.Counter()
        self.active = False
        cdb = dcomm.cdb
        for op in COMM_KINDS:
            fn = getattr(cdb, op, None)
            if fn is not None:
                setattr(cdb, op, self._wrap(op, fn))

    def _wrap(self, op, fn):

        def counted(*args, **kwargs):
            if self.active:
                values = list(args) + list(kwargs.values())
                tensor = _first_tensor(values)
                key = (COMM_KINDS[op], str(tensor.dtype).replace("torch.", "") if tensor is not None else "-")
                self.counts[key] += 1
                # message: the largest tensor argument (the gathered output, the reduce-scatter input)
                self.bytes[key] += max((t.numel() * t.element_size() for t in _tensors(values)), default=0)
            return fn(*args, **kwargs)

        return counted

    def snapshot(self):
        return {
            f"{kind}|{dtype}": [self.counts[(kind, dtype)], self.bytes[(kind, dtype)]]
            for kind, dtype in self.counts
        }


def _storage_key(tensor):
    try:
        storage = tensor.untyped_storage()
        return storage.data_ptr(), storage.nbytes(), tensor.device.type
    except (RuntimeError, NotImplementedError):
        return None


def live_tensor_bytes(device_type):
    """Bytes of all distinct tensor storages on ``device_type`` that Python objects reach (a CPU allocator census)."""
    import torch
    seen = set()
    total = 0
    for obj in gc.get_objects():
        if isinstance(obj, torch.Tensor):
            key = _storage_key(obj)
            if key and key[0] and key[2] == device_type and key[0] not in seen:
                seen.add(key[0])
                total += key[1]
    return total


def optimizer_state_bytes(optimizer):
    """Bytes the ZeRO-3 optimizer holds, by component (each storage counted once, in the first component)."""
    import torch
    seen = set()

    def size(tensors):
        total = 0
        for t in tensors:
            if not isinstance(t, torch.Tensor):
                continue
            key = _storage_key(t)
            if key and key[0] and key[0] not in seen:
                seen.add(key[0])
                total += key[1]
        return total

    states = []
    for state in optimizer.optimizer.state.values():
        states.extend(v for v in state.values() if isinstance(v, torch.Tensor) and v.dim() > 0)
    buckets = getattr(optimizer, "ipg_buckets", None) or {}
    components = collections.OrderedDict()
    components["param partitions, training dtype"] = size([getattr(optimizer, "lp_param_buffer", None)])
    components["param partitions, fp32 (kept)"] = size([getattr(optimizer, "kept_param_buffer", None)])
    components["fp32 master partitions"] = size(getattr(optimizer, "fp32_partitioned_groups_flat", []))
    components["grad partitions, training dtype"] = size([getattr(optimizer, "grad_partitions_flat_buffer", None)])
    components["grad partitions, fp32 (kept)"] = size([getattr(optimizer, "kept_grad_partitions_flat_buffer", None)])
    components["reduce (ipg) buckets"] = size([getattr(b, "buffer", None) for b in buckets.values()])
    components["optimizer states"] = size(states)
    return components


def _rss_bytes():
    import resource
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB


def _current_rss_bytes():
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return 0


def _bits(t):
    """The tensor's bit pattern as an integer tensor (so that comparisons are bitwise, NaN included)."""
    import torch
    ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
    return t.contiguous().view(ints[t.element_size()])


def _exit_with_parent():
    """End this rank if the launcher goes away (killed, interrupted), instead of waiting in a collective forever."""
    import threading
    parent = os.getppid()

    def watch():
        while True:
            time.sleep(2)
            if os.getppid() != parent:
                os._exit(3)

    threading.Thread(target=watch, daemon=True).start()


def build_engine(spec, config):
    """The model of ``spec`` (seeded; HF models loaded under zero.Init) wrapped by deepspeed.initialize."""
    import torch
    import deepspeed
    # "fp32" and "autocast" (torch autocast, no bf16/fp16 section) train fp32 weights
    train_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(spec["dtype"], torch.float32)
    torch.manual_seed(spec["seed"])
    if spec["model"] in HF_MODELS:
        from transformers.integrations import HfDeepSpeedConfig
        hf_ds_config = HfDeepSpeedConfig(config)  # noqa: F841  (zero.Init while from_pretrained runs)
        model = tiny_hf_models.model_class(spec["model"]).from_pretrained(spec["model_dir"], dtype=train_dtype)

        def loss_fn(engine, ids):
            return engine(input_ids=ids, labels=ids).loss
    else:
        with deepspeed.zero.Init(config_dict_or_path=config):
            model = make_tiny_net(spec["dim"], spec["layers"], spec["keep_per_block"])

        def loss_fn(engine, ids):
            return engine(ids, ids)

    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=spec.get("lr", 1e-3), weight_decay=0.0)
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    return engine, loss_fn


def _paired_main(spec, rank, job_dir, device):
    """Two engines of one build in the same processes (``spec["paired"]``: their configs), trained on the same
    batches in alternating steps (A, B, A, B, ...), so that the machine's load falls on both alike."""
    import torch
    import deepspeed.comm as dist
    from deepspeed.accelerator import get_accelerator
    acc = get_accelerator()
    engines = [build_engine(spec, config) for config in spec["paired"]]
    gen = torch.Generator().manual_seed(spec["seed"] * 1000 + rank)
    total_steps = spec["warmup"] + spec["steps"]
    batches = [torch.randint(0, VOCAB, (spec["micro_batch"], spec["seq"]), generator=gen) for _ in range(total_steps)]
    times = [[] for _ in engines]
    cpu = [[] for _ in engines]
    losses = [[] for _ in engines]
    for step in range(total_steps):
        # alternate which engine goes first, so that neither always follows the other
        order = range(len(engines)) if step % 2 == 0 else reversed(range(len(engines)))
        for i in order:
            engine, loss_fn = engines[i]
            ids = batches[step].to(device)
            acc.synchronize()
            start, cpu_start = time.perf_counter(), time.process_time()
            loss = loss_fn(engine, ids)
            engine.backward(loss)
            engine.step()
            acc.synchronize()
            times[i].append(time.perf_counter() - start)
            cpu[i].append(time.process_time() - cpu_start)
            losses[i].append(loss.detach().float().item())
    result = {
        "rank": rank,
        "paired": True,
        "step_times": [t[spec["warmup"]:] for t in times],
        "cpu_times": [c[spec["warmup"]:] for c in cpu],
        "losses": losses,
        "fp32_params": [sum(p.dtype == torch.float32 for p in e.module.parameters()) for e, _ in engines],
    }
    dist.barrier()
    (job_dir / f"rank{rank}.json").write_text(json.dumps(result))
    dist.barrier()


def worker_main(spec_path):
    spec = json.loads(Path(spec_path).read_text())
    _exit_with_parent()
    rank = int(os.environ["RANK"])
    world_size = int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ["LOCAL_RANK"])
    job_dir = Path(spec["job_dir"])

    import torch
    import deepspeed
    import deepspeed.comm as dist
    from deepspeed.accelerator import get_accelerator

    ds_path = Path(deepspeed.__path__[0]).resolve()
    expected = (PRISTINE if spec["build"] == "pristine" else DEV_TREE) / "deepspeed"
    if spec["build"] == "pristine" and ds_path != expected.resolve():
        raise SystemExit(f"expected pristine DeepSpeed at {expected}, imported {ds_path}")
    if spec["build"] == "patched" and PRISTINE.resolve() in ds_path.parents:
        raise SystemExit(f"expected the patched DeepSpeed, imported the pristine one at {ds_path}")

    acc = get_accelerator()
    device_type = acc.device_name()
    if spec["dtype"] == "fp16" and device_type == "cpu":
        # DeepSpeed refuses fp16 on CPUs without avx512_fp16; the benchmark only needs it to run.
        type(acc).is_fp16_supported = lambda self: True
    if device_type != "cpu":
        acc.set_device(local_rank)
    backend = "gloo" if device_type == "cpu" else acc.communication_backend_name()
    deepspeed.init_distributed(dist_backend=backend)

    config = spec["config"]
    micro_batch, seq = spec["micro_batch"], spec["seq"]
    device = torch.device(acc.current_device_name())

    if spec.get("paired"):
        _paired_main(spec, rank, job_dir, device)
        return

    engine, loss_fn = build_engine(spec, config)
    zero_opt = engine.optimizer

    params = list(engine.module.named_parameters())
    fp32_params = [(n, p) for n, p in params if p.dtype == torch.float32]
    kept_partition_elements = sum(p.ds_tensor.numel() for _, p in fp32_params)
    kept_elements = sum(p.ds_numel for _, p in fp32_params)

    counter = CommCounter()
    gen = torch.Generator().manual_seed(spec["seed"] * 1000 + rank)
    total_steps = spec["warmup"] + spec["steps"]
    batches = [torch.randint(0, VOCAB, (micro_batch, seq), generator=gen) for _ in range(total_steps + 2)]

    losses, step_times, cpu_times = [], [], []
    live_peak = 0
    for step in range(total_steps):
        if step == spec["warmup"]:
            counter.active = True
            if device_type != "cpu":
                acc.synchronize()
                acc.reset_peak_memory_stats()
        ids = batches[step].to(device)
        acc.synchronize()
        start, cpu_start = time.perf_counter(), time.process_time()
        loss = loss_fn(engine, ids)
        engine.backward(loss)
        engine.step()
        acc.synchronize()
        step_times.append(time.perf_counter() - start)
        cpu_times.append(time.process_time() - cpu_start)
        losses.append(loss.detach().float().item())
    counter.active = False
    comm = counter.snapshot()
    timed = max(1, spec["steps"])

    result = {
        "rank": rank,
        "build": spec["build"],
        "deepspeed": deepspeed.__version__,
        "deepspeed_path": str(ds_path),
        "device": device_type,
        "backend": backend,
        "losses": losses,
        "loss_hex": [float(x).hex() for x in losses],
        "step_times": step_times[spec["warmup"]:],
        "warmup_times": step_times[:spec["warmup"]],
        # CPU seconds of this process (all its threads, gloo's included) per timed step: less sensitive than wall
        # time to other processes on a shared machine; waiting in a collective costs none
        "cpu_times": cpu_times[spec["warmup"]:],
        "comm_per_step": {
            k: [v[0] / timed, v[1] / timed]
            for k, v in comm.items()
        },
        "n_params": len(params),
        "n_elements": sum(p.ds_numel for _, p in params),
        "fp32_params": [n for n, _ in fp32_params],
        "kept_elements": kept_elements,
        "kept_partition_elements": kept_partition_elements,
        "param_dtypes": dict(collections.Counter(str(p.dtype).replace("torch.", "") for _, p in params)),
    }

    if spec.get("measure"):
        # One more step, measured: the live-tensor census (CPU) after backward and after the step, the optimizer's
        # state by component, and DeepSpeed's own comms logger, switched on for this step only.
        dist.configure(enabled=True, prof_all=True, verbose=False, debug=False)
        ids = batches[total_steps].to(device)
        loss = loss_fn(engine, ids)
        backward_peak = 0
        if device_type == "cpu":
            # During backward too: a census each time a gradient is about to enter its reduce bucket, when the
            # gradients that wait for their bucket's reduction are all alive.
            reduce_grad = zero_opt.reduce_independent_p_g_buckets_and_remove_grads

            def census_then_reduce(param):
                nonlocal backward_peak
                backward_peak = max(backward_peak, live_tensor_bytes("cpu"))
                return reduce_grad(param)

            zero_opt.reduce_independent_p_g_buckets_and_remove_grads = census_then_reduce
        engine.backward(loss)
        if device_type == "cpu":
            del zero_opt.reduce_independent_p_g_buckets_and_remove_grads
            result["live_tensor_backward_peak_bytes"] = backward_peak
            live_peak = max(live_peak, backward_peak, live_tensor_bytes("cpu"))
        engine.step()
        acc.synchronize()
        comms_dict = dist.comms_logger.comms_dict
        result["comms_logger"] = {name: sum(v[0] for v in sizes.values()) for name, sizes in comms_dict.items()}
        dist.configure(enabled=False)
        gc.collect()
        if device_type == "cpu":
            steady = live_tensor_bytes("cpu")
            result["live_tensor_bytes"] = steady
            result["live_tensor_peak_bytes"] = max(live_peak, steady)
        else:
            result["allocated_bytes"] = acc.memory_allocated()
            result["allocator_peak_bytes"] = acc.max_memory_allocated()
        result["optimizer_bytes"] = optimizer_state_bytes(zero_opt)
    result["peak_rss_bytes"] = _rss_bytes()
    result["rss_bytes"] = _current_rss_bytes()

    if spec.get("dump_params"):
        from deepspeed.utils import safe_get_full_fp32_param
        masters, gathered = {}, {}
        for name, p in params:
            masters[name] = safe_get_full_fp32_param(p).detach().cpu().clone()
            with deepspeed.zero.GatheredParameters([p]):
                gathered[name] = p.data.detach().cpu().clone()
        if rank == 0:
            torch.save({"master": masters, "gathered": gathered}, job_dir / "params.pt")

    dist.barrier()
    (job_dir / f"rank{rank}.json").write_text(json.dumps(result))
    # Let every rank write before the process group goes away.
    dist.barrier()
    if hasattr(dist, "destroy_process_group"):
        try:
            dist.destroy_process_group()
        except Exception:  # noqa: BLE001  (teardown only)
            pass


# ---------------------------------------------------------------------------------------------------------------
# Small helpers for the reports
# ---------------------------------------------------------------------------------------------------------------


def compare_tensors(a, b):
    """(bitwise identical, max abs difference) of two tensors; shapes and dtypes must match to be identical."""
    if a.shape != b.shape:
        return False, float("nan")
    same = a.dtype == b.dtype and bool(torch_equal_bits(a, b))
    diff = (a.double() - b.double()).abs()
    return same, float(diff.max()) if diff.numel() else 0.0


def torch_equal_bits(a, b):
    import torch
    return torch.equal(_bits(a), _bits(b))


def stats(values):
    values = sorted(values)
    if not values:
        return {"min": math.nan, "median": math.nan, "max": math.nan}
    n = len(values)
    median = values[n // 2] if n % 2 else 0.5 * (values[n // 2 - 1] + values[n // 2])
    return {"min": values[0], "median": median, "max": values[-1]}


def markdown_table(header, rows):
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def text_table(header, rows):
    cells = [list(map(str, header))] + [[str(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    fmt = "  ".join("{:<%d}" % w for w in widths)
    lines = [fmt.format(*cells[0]), fmt.format(*("-" * w for w in widths))]
    lines += [fmt.format(*r) for r in cells[1:]]
    return "\n".join(lines)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--worker", required=True, help="job spec (JSON) written by the launcher")
    worker_main(parser.parse_args().worker)
