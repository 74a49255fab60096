# Copyright (c) DeepSpeed Team.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""reduce_scatter_coalesced(..., async_op=True) launches the reduce-scatter and returns the partitions with the
collective's handle: once the handle is waited for, they hold what the blocking call returns, bit for bit."""

import pytest
import torch

import deepspeed.comm as dist
from deepspeed.accelerator import get_accelerator
from deepspeed.runtime.comm.coalesced_collectives import reduce_scatter_coalesced
from unit.common import DistributedTest


def _inputs(numels, dtype, seed=1234):
    # values where the average over ranks is not exact in bf16, so that a partition read before the reduction is
    # done, or a different reduction, shows
    gen = torch.Generator().manual_seed(seed + dist.get_rank())
    return [
        torch.randn(n, generator=gen).mul(8.0).to(dtype).to(get_accelerator().current_device_name()) for n in numels
    ]


class TestReduceScatterCoalescedAsync(DistributedTest):
    world_size = 2

    # one tensor that divides evenly (reduced in place), one that needs padding, several of each
    @pytest.mark.parametrize("numels", [(8, ), (7, ), (6, 3, 5)])
    @pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
    def test_same_partitions_as_blocking(self, numels, dtype):
        blocking = reduce_scatter_coalesced(_inputs(numels, dtype), dist.get_world_group())
        partitions, handle = reduce_scatter_coalesced(_inputs(numels, dtype), dist.get_world_group(), async_op=True)
        assert handle is not None
        handle.wait()
        assert len(partitions) == len(blocking)
        for got, want in zip(partitions, blocking):
            assert got.dtype == want.dtype and torch.equal(got, want)

    def test_two_in_flight(self):
        """Two async reduce-scatters in flight together each finish with their own result."""
        seeds = (1, 2)
        group = dist.get_world_group()
        want = [reduce_scatter_coalesced(_inputs((5, 4), torch.float32, seed), group) for seed in seeds]
        assert not torch.equal(want[0][0], want[1][0])
        launched = [
            reduce_scatter_coalesced(_inputs((5, 4), torch.float32, seed), group, async_op=True) for seed in seeds
        ]
        for partitions, handle in reversed(launched):
            handle.wait()
        for (partitions, _), expected in zip(launched, want):
            assert all(torch.equal(got, e) for got, e in zip(partitions, expected))
