# Copyright (c) DeepSpeed Team.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""The model, training loop and runs of test_checkpoint_conformance.py, and a script that runs them in a process of
its own (under ``torch.distributed.run``, with pristine DeepSpeed 0.19.8 on PYTHONPATH for the stock side).

``RouterSinkNet`` is SinkNet (``_keep_in_fp32_checkpoint_run.py``: sinks and a norm off the bf16 grid, a listed fp32
buffer) with a listed router, a matrix: Muon updates it, and a list that keeps it holds a kept matrix. Its forward
runs the router in the dtype of its weight, so every list (``[]`` too) trains it.

A run is one of:

- ``save_run``: train STEPS steps, save ``OUT/ckpt`` (tag TAG), then K more steps; rank 0 writes ``OUT/reference.pt``:
  the whole state at the save, the next K losses (of each rank) and the whole state after them (the run that never
  stopped);
- ``load_run``: build an engine, load a checkpoint and train K steps, recording (not checking) what happened: the
  exception each rank raised, or the whole state after the load, the K losses (of each rank) and the whole state
  after them, in
  ``OUT/<name>.pt`` (rank 0). The test compares them with what the series did.

As a script: ``python -m torch.distributed.run --nproc_per_node N _checkpoint_conformance_run.py save|load OUT
--config CONFIG.json [--ckpt DIR --name NAME ...]``.
"""

import argparse
import json
import os
import sys
import traceback

import torch

# the tests directory (unit/'s parent) is this file's grandparent: the script imports unit.* from there
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from unit.checkpoint._keep_in_fp32_checkpoint_run import HIDDEN, LISTED, SinkNet, batch
from unit.checkpoint._keep_in_fp32_checkpoint_run import build as _build

STEPS = 2  # the steps before the save
K = 2  # the steps after the save, and after the load
TAG = f"global_step{STEPS}"


class RouterSinkNet(SinkNet):
    """SinkNet with a listed matrix (a router's weight) next to its listed vectors."""
    _keep_in_fp32_modules_strict = LISTED + ["router"]

    def __init__(self):
        super().__init__()
        self.router = torch.nn.Linear(HIDDEN, HIDDEN, bias=False)

    def forward(self, x):
        gate = torch.softmax(self.router(x.to(self.router.weight.dtype)).float(), dim=-1).to(x.dtype)
        return super().forward(x * gate)


def kept_names(keep):
    """The parameters and buffers of RouterSinkNet that ``keep`` (data_types.keep_in_fp32_modules, "auto": the
    model's list) keeps in fp32."""
    listed = RouterSinkNet._keep_in_fp32_modules_strict if keep == "auto" else keep
    model = RouterSinkNet()
    names = [name for name, _ in model.named_parameters()] + [name for name, _ in model.named_buffers()]
    return {name for name in names if any(entry in name for entry in listed)}


def build(ds_config):
    """RouterSinkNet (under zero.Init for ZeRO-3), with the sinks and the norm's weight set off the bf16 grid."""
    return _build(ds_config, model_cls=RouterSinkNet)


def engine(ds_config):
    import deepspeed
    model = build(ds_config)
    result, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds_config)
    return result


def train(model_engine, steps, first_step=0):
    losses = []
    for step in range(first_step, first_step + steps):
        loss = model_engine(batch(step).to(model_engine.device))
        model_engine.backward(loss)
        model_engine.step()
        losses.append(loss.item())
    return losses


def save(model_engine, ckpt):
    """save_checkpoint into ``ckpt`` (tag TAG), as a checkpoint ds_to_universal converts (ZeRO-1/2 ones say so)."""
    from deepspeed.checkpoint.constants import UNIVERSAL_CHECKPOINT_INFO
    stage = model_engine.zero_optimization_stage()
    client_state = {UNIVERSAL_CHECKPOINT_INFO: {}} if 0 < stage < 3 else {}
    model_engine.save_checkpoint(ckpt, tag=TAG, client_state=client_state)


def _of_every_rank(value):
    """``value`` of each rank, by rank (a collective)."""
    import deepspeed.comm as dist
    result = [None] * dist.get_world_size()
    dist.all_gather_object(result, value)
    return result


def _deepspeed_record():
    import deepspeed
    import deepspeed.comm as dist
    return {
        "deepspeed_file": deepspeed.__file__,
        "deepspeed_version": deepspeed.__version__,
        "world_size": dist.get_world_size()
    }


def save_run(ds_config, out):
    """Train STEPS steps, save ``out/ckpt``, train K more; rank 0 writes ``out/reference.pt`` (see the module's
    docstring)."""
    import deepspeed.comm as dist
    from unit.checkpoint._keep_in_fp32_whole_state import whole_state
    model_engine = engine(ds_config)
    losses = train(model_engine, STEPS)
    save(model_engine, os.path.join(out, "ckpt"))
    saved = whole_state(model_engine)
    next_losses = train(model_engine, K, first_step=STEPS)
    reference = dict(_deepspeed_record(),
                     losses=_of_every_rank(losses),
                     whole_state=saved,
                     next_losses=_of_every_rank(next_losses),
                     next_whole_state=whole_state(model_engine),
                     buffers={
                         name: buf.detach().cpu().clone()
                         for name, buf in model_engine.module.named_buffers()
                     },
                     optimizer=type(model_engine.optimizer).__name__)
    dist.barrier()
    if dist.get_rank() == 0:
        torch.save(reference, os.path.join(out, "reference.pt"))
    dist.barrier()


def load_run(ds_config, ckpt, out, name):
    """Build an engine of ``ds_config``, load ``ckpt`` and train K steps; record what happened in ``out/name.pt``
    (rank 0; each rank's exception in ``out/name.rank<r>.pt``): see the module's docstring. Returns whether the load
    raised."""
    import deepspeed.comm as dist
    from unit.checkpoint._keep_in_fp32_whole_state import whole_state
    model_engine = engine(ds_config)
    try:
        model_engine.load_checkpoint(ckpt, tag=TAG)
        error = None
    except Exception as e:  # what stock 0.19.8 raises: recorded, for the test to check
        error = {"type": type(e).__name__, "message": str(e), "traceback": traceback.format_exc()}
    torch.save({"error": error}, os.path.join(out, f"{name}.rank{dist.get_rank()}.pt"))
    if error is not None:
        return True
    record = dict(_deepspeed_record(), error=None, whole_state=whole_state(model_engine))
    record["next_losses"] = _of_every_rank(train(model_engine, K, first_step=STEPS))
    record["next_whole_state"] = whole_state(model_engine)
    dist.barrier()
    if dist.get_rank() == 0:
        torch.save(record, os.path.join(out, f"{name}.pt"))
    dist.barrier()
    return False


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=["save", "load"])
    parser.add_argument("out")
    parser.add_argument("--config", required=True, help="a JSON file: the DeepSpeed config")
    parser.add_argument("--ckpt", help="load: the checkpoint directory")
    parser.add_argument("--name", default="load", help="load: the name of the record")
    args = parser.parse_args()

    import deepspeed
    import deepspeed.comm as dist
    deepspeed.init_distributed(dist_backend="gloo")
    if dist.get_rank() == 0:
        print(f"deepspeed {deepspeed.__version__} from {deepspeed.__file__}", flush=True)
    with open(args.config) as f:
        ds_config = json.load(f)
    if args.mode == "save":
        save_run(ds_config, args.out)
    elif load_run(ds_config, args.ckpt, args.out, args.name):
        # a rank that raised leaves the others where they are (a collective of the load, which fails once this
        # process is gone, or its end): no barrier, no teardown
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
