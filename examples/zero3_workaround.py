# Copyright (c) DeepSpeed Team.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""The workaround for a known issue of transformers 5.24.0 under ZeRO-3: load a tensor it drops by hand.

Under DeepSpeed ZeRO-3, transformers 5.24.0's ``from_pretrained`` does not load DeepSeek-V4's final norm
``model.norm.weight`` from a checkpoint written by ``save_pretrained``: its ZeRO-3 loader applies the DeepSeek-V4
checkpoint renaming ``.norm.`` -> ``.kv_norm.`` to every key, finds no ``model.kv_norm.weight`` and drops the tensor,
which keeps its initial value (1.0). (The loader without ZeRO-3 falls back to the key's own name.) Its load report
calls the key MISSING, "newly initialized because missing from the checkpoint", though the file has it.
docs/upstream/transformers_zero3_renaming_bug.md has the details; the demo and the tests use this function.

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)   # HfDeepSpeedConfig (ZeRO-3) alive
    reload_from_checkpoint(model, path, ["model.norm.weight"])                 # every rank, before initialize
    engine, *_ = deepspeed.initialize(model=model, ...)

The function is self-contained: copy it.
"""


def reload_from_checkpoint(model, checkpoint_dir, names):
    """Copy the parameters ``names`` from the safetensors checkpoint in ``checkpoint_dir`` into a ZeRO-3 model.

    Call it on every rank right after ``from_pretrained``, before ``deepspeed.initialize`` (or the Trainer) makes
    the optimizer's copies. Rank 0 reads each tensor and writes it under ``GatheredParameters(modifier_rank=0)``,
    which hands it to the other ranks' partitions. Names the checkpoint does not have are skipped (an original
    DeepSeek-V4 checkpoint names the final norm ``norm.weight``, which loads right). Returns the names copied.
    """
    import json
    import os

    import deepspeed
    import torch
    from safetensors import safe_open

    index = os.path.join(checkpoint_dir, "model.safetensors.index.json")
    if os.path.exists(index):  # a sharded checkpoint
        with open(index) as f:
            file_of = json.load(f)["weight_map"]
    else:
        with safe_open(os.path.join(checkpoint_dir, "model.safetensors"), framework="pt") as f:
            file_of = dict.fromkeys(f.keys(), "model.safetensors")
    params = dict(model.named_parameters())
    copied = []
    for name in names:
        if name not in file_of:
            continue
        param = params[name]
        with deepspeed.zero.GatheredParameters(param, modifier_rank=0):
            if torch.distributed.get_rank() == 0:
                with safe_open(os.path.join(checkpoint_dir, file_of[name]), framework="pt") as f:
                    param.data.copy_(f.get_tensor(name))
        copied.append(name)
    return copied
