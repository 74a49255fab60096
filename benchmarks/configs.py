# Copyright (c) DeepSpeed Team.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""The DeepSpeed configs of the benchmarks (written by the parent, read by the ranks from their job spec)."""

import json

UNSET = "<default>"  # keep_in_fp32_modules left out of the config (DeepSpeed's default, "auto")


def ds_config(micro_batch, world_size, keep=UNSET, dtype="bf16", overrides=None):
    config = {
        "train_micro_batch_size_per_gpu": micro_batch,
        "gradient_accumulation_steps": 1,
        "train_batch_size": micro_batch * world_size,
        "gradient_clipping": 1.0,
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 10**9,
        "zero_optimization": {
            "stage": 3,
            # Tiny models: gather every parameter (the default threshold, 1e5 elements, would make all of them
            # persistent, so no fetch would be measured), and several reduce buckets per step.
            "stage3_param_persistence_threshold": 0,
            "reduce_bucket_size": 50000,
            "stage3_prefetch_bucket_size": 50000,
        },
    }
    config["bf16" if dtype == "bf16" else "fp16"] = {"enabled": True}
    if dtype == "fp16":
        config["fp16"].update({"initial_scale_power": 8, "loss_scale_window": 100})
    if keep != UNSET:
        config["data_types"] = {"keep_in_fp32_modules": keep}
    for key, value in (overrides or {}).items():
        if isinstance(value, dict) and isinstance(config.get(key), dict):
            config[key].update(value)
        else:
            config[key] = value
    return config


def describe_keep(keep):
    return 'default ("auto")' if keep == UNSET else json.dumps(keep)
