# Copyright (c) DeepSpeed Team.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""The time of the small collectives keeping parameters in fp32 could add to a step, each measured alone at world
size 2 on this machine:

* a scalar fp64 all-reduce: a gradient norm all-reduced by itself (ZeRO-3 once took one per fp32 sub-group; it now
  sums the kept sub-groups' squares in their param group's all-reduce);
* an all-gather of ``numel`` fp32 elements per rank: ZeRO-1/2 and the BF16 optimizer all-gather the updated kept
  partitions after the step, one collective beside the training dtype's (default: the kept partition of a rank of
  benchmarks/run.py's compute-bound model, hidden 1024 with 1 % listed: 23,882 elements).

Ranks as benchmarks/run.py starts them: one process each, gloo, ``OMP_NUM_THREADS=1``. Each call goes through
``deepspeed.comm`` (what the optimizers call) after a barrier. Prints the median and p90 per rank.

    .venv/bin/python benchmarks/collective_probe.py 3000           # timed calls per collective (default 2000)
    .venv/bin/python benchmarks/collective_probe.py 3000 100000    # and the all-gather's elements per rank
"""

import os
import statistics
import sys
import time

import torch.multiprocessing as mp

KEPT_PARTITION_NUMEL = 23882


def worker(rank, world_size, port, calls, numel, queue):
    os.environ.update(RANK=str(rank),
                      WORLD_SIZE=str(world_size),
                      LOCAL_RANK=str(rank),
                      MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port),
                      DS_ACCELERATOR="cpu",
                      OMP_NUM_THREADS="1")
    import torch
    import deepspeed
    import deepspeed.comm as dist
    torch.set_num_threads(1)
    deepspeed.init_distributed(dist_backend="gloo", verbose=False)
    norm = torch.tensor(1.0, dtype=torch.float64)
    gathered = torch.zeros(numel * world_size, dtype=torch.float32)
    partition = gathered.narrow(0, numel * rank, numel)
    collectives = {
        "scalar fp64 all_reduce":
        lambda: dist.all_reduce(norm, op=dist.ReduceOp.SUM),
        f"fp32 all_gather_into_tensor, {numel} elements per rank":
        lambda: dist.all_gather_into_tensor(gathered, partition),
    }
    results = {}
    for name, collective in collectives.items():
        for _ in range(200):  # warm-up
            collective()
        times = []
        for _ in range(calls):
            dist.barrier()
            start = time.perf_counter()
            collective()
            times.append(time.perf_counter() - start)
        results[name] = (statistics.median(times) * 1e3, sorted(times)[int(0.9 * calls)] * 1e3)
    queue.put((rank, results, deepspeed.__file__))


def main():
    calls = int(sys.argv[1]) if len(sys.argv) > 1 else 2000
    numel = int(sys.argv[2]) if len(sys.argv) > 2 else KEPT_PARTITION_NUMEL
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    processes = [ctx.Process(target=worker, args=(rank, 2, 29611, calls, numel, queue)) for rank in range(2)]
    for p in processes:
        p.start()
    results = sorted((queue.get() for _ in processes), key=lambda r: r[0])
    for p in processes:
        p.join()
    for rank, timings, path in results:
        for name, (median, p90) in timings.items():
            print(f"rank {rank} {name}: median {median:.3f} ms, p90 {p90:.3f} ms ({calls} calls; deepspeed from "
                  f"{path})")


if __name__ == "__main__":
    main()
