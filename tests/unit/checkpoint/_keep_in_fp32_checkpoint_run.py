# Copyright (c) DeepSpeed Team.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""The model, config and training loop of test_keep_in_fp32_checkpoints.py, and a script that saves a checkpoint.

As a module, it gives the tests ``SinkNet`` and its helpers. As a script, run on every rank by
``python -m torch.distributed.run --nproc_per_node N _keep_in_fp32_checkpoint_run.py OUT [options]``, it trains
``SinkNet`` for two bf16 steps under ZeRO-3 (``--stage``: or another stage; ``--bf16-optimizer``: BF16_Optimizer at
stage 1; ``--dtype fp16``) with whatever ``import deepspeed`` finds (the tests run it with pristine DeepSpeed 0.19.8
on PYTHONPATH, or with the DeepSpeed under test), saves a checkpoint in ``OUT/ckpt`` and, on rank 0,
``OUT/reference.pt``: per parameter its fp32 master, exp_avg and exp_avg_sq, its gathered value and dtype, the whole
state (_keep_in_fp32_whole_state.py) and the DeepSpeed it ran with. With ``--universal``, rank 0 converts the
checkpoint with ds_to_universal as well.

The values are chosen so that bf16 shows: the sinks start at 8.0 + k * 1e-4, which bf16 rounds to 8.0 (its values are
0.0625 apart there), and Adam moves them by about lr = 1e-5 a step.
"""

import argparse
import json
import os
import sys

import torch

HIDDEN = 9  # odd, so that every partition is padded at world sizes 2 and 3
SINK_VALUES = 8.0 + 1e-4 * torch.arange(6, dtype=torch.float32)
NORM_VALUES = 1.0 + 1e-4 * torch.arange(HIDDEN, dtype=torch.float32)  # off the bf16 grid too
LISTED = ["sink", "norm", "bias_buf"]
STEPS = 2
TAG = f"global_step{STEPS}"


class Attention(torch.nn.Module):

    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Parameter(torch.randn(HIDDEN, HIDDEN) * 0.3)
        self.bias = torch.nn.Parameter(torch.zeros(HIDDEN))
        self.sinks = torch.nn.Parameter(torch.full((6, ), 8.0))
        self.sink_gate = torch.nn.Parameter(torch.linspace(0.5, 1.5, HIDDEN))

    def forward(self, h):
        sink = self.sink_gate * self.sinks.mean()
        return h @ self.proj.t() + self.bias + 0.01 * sink.to(h.dtype)


class Norm(torch.nn.LayerNorm):
    """Computes in the dtype of its weight (fp32 when kept), as transformers' norms do."""

    def forward(self, h):
        return super().forward(h.to(self.weight.dtype))


class SinkNet(torch.nn.Module):
    """Lists its attention sinks, its norm and a buffer for fp32, as a Hugging Face model does."""
    _keep_in_fp32_modules_strict = LISTED

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(HIDDEN, HIDDEN)
        self.attn = Attention()
        self.norm = Norm(HIDDEN)
        self.out = torch.nn.Linear(HIDDEN, 3)
        self.register_buffer("bias_buf", torch.full((HIDDEN, ), 8.0) + 1e-3 * torch.arange(HIDDEN))

    def forward(self, x):
        h = self.attn(self.lin(x))
        h = self.norm(h.float() + 1e-3 * self.bias_buf).to(h.dtype)
        return self.out(h).float().pow(2).mean()


def config(keep="auto",
           load_universal=False,
           stage=3,
           bf16_optimizer=False,
           dtype="bf16",
           torch_adam=False,
           round_robin=False):
    """ZeRO-3 (or ``stage``) bf16 (or ``dtype``) with Adam; ``keep`` is data_types.keep_in_fp32_modules ("auto": no
    data_types section). Stage 0 takes the default Adam, FusedAdam, which the engine wraps in FP16_Optimizer (for
    fp16 and bf16), or with ``torch_adam`` torch's Adam, which it wraps in FP16_UnfusedOptimizer; ``bf16_optimizer``
    accumulates gradients in fp32 at stage 1, for which it takes BF16_Optimizer; ``round_robin``: ZeRO-1/2's
    round_robin_gradients."""
    result = {
        "train_micro_batch_size_per_gpu": 2,
        "steps_per_print": 1000,
        "optimizer": {
            "type": "Adam",
            "params": {
                "lr": 1e-5,
                "torch_adam": True
            }
        },
        "zero_optimization": {
            "stage": stage,
            "stage3_param_persistence_threshold": 0
        },
        dtype: {
            "enabled": True
        },
    }
    if dtype == "fp16":
        result[dtype]["initial_scale_power"] = 8
    if stage == 0 and not torch_adam:
        del result["optimizer"]["params"]["torch_adam"]
    if keep != "auto":
        result["data_types"] = {"keep_in_fp32_modules": keep}
    if bf16_optimizer:
        result.setdefault("data_types", {})["grad_accum_dtype"] = "fp32"
    if load_universal:
        result["checkpoint"] = {"load_universal": True}
    if round_robin:
        result["zero_optimization"]["round_robin_gradients"] = True
    return result


def gathered(param):
    """The full value of a ZeRO-3 parameter, in its dtype (a collective)."""
    import deepspeed
    with deepspeed.zero.GatheredParameters([param]):
        return param.data.detach().cpu().clone()


def build(ds_config, frozen=(), model_cls=SinkNet):
    """``model_cls`` (SinkNet, under zero.Init for ZeRO-3), with the sinks (and the norm's weight) set off the bf16
    grid, and the parameters named in ``frozen`` frozen."""
    import deepspeed
    import deepspeed.comm as dist
    torch.manual_seed(42)
    zero3 = ds_config["zero_optimization"]["stage"] == 3
    with deepspeed.zero.Init(config_dict_or_path=ds_config, enabled=zero3):
        model = model_cls()
    for param, values in ((model.attn.sinks, SINK_VALUES), (model.norm.weight, NORM_VALUES)):
        with deepspeed.zero.GatheredParameters([param], modifier_rank=0):
            if dist.get_rank() == 0 or not zero3:
                param.data.copy_(values)
    for name, param in model.named_parameters():
        if name in frozen:
            param.requires_grad_(False)
    return model


def engine(ds_config, frozen=()):
    import deepspeed
    model = build(ds_config, frozen)
    params = [p for p in model.parameters() if p.requires_grad]
    result, _, _, _ = deepspeed.initialize(model=model, model_parameters=params, config=ds_config)
    return result


def batch(step):
    import deepspeed.comm as dist
    gen = torch.Generator().manual_seed(1000 * step + dist.get_rank())
    return torch.randn(2, HIDDEN, generator=gen).bfloat16()


def train(model_engine, steps=STEPS, first_step=0):
    losses = []
    for step in range(first_step, first_step + steps):
        loss = model_engine(batch(step).to(model_engine.device, model_engine.module.lin.weight.dtype))
        model_engine.backward(loss)
        model_engine.step()
        losses.append(loss.item())
    return losses


def _flat_masters(optimizer):
    """FP16_Optimizer's (stage 0) fp32 master, exp_avg and exp_avg_sq of each parameter, from its flat masters (of
    FP16_UnfusedOptimizer, from its master of each parameter)."""
    from torch._utils import _unflatten_dense_tensors
    result = {}
    if not hasattr(optimizer, "fp32_groups_flat"):  # FP16_UnfusedOptimizer
        for params, masters in zip(optimizer.fp16_groups, optimizer.fp32_groups):
            for param, master in zip(params, masters):
                state = optimizer.optimizer.state[master]
                result[param] = {"master": master.detach().cpu().clone()}
                for key in ("exp_avg", "exp_avg_sq"):
                    result[param][key] = state[key].detach().cpu().clone()
        return result
    for params, flat in zip(optimizer.fp16_groups, optimizer.fp32_groups_flat):
        state = optimizer.optimizer.state[flat]
        for key, tensor in (("master", flat), ("exp_avg", state["exp_avg"]), ("exp_avg_sq", state["exp_avg_sq"])):
            for param, piece in zip(params, _unflatten_dense_tensors(tensor.detach(), params)):
                result.setdefault(param, {})[key] = piece.cpu().clone()
    return result


def snapshot(model_engine):
    """Per parameter: its gathered value, and for trainable ones its fp32 master, exp_avg and exp_avg_sq (collective
    calls: every rank must make them)."""
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state
    flat_masters = None if model_engine.zero_optimization() else _flat_masters(model_engine.optimizer)
    result = {}
    for name, param in model_engine.module.named_parameters():
        entry = {"value": gathered(param), "requires_grad": param.requires_grad}
        if param.requires_grad and flat_masters is not None:
            entry.update(flat_masters[param])
        elif param.requires_grad:
            entry["master"] = safe_get_full_fp32_param(param).detach().cpu().clone()
            for key in ("exp_avg", "exp_avg_sq"):
                entry[key] = safe_get_full_optimizer_state(param, key).detach().cpu().clone()
        result[name] = entry
    return result


def pristine_tree():
    """The unpacked pristine DeepSpeed 0.19.8 tree that tools/test names in DS_PRISTINE_TREE (the test skips
    without it)."""
    import pytest
    tree = os.environ.get("DS_PRISTINE_TREE")
    if not tree:
        pytest.skip("DS_PRISTINE_TREE does not name an unpacked pristine DeepSpeed 0.19.8 tree")
    return os.path.abspath(tree)


def to_universal(ckpt_dir, tag=TAG):
    """Convert ``ckpt_dir/tag`` with ds_to_universal's command line, into ``ckpt_dir/tag_universal`` (and write
    ``ckpt_dir/latest_universal``); in this process, with one worker each."""
    from deepspeed.checkpoint import ds_to_universal
    argv = sys.argv
    sys.argv = [
        "ds_to_universal", "--input_folder",
        os.path.join(ckpt_dir, tag), "--output_folder",
        os.path.join(ckpt_dir, f"{tag}_universal"), "--num_extract_workers", "1", "--num_merge_workers", "1"
    ]
    try:
        ds_to_universal.main(ds_to_universal.parse_arguments())
    finally:
        sys.argv = argv


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--keep", default='"auto"', help="data_types.keep_in_fp32_modules, as JSON")
    parser.add_argument("--frozen", default="", help="names of parameters to freeze, comma-separated")
    parser.add_argument("--universal", action="store_true", help="also convert with ds_to_universal")
    parser.add_argument("--stage", type=int, default=3, help="zero_optimization.stage")
    parser.add_argument("--bf16-optimizer", action="store_true", help="at stage 1: BF16_Optimizer")
    parser.add_argument("--dtype", default="bf16", choices=["bf16", "fp16"])
    parser.add_argument("--torch-adam", action="store_true", help="at stage 0: torch's Adam, FP16_UnfusedOptimizer")
    parser.add_argument("--round-robin", action="store_true", help="at stages 1 and 2: round_robin_gradients")
    args = parser.parse_args()

    import deepspeed
    import deepspeed.comm as dist
    from deepspeed.checkpoint.constants import UNIVERSAL_CHECKPOINT_INFO
    deepspeed.init_distributed(dist_backend="gloo")
    rank = dist.get_rank()
    if rank == 0:
        print(f"deepspeed {deepspeed.__version__} from {deepspeed.__file__}", flush=True)

    ds_config = config(keep=json.loads(args.keep),
                       stage=args.stage,
                       bf16_optimizer=args.bf16_optimizer,
                       dtype=args.dtype,
                       torch_adam=args.torch_adam,
                       round_robin=args.round_robin)
    model_engine = engine(ds_config, frozen=[n for n in args.frozen.split(",") if n])
    losses = train(model_engine)
    ckpt = os.path.join(args.out, "ckpt")
    # ds_to_universal reads ZeRO-1/2 checkpoints that say they can be converted
    client_state = {UNIVERSAL_CHECKPOINT_INFO: {}} if 0 < args.stage < 3 else {}
    model_engine.save_checkpoint(ckpt, tag=TAG, client_state=client_state)
    # the whole state, per parameter name (the tests directory, unit/'s parent, is this script's grandparent)
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    from unit.checkpoint._keep_in_fp32_whole_state import whole_state
    reference = {
        "whole_state": whole_state(model_engine),
        "params": snapshot(model_engine),
        "buffers": {
            name: buf.detach().cpu().clone()
            for name, buf in model_engine.module.named_buffers()
        },
        "deepspeed_file": deepspeed.__file__,
        "deepspeed_version": deepspeed.__version__,
        "world_size": dist.get_world_size(),
        "global_steps": model_engine.global_steps,
        "losses": losses,
    }
    dist.barrier()
    if rank == 0:
        if args.universal:
            to_universal(ckpt)
        torch.save(reference, os.path.join(args.out, "reference.pt"))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
