# Copyright (c) DeepSpeed Team.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""The DeepSpeed configs of the benchmarks (written by the parent, read by the ranks from their job spec)."""

import json

UNSET = "<default>"  # keep_in_fp32_modules left out of the config (DeepSpeed's default, "auto")

# The stages of the stage axis (run.py --stages, compare_pristine.py --stages): name -> what it is.
STAGES = {
    "0": "no ZeRO: the engine's bf16/fp16 optimizer",
    "1": "ZeRO-1 (stage_1_and_2.py)",
    "2": "ZeRO-2 (stage_1_and_2.py)",
    "3": "ZeRO-3",
    "3-offload": "ZeRO-3, offload_param and offload_optimizer to the CPU",
}
# Also accepted, not in the default lists.
MORE_STAGES = {
    "1-bf16opt": "ZeRO-1 with data_types.grad_accum_dtype fp32: the BF16 optimizer (bf16 only)",
    "2-offload": "ZeRO-2, offload_optimizer to the CPU",
    "3-offload-param": "ZeRO-3, offload_param to the CPU, the optimizer on the device",
    "0-fusedadam": "no ZeRO with the config's Adam: FusedAdam, in the engine's FP16_Optimizer",
    "3-hpz": "ZeRO-3 with ZeRO++'s hierarchical partitioning, zero_hpz_partition_size 2",
    "3-offload-nvme": "ZeRO-3, offload_param to NVMe (max_in_cpu 0) and offload_optimizer to the CPU",
    "2-muon": "ZeRO-2 with the Muon optimizer (by config: Muon for matrices, its auxiliary Adam for the rest)",
    "3-muon": "ZeRO-3 with the Muon optimizer (by config), reduce_scatter off (ZeRO-3's Muon needs it off)",
}
# offload_param's nvme_path in a config: worker.py makes a swap folder for each engine (the swapper empties its folder
# when an engine starts, and a paired timing runs two engines in one process)
NVME_PATH = "<a swap folder per engine>"
DEFAULT_STAGES = tuple(STAGES)
PRECISIONS = ("bf16", "fp16", "fp32", "autocast")


def parse_stages(text):
    stages = [s.strip() for s in text.split(",") if s.strip()]
    unknown = [s for s in stages if s not in STAGES and s not in MORE_STAGES]
    if unknown or not stages:
        raise ValueError(f"stages are a comma-separated list of {', '.join(list(STAGES) + list(MORE_STAGES))}; "
                         f"got {text!r}")
    return list(dict.fromkeys(stages))


def zero_section(stage):
    """The ``zero_optimization`` section of a stage of the axis."""
    level = int(stage[0])
    zero = {"stage": level}
    if level in (1, 2):
        # Tiny models: several reduce and all-gather buckets per step (the defaults, 5e8 elements, make one).
        zero.update({"reduce_bucket_size": 50000, "allgather_bucket_size": 50000})
    if level == 3:
        # Tiny models: gather every parameter (the default threshold, 1e5 elements, would make all of them
        # persistent, so no fetch would be measured), and several reduce buckets per step.
        zero.update({
            "stage3_param_persistence_threshold": 0,
            "reduce_bucket_size": 50000,
            "stage3_prefetch_bucket_size": 50000,
        })
    if stage == "3-hpz":
        zero["zero_hpz_partition_size"] = 2
    if stage in ("3-offload", "3-offload-param"):
        zero["offload_param"] = {"device": "cpu"}
    if stage == "3-offload-nvme":
        # max_in_cpu 0: the partitions large enough to swap (1 MiB) stay on NVMe and are swapped in for each fetch
        # and step, as in a model that does not fit in CPU memory; buffers of 2^22 elements hold the largest
        # partition of the benchmarks' models
        zero["offload_param"] = {"device": "nvme", "nvme_path": NVME_PATH, "max_in_cpu": 0, "buffer_size": 2**22}
        # no prefetch: 0.19.8's NVMe prefetch swaps in a partition twice on the benchmarks' torch model and stops
        # ("param 4 already assigned swap buffer id 3", __prefetch_nvme_param_partitions)
        zero["stage3_prefetch_bucket_size"] = 0
    if stage == "3-muon":
        zero["reduce_scatter"] = False
    if stage in ("3-offload", "2-offload", "3-offload-nvme"):
        zero["offload_optimizer"] = {"device": "cpu"}
    return zero


def ds_config(micro_batch, world_size, keep=UNSET, dtype="bf16", overrides=None, stage="3"):
    """The config of one job. ``dtype``: bf16, fp16 (dynamic loss scaling, initial scale 2^8), fp32 (no bf16/fp16
    section) or autocast (fp32 weights, ``torch_autocast`` bf16); ``stage``: a name of STAGES or MORE_STAGES."""
    config = {
        "train_micro_batch_size_per_gpu": micro_batch,
        "gradient_accumulation_steps": 1,
        "train_batch_size": micro_batch * world_size,
        "gradient_clipping": 1.0,
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 10**9,
        "zero_optimization": zero_section(stage),
    }
    if "offload_optimizer" in config["zero_optimization"]:
        # torch's AdamW on the CPU partitions (DeepSpeedCPUAdam is a C++ op that each build would compile)
        config["zero_force_ds_cpu_optimizer"] = False
    if dtype in ("bf16", "fp16"):
        config[dtype] = {"enabled": True}
    elif dtype == "autocast":
        config["torch_autocast"] = {"enabled": True, "dtype": "bfloat16"}
    elif dtype != "fp32":
        raise ValueError(dtype)
    if dtype == "fp16":
        config["fp16"].update({"initial_scale_power": 8, "loss_scale_window": 100})
    if stage == "0-fusedadam":
        # the engine builds the optimizer (worker.py passes none): AdamW as the client one, but fused
        config["optimizer"] = {"type": "Adam", "params": {"lr": 1e-3, "weight_decay": 0.0}}
    if stage.endswith("-muon"):
        # the engine builds Muon, tagging matrices for Muon and the rest for its auxiliary Adam
        config["optimizer"] = {"type": "Muon", "params": {"lr": 1e-3, "weight_decay": 0.0}}
    data_types = {}
    if stage == "1-bf16opt":
        data_types["grad_accum_dtype"] = "fp32"
    if keep != UNSET:
        data_types["keep_in_fp32_modules"] = keep
    if data_types:
        config["data_types"] = data_types
    for key, value in (overrides or {}).items():
        if isinstance(value, dict) and isinstance(config.get(key), dict):
            config[key].update(value)
        else:
            config[key] = value
    return config


def describe_keep(keep):
    return 'default ("auto")' if keep == UNSET else json.dumps(keep)
