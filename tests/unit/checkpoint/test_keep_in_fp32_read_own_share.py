# Copyright (c) DeepSpeed Team.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""Which checkpoint files a rank reads when ZeRO-1/2 (or the BF16 optimizer) loads a checkpoint saved keeping other
parameters in fp32 (``data_types.keep_in_fp32_modules``), whose flat groups then hold other parameters than the run's.

A rank reads its own file and the files of the saving ranks whose partitions hold pieces of its own new fp32
partitions; the parameters kept in fp32 take their values from their masters through an all-gather, not from other
ranks' files. Planned without processes, as ``load_other_flat_groups`` plans it (``plan_flat_pieces``), at
data-parallel size 1,024 for a Llama-like model of 32 layers with two kept norms in each.

The bound, from the partition geometry: each piece of a parameter that a rank's new partitions hold (``numel``
elements) lies in one saved flat group ``h``, partitioned ``P_h`` elements a rank, so at most ``ceil(numel / P_h) + 1``
saving ranks hold it, and a rank opens at most ``1 + sum over its pieces of (ceil(numel / P_h) + 1)`` files. Measured
at 1,024 ranks: keeping the norms -> ``[]``, 921 ranks open 2 files (their own and a neighbour's), 37 open 3, 2
open 8, and the 64 whose new partition holds a whole norm 16 to 19: a kept group of 65 norms of 4,096 elements over 1,024 ranks is 260 elements a
rank, so a norm comes from 16 or 17 of them; ``[]`` -> keeping them, every rank opens 2 to 4. A job opens about
3 x dp files (3,089 both ways), each saved file read by its own rank and two others at most on average: O(dp), not
O(dp x layers) as when each rank read every kept parameter whole from every file that holds a piece of it.
"""

import math

import pytest
import torch

from deepspeed.checkpoint.flat_group_remap import FlatDestination, plan_flat_pieces, saved_flat_layout
from unit.common import DistributedTest

DP = 1024
LAYERS = 32
HIDDEN = 4096
FFN = 11008
VOCAB = 32000
NCCL_START_ALIGNMENT_FACTOR = 2  # ZeRO-1/2 aligns each flat group to 2 x dp elements


def _model():
    """(name, numel, whether "auto" keeps it in fp32: the norms) in the model's order."""
    params = [("embed_tokens.weight", VOCAB * HIDDEN, False)]
    for layer in range(LAYERS):
        prefix = f"layers.{layer}."
        params.append((prefix + "input_layernorm.weight", HIDDEN, True))
        params += [(prefix + f"self_attn.{proj}.weight", HIDDEN * HIDDEN, False) for proj in "qkvo"]
        params.append((prefix + "post_attention_layernorm.weight", HIDDEN, True))
        params += [(prefix + f"mlp.{proj}.weight", HIDDEN * FFN, False) for proj in ("gate", "up", "down")]
    return params + [("norm.weight", HIDDEN, True), ("lm_head.weight", VOCAB * HIDDEN, False)]


def _flat_groups(keeps):
    """ZeRO-1/2's flat groups of one param group: with parameters kept in fp32, the others, then the kept ones in a
    group of their own; each a list of (name, numel)."""
    params = _model()
    if not keeps:
        return [[(name, numel) for name, numel, _ in params]]
    return [[(name, numel) for name, numel, kept in params if not kept],
            [(name, numel) for name, numel, kept in params if kept]]


def _partition_numel(group):
    """The numel of each rank's partition of a flat group: padded to a multiple of 2 x dp, then split evenly."""
    alignment = NCCL_START_ALIGNMENT_FACTOR * DP
    return math.ceil(sum(numel for _, numel in group) / alignment) * alignment // DP


def _destinations(groups, rank):
    """This rank's fp32 partitions of ``groups``: the pieces of parameters each holds, as its hp mappings give them
    (name, start in the parameter, start in the partition, numel)."""
    destinations = []
    for group in groups:
        size = _partition_numel(group)
        lo, hi = rank * size, (rank + 1) * size
        fragments, offset = [], 0
        for name, numel in group:
            start, end = max(offset, lo), min(offset + numel, hi)
            if start < end:
                fragments.append((name, start - offset, start - lo, end - start))
            offset += numel
        destinations.append(FlatDestination(None, fragments, True, True))
    return destinations


def _bound(saved_groups, destinations):
    """1 + sum over the pieces of parameters the destinations hold of ceil(numel / P_h) + 1 (the module's
    docstring)."""
    partition_of = {name: _partition_numel(group) for group in saved_groups for name, _ in group}
    return 1 + sum(
        math.ceil(numel / partition_of[name]) + 1 for destination in destinations
        for name, _, _, numel in destination.fragments)


@pytest.mark.parametrize("saved_keeps, keeps, most", [(True, False, 19), (False, True, 4)],
                         ids=["list_to_none", "none_to_list"])
def test_each_rank_reads_its_own_share(saved_keeps, keeps, most):
    saved_groups, groups = _flat_groups(saved_keeps), _flat_groups(keeps)
    layout = saved_flat_layout([{name: (numel, ) for name, numel in group} for group in saved_groups])
    partition_numels = [_partition_numel(group) for group in saved_groups]
    numels = {name: numel for group in groups for name, numel in group}
    opened = []
    for rank in range(DP):
        destinations = _destinations(groups, rank)
        files = {rank} | {piece.rank for piece in plan_flat_pieces(layout, partition_numels, destinations, numels)}
        bound = _bound(saved_groups, destinations)
        assert len(files) <= bound, f"rank {rank} opens {len(files)} files, the geometry bounds them by {bound}"
        opened.append(len(files))
    assert max(opened) == most, f"a rank opens up to {max(opened)} of {DP} files"
    assert sum(opened) < 4 * DP, f"{sum(opened)} files opened by {DP} ranks"


class Layer(torch.nn.Module):

    def __init__(self, index):
        super().__init__()
        self.weight = torch.nn.Parameter(0.3 * torch.randn(16, 16))
        self.norm = torch.nn.Parameter(1.0 + 1e-4 * torch.arange(16, dtype=torch.float32) + 1e-3 * index)

    def forward(self, x):
        return torch.tanh(x @ self.weight.t()) * self.norm.to(x.dtype)


class LayeredNet(torch.nn.Module):
    """Eight layers of a 16 x 16 weight and a norm (kept in fp32 by its name), off the bf16 grid."""

    def __init__(self):
        super().__init__()
        self.layers = torch.nn.Sequential(*(Layer(index) for index in range(8)))

    def forward(self, x):
        return self.layers(x).float().pow(2).mean()


class TestLoadReadsOwnShare(DistributedTest):
    """A real load at data-parallel size 4 into other flat groups: each rank opens its own file and those of the
    saving ranks that hold pieces of its new partitions, not every file (each norm, kept or not, lies in two
    layers' share of one rank), and the parameters kept in fp32 equal their loaded masters."""
    world_size = 4

    # (0.19.8 + the series before this fix: every rank read all four files to fill each kept norm whole)
    @pytest.mark.parametrize("saved_keep, keep",
                             [([], ["norm"]), pytest.param(["norm"], [], marks=pytest.mark.nightly)],
                             ids=["none_to_list", "list_to_none"])
    @pytest.mark.parametrize("stage", ["zero2", pytest.param("zero1_bf16_optimizer", marks=pytest.mark.nightly)])
    def test_files_opened(self, stage, saved_keep, keep, tmp_path):
        import deepspeed
        import deepspeed.comm as dist
        from deepspeed.utils import safe_get_full_fp32_param

        def engine(kept):
            config = {
                "train_micro_batch_size_per_gpu": 2,
                "optimizer": {
                    "type": "AdamW",
                    "params": {
                        "lr": 1e-3,
                        "torch_adam": True
                    }
                },
                "zero_optimization": {
                    "stage": 1 if stage == "zero1_bf16_optimizer" else 2
                },
                "bf16": {
                    "enabled": True
                },
                "data_types": {
                    "keep_in_fp32_modules": kept
                },
            }
            if stage == "zero1_bf16_optimizer":
                config["data_types"]["grad_accum_dtype"] = "fp32"
            torch.manual_seed(0)
            model = LayeredNet()
            result, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
            return result

        saving = engine(saved_keep)
        for step in range(2):
            gen = torch.Generator().manual_seed(10 * step + dist.get_rank())
            saving.backward(saving(torch.randn(2, 16, generator=gen).bfloat16()))
            saving.step()
        saving.save_checkpoint(str(tmp_path))

        loaded = engine(keep)
        opened = set()
        for owner, name in ((loaded.checkpoint_engine, "load"), (loaded, "_load_zero_checkpoint_file")):
            read = getattr(owner, name)

            def recording(path, *args, read=read, **kwargs):
                opened.add(path)
                return read(path, *args, **kwargs)

            setattr(owner, name, recording)
        assert loaded.load_checkpoint(str(tmp_path))[0] is not None
        rank = dist.get_rank()
        files = sorted(int(path.split("_rank_")[1].split("_")[0]) for path in opened if "optim_states" in path)
        counts = [None] * self.world_size
        dist.all_gather_object(counts, files)
        assert rank in files, f"rank {rank} read {files}"
        assert all(len(seen) < self.world_size for seen in counts), f"the ranks read the files {counts}"
        assert sum(len(seen) for seen in counts) <= 3 * self.world_size, f"the ranks read the files {counts}"
        for name, param in loaded.module.named_parameters():
            if param.dtype == torch.float32:
                assert torch.equal(param.detach().cpu(), safe_get_full_fp32_param(param).cpu()), name
