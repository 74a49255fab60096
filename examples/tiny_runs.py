# Copyright (c) DeepSpeed Team.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""What the demo (examples/demo.py) and the accuracy study (benchmarks/accuracy_study.py) share.

Both train tiny Hugging Face models with ZeRO-3 on a few CPU ranks. The parent process writes the model with
``save_pretrained`` and starts one subprocess per rank (the script itself, run with ``--worker JOBS``); each rank
loads the model with ``from_pretrained`` under ZeRO-3, trains on the same synthetic data, and rank 0 prints the lines
meant for the reader with a mark that the parent echoes. Here: the command line, the tiny DeepSeek-V4, the data, the
ZeRO-3 steps of a rank, and the launch.
"""

import argparse
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

MARK = "@@ "  # rank 0 prefixes the lines meant for the reader with this
VOCAB, SEQ = 64, 16

# ---------------------------------------------------------------------------------------------------------------
# The command line
# ---------------------------------------------------------------------------------------------------------------


def arguments(doc, out, steps, lr):
    """The options both scripts take (their defaults: ``out``, ``steps``, ``lr``); a script may add its own."""
    parser = argparse.ArgumentParser(description=doc.split("\n")[0])
    parser.add_argument("--out", default=str(out), help="output folder (default: %(default)s)")
    parser.add_argument("--steps", type=int, default=steps, help="training steps per run (default: %(default)s)")
    parser.add_argument("--lr", type=float, default=lr, help="AdamW learning rate (default: %(default)s)")
    parser.add_argument("--micro-batch",
                        type=int,
                        default=8,
                        help="sequences per rank and step (default: %(default)s)")
    parser.add_argument("--world-size", type=int, default=2, help="ranks (default: %(default)s)")
    parser.add_argument("--worker", help=argparse.SUPPRESS)  # the jobs a rank trains, comma-separated
    return parser


def parse(parser):
    """The parsed options, ``--out`` made absolute; DeepSpeed on the CPU, one thread per rank, unless set."""
    args = parser.parse_args()
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    args.out = str(Path(args.out).resolve())
    return args


# ---------------------------------------------------------------------------------------------------------------
# Model and data
# ---------------------------------------------------------------------------------------------------------------

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from unit import tiny_hf_models  # noqa: E402  (the tiny transformers models the tests and benchmarks share)

# The sizes of the shared tiny models (tests/unit/tiny_hf_models.py) that the demo and the study train. None:
# transformers' default.
SIZES = {
    # hidden 32, 2 layers (sliding and compressed sparse attention), 4 routed experts
    "deepseek_v4":
    dict(vocab_size=VOCAB,
         num_attention_heads=4,
         o_lora_rank=16,
         moe_intermediate_size=32,
         index_head_dim=16,
         index_topk=4,
         sliding_window=8,
         layer_types=["sliding_attention", "compressed_sparse_attention"],
         mlp_layer_types=["moe", "moe"],
         compress_rates={
             "compressed_sparse_attention": 4,
             "heavily_compressed_attention": 8
         },
         num_nextn_predict_layers=0),
    # hidden 32, 2 layers (sliding and full attention), 4 experts
    "gpt_oss":
    dict(vocab_size=VOCAB,
         num_attention_heads=4,
         num_key_value_heads=2,
         head_dim=8,
         sliding_window=8,
         layer_types=["sliding_attention", "full_attention"],
         rope_parameters=None),
}


def tiny_model(kind, seed=0):
    """The tiny ``kind`` model of the demo and the study, random init after ``torch.manual_seed(seed)``."""
    return tiny_hf_models.tiny_model(kind, seed=seed, **SIZES[kind])


def write_model(model, model_dir):
    """``save_pretrained`` (safetensors, fp32), plus the state dict as ``initial_weights.safetensors``."""
    from safetensors.torch import save_file
    model.save_pretrained(model_dir)
    state = {n: t.detach().contiguous() for n, t in model.state_dict().items()}
    save_file(state, Path(model_dir) / "initial_weights.safetensors")


def batch(step, rank, micro_batch, seed=0):
    """Token sequences that follow a fixed random permutation (10 % noise): learnable, the same in every run."""
    import torch
    perm = torch.randperm(VOCAB, generator=torch.Generator().manual_seed(seed))
    g = torch.Generator().manual_seed(seed * 1_000_003 + step * 1_009 + rank)
    ids = torch.empty(micro_batch, SEQ, dtype=torch.long)
    ids[:, 0] = torch.randint(VOCAB, (micro_batch, ), generator=g)
    for t in range(1, SEQ):
        noise = torch.rand(micro_batch, generator=g) < 0.1
        ids[:, t] = torch.where(noise, torch.randint(VOCAB, (micro_batch, ), generator=g), perm[ids[:, t - 1]])
    return ids


# ---------------------------------------------------------------------------------------------------------------
# One rank
# ---------------------------------------------------------------------------------------------------------------


def say(*lines):
    for line in lines:
        print(MARK + line, flush=True)


def worker(jobs, train):
    """One rank: quiet logs, join the process group (gloo on the CPU, the accelerator's backend elsewhere), then
    ``train(job, say_)`` for each of the comma-separated ``jobs``, in step with the other ranks; ``say_`` prints the
    reader's lines on rank 0 and nothing on the others."""
    import logging
    import warnings
    warnings.filterwarnings("ignore")
    import transformers
    import deepspeed
    import deepspeed.comm as dist
    from deepspeed.accelerator import get_accelerator
    from deepspeed.utils import logger
    transformers.logging.set_verbosity_error()
    logger.setLevel(logging.ERROR)

    deepspeed.init_distributed(dist_backend="gloo" if get_accelerator().device_name() == "cpu" else None)
    say_ = say if dist.get_rank() == 0 else (lambda *lines: None)
    for job in jobs.split(","):
        train(job, say_)
        dist.barrier()


def zero3_config(micro_batch, bf16, keep=None):
    """A ZeRO-3 config, bf16 or fp32; ``keep``: data_types.keep_in_fp32_modules where not None (default "auto")."""
    ds_config = {
        "train_micro_batch_size_per_gpu": micro_batch,
        "gradient_accumulation_steps": 1,
        "zero_optimization": {
            "stage": 3
        },
        "bf16": {
            "enabled": bf16
        },
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 10**9,
    }
    if keep is not None:
        ds_config["data_types"] = {"keep_in_fp32_modules": keep}
    return ds_config


def from_pretrained_zero3(model_dir, ds_config):
    """The model, loaded partitioned under zero.Init, in bf16 where ``ds_config`` enables it, else in fp32.

    Returns the ``HfDeepSpeedConfig`` too: transformers holds it by a weak reference, keep it while the model lives.
    """
    import torch
    import transformers
    from transformers.integrations import HfDeepSpeedConfig
    # Alive before from_pretrained: transformers then builds the model under zero.Init and loads it partitioned.
    hf_ds_config = HfDeepSpeedConfig(ds_config)
    dtype = torch.bfloat16 if ds_config["bf16"]["enabled"] else torch.float32
    return transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype), hf_ds_config


def gathered(params):
    """The full values of ZeRO-3 parameters as the model computes with them, flattened into one fp32 CPU tensor."""
    import torch
    import deepspeed
    with deepspeed.zero.GatheredParameters(params):
        return torch.cat([p.data.detach().float().flatten() for p in params]).cpu()


def train_step(engine, ids):
    """One step on the causal LM loss of ``ids``; returns the loss averaged over the ranks."""
    import deepspeed.comm as dist
    ids = ids.to(engine.device)
    loss = engine(input_ids=ids, labels=ids).loss
    engine.backward(loss)
    engine.step()
    mean = loss.detach().float().clone()
    dist.all_reduce(mean)
    return mean.item() / dist.get_world_size()


# ---------------------------------------------------------------------------------------------------------------
# The parent
# ---------------------------------------------------------------------------------------------------------------


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_log(args, rank, prefix=""):
    return Path(args.out) / "logs" / f"{prefix}rank{rank}.log"


def start_rank(cmd, rank, world_size, port, log):
    """Rank ``rank`` of ``cmd``; rank 0's output is piped (to echo it), the others' goes to their ``log``."""
    env = dict(os.environ,
               RANK=str(rank),
               LOCAL_RANK=str(rank),
               WORLD_SIZE=str(world_size),
               LOCAL_SIZE=str(world_size),
               MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(port),
               PYTHONUNBUFFERED="1")
    return subprocess.Popen(cmd,
                            env=env,
                            stdout=subprocess.PIPE if rank == 0 else log,
                            stderr=subprocess.STDOUT,
                            text=True)


def echo(stream, log):
    """Copy ``stream`` to ``log``; print the lines meant for the reader, without their mark."""
    for line in stream:
        log.write(line)
        if line.startswith(MARK):
            print(line[len(MARK):], end="", flush=True)


def wait_all(procs, timeout):
    """Wait until every process has ended; kill them all when one fails or after ``timeout`` seconds."""
    start = time.time()
    while any(p.poll() is None for p in procs):
        failed = next((r for r, p in enumerate(procs) if p.poll() not in (None, 0)), None)
        if failed is not None or time.time() - start > timeout:
            break
        time.sleep(0.2)
    for p in procs:
        if p.poll() is None:
            p.kill()
        p.wait()


def launch(script, jobs, args, log_prefix="", timeout=1200):
    """Run ``script --worker JOBS`` on ``args.world_size`` ranks, one subprocess each, and echo rank 0's lines meant
    for the reader; each rank's output goes to ``rank_log(args, rank, log_prefix)``. Returns the exit codes."""
    (Path(args.out) / "logs").mkdir(parents=True, exist_ok=True)
    cmd = [
        sys.executable,
        str(Path(script).resolve()), "--worker", jobs, "--out", args.out, "--steps",
        str(args.steps), "--lr",
        str(args.lr), "--micro-batch",
        str(args.micro_batch)
    ]
    port = free_port()
    log_files = [open(rank_log(args, rank, log_prefix), "w") for rank in range(args.world_size)]
    procs = [start_rank(cmd, rank, args.world_size, port, log) for rank, log in enumerate(log_files)]
    reader = threading.Thread(target=echo, args=(procs[0].stdout, log_files[0]), daemon=True)
    reader.start()
    wait_all(procs, timeout)
    reader.join(timeout=10)
    for log in log_files:
        log.close()
    return [p.returncode for p in procs]


def fail(heading, args, log_prefix=""):
    """Print ``heading`` and the end of every rank's log to stderr, and exit with 1."""
    print(f"\n{heading}", file=sys.stderr)
    for rank in range(args.world_size):
        path = rank_log(args, rank, log_prefix)
        print(f"--- {path}", file=sys.stderr)
        print("".join(path.read_text().splitlines(keepends=True)[-25:]), file=sys.stderr)
    sys.exit(1)
