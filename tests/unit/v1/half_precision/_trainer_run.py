# Copyright (c) DeepSpeed Team.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""One transformers ``Trainer`` run under DeepSpeed ZeRO-3 (``--stage 2``: ZeRO-2) bf16 on the CPU: the entry point
of test_keep_in_fp32_trainer.py, launched on 2 ranks with ``python -m torch.distributed.run``.

It builds nothing: the tiny model was written by ``save_pretrained`` in the test process (a plain ``Model(config)``,
outside ``zero.Init``). As Hugging Face documents, ``TrainingArguments(deepspeed=<dict with "auto" values>)`` comes
first and ``from_pretrained`` after it, so that the model is created under ``zero.Init``. DeepSeek-V4's final norm,
which transformers 5.24.0 drops under ZeRO-3, is loaded by hand with ``reload_from_checkpoint``
(examples/zero3_workaround.py), the workaround the docs give.

The run trains ``--max-steps`` steps on a tiny fixed token dataset, saves Trainer checkpoints every ``--save-steps``
steps, optionally resumes from ``--resume``, and with ``--save-model DIR`` ends with ``trainer.save_model(DIR)``.
Whichever DeepSpeed ``import deepspeed`` finds runs it (the test puts pristine 0.19.8 first on PYTHONPATH for the
upgrade runs). It writes, into ``--results``:

* ``rank<r>.json`` per rank: which DeepSpeed ran, the loss of every step this run trained (``[global step, loss]``),
  the dtypes of the parameters and of their partitions, the names the model's strict list selects (``kept``);
* ``begin.pt`` (rank 0): at ``on_train_begin``, after a resumed checkpoint is loaded, the full value and the fp32
  master (``safe_get_full_fp32_param``) of every parameter;
* ``masters_step<N>.pt`` (rank 0): the same right after the Trainer checkpoint of step N is saved;
* ``final.pt`` (rank 0): the same after ``save_model``.
"""

import argparse
import json
import os
import re
import sys

import torch

DEEPSPEED_CONFIG = {
    # The config Hugging Face's DeepSpeed docs show for ZeRO-3: "auto" values that the Trainer fills in.
    "bf16": {
        "enabled": "auto"
    },
    "optimizer": {
        "type": "AdamW",
        "params": {
            "lr": "auto",
            "betas": "auto",
            "eps": "auto",
            "weight_decay": "auto",
            "torch_adam": True,  # DeepSpeed's FusedAdam is a CUDA op
        },
    },
    "scheduler": {
        "type": "WarmupLR",
        "params": {
            "warmup_min_lr": "auto",
            "warmup_max_lr": "auto",
            "warmup_num_steps": "auto"
        },
    },
    "zero_optimization": {
        "stage": 3,
        "overlap_comm": True,
        "contiguous_gradients": True,
        "sub_group_size": 1e9,
        "reduce_bucket_size": "auto",
        "stage3_prefetch_bucket_size": "auto",
        "stage3_param_persistence_threshold": "auto",
        "stage3_max_live_parameters": 1e9,
        "stage3_max_reuse_distance": 1e9,
        "stage3_gather_16bit_weights_on_model_save": True,
    },
    "gradient_accumulation_steps": "auto",
    "gradient_clipping": "auto",
    "steps_per_print": 1000,
    "train_batch_size": "auto",
    "train_micro_batch_size_per_gpu": "auto",
    "wall_clock_breakdown": False,
}

# --stage 2: the ZeRO-2 section of the same docs.
ZERO2 = {
    "stage": 2,
    "overlap_comm": True,
    "contiguous_gradients": True,
    "reduce_bucket_size": "auto",
}

VOCAB, SEQ, SAMPLES, BATCH = 64, 16, 16, 2
LR, WARMUP = 3e-3, 2
DROPPED_UNDER_ZERO3 = {"deepseek_v4": ["model.norm.weight"]}


class TokenDataset(torch.utils.data.Dataset):
    """A tiny fixed dataset: each sample counts up from a random start (mod VOCAB), which a model learns in a few
    steps, with a few random tokens mixed in."""

    def __init__(self):
        gen = torch.Generator().manual_seed(1234)
        starts = torch.randint(0, VOCAB, (SAMPLES, 1), generator=gen)
        ids = (starts + torch.arange(SEQ)) % VOCAB
        noise = torch.rand(SAMPLES, SEQ, generator=gen) < 0.1
        ids[noise] = torch.randint(0, VOCAB, (int(noise.sum()), ), generator=gen)
        self.ids = ids

    def __len__(self):
        return SAMPLES

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def kept_names(model, model_cls):
    """The parameter names the model's ``_keep_in_fp32_modules_strict`` selects, matched as transformers matches."""
    names = sorted(getattr(model_cls, "_keep_in_fp32_modules_strict", None) or [])
    pattern = re.compile("|".join(name.replace("*", ".*") for name in names))
    return [name for name, p in model.named_parameters() if p.is_floating_point() and pattern.search(name)]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True, choices=["deepseek_v3", "deepseek_v4"])
    parser.add_argument("--model-dir", required=True)
    parser.add_argument("--output-dir", required=True)
    parser.add_argument("--results", required=True)
    parser.add_argument("--max-steps", type=int, required=True)
    parser.add_argument("--save-steps", type=int, default=0)
    parser.add_argument("--resume", default=None)
    parser.add_argument("--save-model", default=None)
    parser.add_argument("--workaround", required=True, help="examples/zero3_workaround.py")
    parser.add_argument("--stage", type=int, default=3, choices=[2, 3], help="zero_optimization.stage")
    args = parser.parse_args()

    import transformers
    import deepspeed
    import deepspeed.comm as dist
    from deepspeed.utils import safe_get_full_fp32_param

    sys.path.insert(0, os.path.dirname(os.path.abspath(args.workaround)))
    from zero3_workaround import reload_from_checkpoint

    model_cls = {"deepseek_v3": transformers.DeepseekV3ForCausalLM, "deepseek_v4": transformers.DeepseekV4ForCausalLM}
    model_cls = model_cls[args.model]
    os.makedirs(args.results, exist_ok=True)

    # On the CPU (use_cpu), accelerate starts torch.distributed itself and not DeepSpeed's comm, so zero.Init would
    # read a world size of 1 from the config ("train_batch_size 4 != 2 * 1 * 1"): start DeepSpeed's comm first, as
    # accelerate does for DeepSpeed on accelerators.
    deepspeed.init_distributed(dist_backend="gloo")
    config = json.loads(json.dumps(DEEPSPEED_CONFIG))
    if args.stage == 2:
        config["zero_optimization"] = ZERO2
    # Hugging Face's order: the TrainingArguments with the DeepSpeed config first (it creates the HfDeepSpeedConfig
    # that makes from_pretrained use zero.Init), then from_pretrained.
    training_args = transformers.TrainingArguments(
        output_dir=args.output_dir,
        deepspeed=config,
        use_cpu=True,
        bf16=True,
        per_device_train_batch_size=BATCH,
        gradient_accumulation_steps=1,
        max_steps=args.max_steps,
        learning_rate=LR,
        warmup_steps=WARMUP,
        weight_decay=0.0,
        save_strategy="steps" if args.save_steps else "no",
        save_steps=args.save_steps or 500,
        logging_steps=1,
        report_to="none",
        disable_tqdm=True,
        dataloader_num_workers=0,
        seed=42,
    )
    assert transformers.integrations.is_deepspeed_zero3_enabled() == (args.stage == 3)
    model = model_cls.from_pretrained(args.model_dir, dtype=torch.bfloat16)
    if args.stage == 3:
        assert all(hasattr(p, "ds_id") for p in model.parameters()), "zero.Init did not partition the parameters"
        dropped = DROPPED_UNDER_ZERO3.get(args.model, [])
        assert reload_from_checkpoint(model, args.model_dir, dropped) == dropped

    kept = kept_names(model, model_cls)
    rank = dist.get_rank()
    losses = []
    info = {}

    def full_values(module):
        """rank 0: {name: (full value, fp32 master)} of every parameter; a collective call."""
        out = {}
        for name, p in module.named_parameters():
            master = safe_get_full_fp32_param(p)
            with deepspeed.zero.GatheredParameters(p):
                value = p.data.detach().clone()
            out[name] = (value, None if master is None else master.detach().clone().view_as(value))
        return out

    def dtypes(module):
        return {name: [str(p.dtype), str(getattr(p, "ds_tensor", p).dtype)] for name, p in module.named_parameters()}

    class Record(transformers.TrainerCallback):

        def on_train_begin(self, args_, state, control, model=None, **kwargs):
            values = full_values(model)
            info["begin_step"] = state.global_step
            info["begin_dtypes"] = dtypes(model)
            if rank == 0:
                torch.save(values, os.path.join(args.results, "begin.pt"))

        def on_save(self, args_, state, control, model=None, **kwargs):
            values = full_values(model)
            if rank == 0:
                torch.save(values, os.path.join(args.results, f"masters_step{state.global_step}.pt"))

    class LossTrainer(transformers.Trainer):

        def compute_loss(self, model, inputs, *a, **kw):
            result = super().compute_loss(model, inputs, *a, **kw)
            loss = result[0] if isinstance(result, tuple) else result
            losses.append([self.state.global_step + 1, loss.detach().float().item()])
            return result

    trainer = LossTrainer(model=model,
                          args=training_args,
                          train_dataset=TokenDataset(),
                          data_collator=transformers.default_data_collator,
                          callbacks=[Record()])
    trainer.train(resume_from_checkpoint=args.resume)

    if args.save_model:
        trainer.save_model(args.save_model)
        values = full_values(trainer.model_wrapped.module)
        if rank == 0:
            torch.save(values, os.path.join(args.results, "final.pt"))

    result = {
        "deepspeed": os.path.dirname(os.path.abspath(deepspeed.__file__)),
        "version": deepspeed.__version__,
        "kept": kept,
        "losses": losses,
        "end_dtypes": dtypes(trainer.model_wrapped.module),
        **info,
    }
    with open(os.path.join(args.results, f"rank{rank}.json"), "w") as f:
        json.dump(result, f, indent=1)
    dist.barrier()


if __name__ == "__main__":
    main()
    # Everything is written and both ranks met: skip the interpreter's teardown, where a background thread of the
    # Trainer's stack once aborted the process ("terminate called without an active exception") after a finished run.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
