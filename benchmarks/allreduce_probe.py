# Copyright (c) DeepSpeed Team.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""The time of one scalar fp64 all-reduce at world size 2 on this machine: what the fp32 sub-group's gradient norm
adds to a step (ZeRO-3 all-reduces one norm per sub-group), measured alone.

Ranks as benchmarks/run.py starts them: one process each, gloo, ``OMP_NUM_THREADS=1``. Each call is timed after a
barrier, through ``deepspeed.comm`` (what stage3's ``get_grad_norm_direct`` calls) and through
``torch.distributed`` directly. Prints the median and p90 per rank.

    .venv/bin/python benchmarks/allreduce_probe.py 3000     # timed calls per path (default 2000); seconds
"""

import os
import statistics
import sys
import time

import torch.multiprocessing as mp


def worker(rank, world_size, port, calls, queue):
    os.environ.update(RANK=str(rank),
                      WORLD_SIZE=str(world_size),
                      LOCAL_RANK=str(rank),
                      MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port),
                      DS_ACCELERATOR="cpu",
                      OMP_NUM_THREADS="1")
    import torch
    import torch.distributed as tdist
    import deepspeed
    import deepspeed.comm as dist
    torch.set_num_threads(1)
    deepspeed.init_distributed(dist_backend="gloo", verbose=False)
    paths = {
        "torch.distributed": lambda t: tdist.all_reduce(t, op=tdist.ReduceOp.SUM),
        "deepspeed.comm": lambda t: dist.all_reduce(t, op=dist.ReduceOp.SUM),
    }
    results = {}
    for name, all_reduce in paths.items():
        tensor = torch.tensor(1.0, dtype=torch.float64)
        for _ in range(200):  # warm-up
            all_reduce(tensor)
        times = []
        for _ in range(calls):
            tdist.barrier()
            start = time.perf_counter()
            all_reduce(tensor)
            times.append(time.perf_counter() - start)
        results[name] = (statistics.median(times) * 1e3, sorted(times)[int(0.9 * calls)] * 1e3)
    queue.put((rank, results, deepspeed.__file__))


def main():
    calls = int(sys.argv[1]) if len(sys.argv) > 1 else 2000
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    processes = [ctx.Process(target=worker, args=(rank, 2, 29611, calls, queue)) for rank in range(2)]
    for p in processes:
        p.start()
    results = sorted((queue.get() for _ in processes), key=lambda r: r[0])
    for p in processes:
        p.join()
    for rank, timings, path in results:
        for name, (median, p90) in timings.items():
            print(f"rank {rank} {name:18s} scalar fp64 all_reduce: median {median:.3f} ms, p90 {p90:.3f} ms "
                  f"({calls} calls; deepspeed from {path})")


if __name__ == "__main__":
    main()
