# Copyright (c) DeepSpeed Team.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""Parameters kept in fp32 (``data_types.keep_in_fp32_modules``) under ZeRO++.

hpZ (``zero_hpz_partition_size``): each rank also holds a secondary partition of every parameter over its hpZ group,
which backward fetches from. A module whose parameters hold both dtypes (SinkNet's ``attn``: bf16 weights next to
fp32 sinks) is fetched from its secondary partitions in one all-gather of their bytes, as from its primary ones, so
that keeping adds no collective to a step.
"""

import pytest
import torch

from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state
from unit.checkpoint._keep_in_fp32_whole_state import (Continuation, check_masters_own_their_states,
                                                       check_whole_state, whole_state)
from unit.common import DistributedTest
from unit.v1.half_precision.test_keep_in_fp32_modules import (_batch, _check_kept_and_updated, _collective_dtypes,
                                                              _config, _engine, _gathered, _listed_names, _train)

HPZ = 2
BF16 = torch.bfloat16


def _hpz_config(keep="auto"):
    # every parameter is fetched, one module at a time, and released after each use
    return _config(keep=keep,
                   zero_hpz_partition_size=HPZ,
                   stage3_prefetch_bucket_size=0,
                   stage3_max_reuse_distance=0)


def _snapshot(engine):
    """Each parameter's full value, fp32 master and first moment."""
    return {
        name: (_gathered(param), safe_get_full_fp32_param(param), safe_get_full_optimizer_state(param, "exp_avg"))
        for name, param in engine.module.named_parameters()
    }


class TestHierarchicalFetch(DistributedTest):
    """World size 4, hpZ groups of 2 ranks."""
    world_size = 4

    def test_fetch_from_secondary_partitions_is_one_exact_all_gather(self):
        config = _hpz_config()
        engine = _engine(config)
        _train(engine, config, steps=1)
        loss = engine(_batch(1, config))  # releases every module's parameters to their secondary partitions
        attn = engine.module.attn
        params = list(attn.parameters())
        names = [f"attn.{name}" for name, _ in attn.named_parameters()]
        kept = _listed_names(engine.module)
        assert {p.ds_secondary_tensor.dtype for p in params} == {BF16, torch.float32}

        with _collective_dtypes("allgather_fn") as calls:
            params[0].all_gather_coalesced(params).wait()  # how backward fetches a module's parameters
        fetched = [p.data.detach().clone() for p in params]
        params[0].partition(params)
        assert calls == [torch.uint8], calls

        for name, param, value in zip(names, params, fetched):
            master = safe_get_full_fp32_param(param)  # the fp32 partitions, all-gathered over all ranks
            want = master if name in kept else master.to(BF16)
            assert value.dtype == want.dtype and torch.equal(value, want), name
        engine.backward(loss)
        engine.step()

    @pytest.mark.parametrize("keep", ["auto", []])
    def test_one_all_gather_per_module_in_a_backward(self, keep):
        config = _hpz_config(keep)
        engine = _engine(config)
        _train(engine, config, steps=1)
        loss = engine(_batch(1, config))
        with _collective_dtypes("allgather_fn") as calls:
            engine.backward(loss)
        engine.step()
        # out (bf16), norm (fp32), attn (both: one all-gather of bytes), lin (bf16): one all-gather per module,
        # as with nothing kept
        kept = keep == "auto"
        want = [BF16, torch.float32 if kept else BF16, torch.uint8 if kept else BF16, BF16]
        assert calls == want, calls

    def test_checkpoint_round_trip_is_exact(self, tmp_path):
        """Save, train on, load the checkpoint into the same engine (a second hpZ engine cannot be made in one
        process), train on again: the load restores every value exactly, and the steps after it, which gather from
        the secondary partitions, repeat the ones after the save bit for bit."""
        config = _hpz_config()
        engine = _engine(config)
        _train(engine, config, steps=1)
        save_dir = str(tmp_path)
        engine.save_checkpoint(save_dir)
        saved = _snapshot(engine)
        saved_state = whole_state(engine)

        losses = _train(engine, config, steps=2)
        after = _snapshot(engine)
        after_state = whole_state(engine)
        engine.load_checkpoint(save_dir)
        # the counters are the engine's, which its load sets back
        check_whole_state(whole_state(engine), saved_state)
        check_masters_own_their_states(engine)
        loaded = _snapshot(engine)
        for name in saved:
            for what, a, b in zip(("param", "master", "exp_avg"), saved[name], loaded[name]):
                assert a.dtype == b.dtype and torch.equal(a, b), f"{name}: {what} differs after the load"
        continuation = Continuation(engine)
        assert _train(engine, config, steps=2) == losses
        continuation.check(steps=2)
        check_whole_state(whole_state(engine), after_state, "two more steps")
        again = _snapshot(engine)
        for name in after:
            assert all(torch.equal(a, b) for a, b in zip(after[name], again[name])), name
        _check_kept_and_updated(engine)
