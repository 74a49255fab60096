# Copyright (c) DeepSpeed Team.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""Minimal reproduction: under DeepSpeed ZeRO-3, from_pretrained does not load DeepSeek-V4's model.norm.weight.

    pip install transformers==5.24.0 deepspeed torch safetensors
    DS_ACCELERATOR=cpu python repro_deepseek_v4_final_norm.py      # CPU, one process; or on one GPU without it

A tiny DeepSeek-V4 (random init) gets model.norm.weight = 3.0 and layers.0.self_attn.kv_norm.weight = 5.0 and is
written with save_pretrained. A plain from_pretrained loads 3.0 and 5.0. The same from_pretrained with an
HfDeepSpeedConfig (ZeRO-3) alive loads 5.0 and leaves the final norm at its initial 1.0; the load report calls it
"missing from the checkpoint", though the file has it. Part 1 shows the step that drops it, without DeepSpeed running.
Exits with 1 while the bug is there, 0 once it is fixed.
"""

import os
import sys
import tempfile

import torch
import transformers
from safetensors.torch import load_file
from transformers import DeepseekV4Config, DeepseekV4ForCausalLM

config = DeepseekV4Config(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                          num_key_value_heads=1, head_dim=16, q_lora_rank=16, o_lora_rank=8, o_groups=2,
                          n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1, moe_intermediate_size=16,
                          index_n_heads=2, index_head_dim=8, index_topk=2, sliding_window=4,
                          layer_types=["sliding_attention", "compressed_sparse_attention"],
                          mlp_layer_types=["moe", "moe"], compress_rates={"compressed_sparse_attention": 2,
                                                                          "heavily_compressed_attention": 4},
                          hc_mult=2, hc_sinkhorn_iters=3, num_nextn_predict_layers=0, max_position_embeddings=64)
FINAL, KV = "model.norm.weight", "model.layers.0.self_attn.kv_norm.weight"


def values(model):
    params = dict(model.named_parameters())
    return params[FINAL].float().mean().item(), params[KV].float().mean().item()


path = tempfile.mkdtemp()
model = DeepseekV4ForCausalLM(config)
with torch.no_grad():
    dict(model.named_parameters())[FINAL].fill_(3.0)
    dict(model.named_parameters())[KV].fill_(5.0)
model.save_pretrained(path)
file = load_file(os.path.join(path, "model.safetensors"))
print(f"transformers {transformers.__version__}; the file has {FINAL!r}: {FINAL in file} (value "
      f"{file[FINAL].mean().item()}), and the kv norm as 'model.layers.0.attn.norm.weight' "
      f"(value {file['model.layers.0.attn.norm.weight'].mean().item()})")

print("plain from_pretrained:           final norm %.1f, kv_norm %.1f" %
      values(DeepseekV4ForCausalLM.from_pretrained(path, dtype=torch.float32)))

# Part 1, no DeepSpeed running: the ZeRO-3 loader's key conversion drops the final norm.
from transformers.conversion_mapping import get_model_conversion_mapping  # noqa: E402
from transformers.integrations.deepspeed import _apply_weight_conversions_to_state_dict  # noqa: E402

converted = {}
for part in _apply_weight_conversions_to_state_dict(model, dict(file), get_model_conversion_mapping(model)):
    converted.update(part)
print(f"_apply_weight_conversions_to_state_dict keeps {FINAL!r}: {FINAL in converted}; keeps {KV!r}: "
      f"{KV in converted}")

# Part 2: from_pretrained under ZeRO-3 (one process).
import deepspeed  # noqa: E402
from transformers.integrations import HfDeepSpeedConfig  # noqa: E402

for key, value in dict(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                       MASTER_PORT="29511").items():
    os.environ.setdefault(key, value)
deepspeed.init_distributed(dist_backend="nccl" if torch.cuda.is_available() else "gloo")
ds_config = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3}, "bf16": {"enabled": True}}
hf_ds_config = HfDeepSpeedConfig(ds_config)  # keep it alive: transformers holds a weak reference
zero3 = DeepseekV4ForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
with deepspeed.zero.GatheredParameters(list(zero3.parameters())):
    final, kv = values(zero3)
print("from_pretrained under ZeRO-3:    final norm %.1f, kv_norm %.1f" % (final, kv))
sys.exit(0 if (final, kv) == (3.0, 5.0) else 1)
