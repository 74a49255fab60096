# Copyright (c) DeepSpeed Team.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""Tiny transformers models whose classes list parameters to keep in fp32, shared by the tests, the benchmarks and
the examples (as tests/unit/simple_model.py is for plain torch models).

Each ``<kind>_config(**sizes)`` returns the config of a tiny model with a few thousand to a few hundred thousand
parameters, with its router, norms and (DeepSeek-V4) hyper-connections, sinks and position biases, so that every
kind of listed parameter is there. The defaults are the sizes of the unit tests; a caller passes the sizes it needs
(any keyword of the config class), and ``None`` for a key leaves that setting at transformers' own default.

What the model classes list (transformers 5.24.0):

* ``deepseek_v4``: ``DeepseekV4ForCausalLM``: ``_keep_in_fp32_modules_strict``: hyper-connections, sinks, position
  biases, ``e_score_correction_bias``, the norms; ``_keep_in_fp32_modules`` (fp16 only): compressor projections.
* ``deepseek_v3``, ``glm4_moe``: ``DeepseekV3ForCausalLM``, ``Glm4MoeForCausalLM``: ``_keep_in_fp32_modules_strict``
  is ``["e_score_correction_bias", "gate.weight"]``: the router weight of every MoE layer.
* ``gpt_oss``: ``GptOssForCausalLM``: no strict list; ``_keep_in_fp32_modules`` (fp16 only): the norms.

``save_tiny_model(kind, directory, seed=0, **sizes)`` initialises one at random (``torch.manual_seed(seed)``, then
the model class on the config, outside ``zero.Init``) and writes it with ``save_pretrained`` (safetensors, fp32). Nothing is imported before a function is called (scripts set their
environment, e.g. ``OMP_NUM_THREADS``, first).
"""

VOCAB = 64

# kind: (model class name in transformers, the test sizes)
_KINDS = {
    "deepseek_v4": ("DeepseekV4ForCausalLM",
                    dict(vocab_size=VOCAB,
                         hidden_size=32,
                         moe_intermediate_size=16,
                         num_hidden_layers=2,
                         num_attention_heads=2,
                         num_key_value_heads=1,
                         head_dim=16,
                         q_lora_rank=16,
                         o_groups=2,
                         o_lora_rank=8,
                         n_routed_experts=4,
                         num_experts_per_tok=2,
                         n_shared_experts=1,
                         max_position_embeddings=64,
                         layer_types=["compressed_sparse_attention", "heavily_compressed_attention"],
                         compress_rates={
                             "compressed_sparse_attention": 2,
                             "heavily_compressed_attention": 4
                         },
                         mlp_layer_types=["hash_moe", "moe"],
                         sliding_window=4,
                         hc_mult=2,
                         hc_sinkhorn_iters=3,
                         index_n_heads=2,
                         index_head_dim=8,
                         index_topk=2)),
    "deepseek_v3": ("DeepseekV3ForCausalLM",
                    dict(vocab_size=VOCAB,
                         hidden_size=32,
                         intermediate_size=64,
                         moe_intermediate_size=16,
                         num_hidden_layers=2,
                         first_k_dense_replace=0,
                         num_attention_heads=2,
                         num_key_value_heads=2,
                         n_shared_experts=1,
                         n_routed_experts=4,
                         num_experts_per_tok=2,
                         n_group=1,
                         topk_group=1,
                         kv_lora_rank=16,
                         q_lora_rank=16,
                         qk_rope_head_dim=8,
                         qk_nope_head_dim=8,
                         v_head_dim=16,
                         max_position_embeddings=64,
                         num_mtp_layers=0)),
    "glm4_moe": ("Glm4MoeForCausalLM",
                 dict(vocab_size=VOCAB,
                      hidden_size=32,
                      intermediate_size=32,
                      moe_intermediate_size=16,
                      num_hidden_layers=2,
                      num_attention_heads=2,
                      num_key_value_heads=1,
                      n_shared_experts=1,
                      n_routed_experts=4,
                      num_experts_per_tok=2,
                      first_k_dense_replace=1,
                      use_qk_norm=True,
                      attention_bias=True,
                      max_position_embeddings=64,
                      num_mtp_layers=0)),
    "gpt_oss": ("GptOssForCausalLM",
                dict(vocab_size=VOCAB,
                     hidden_size=32,
                     intermediate_size=32,
                     num_hidden_layers=2,
                     num_attention_heads=2,
                     num_key_value_heads=1,
                     head_dim=16,
                     num_local_experts=4,
                     num_experts_per_tok=2,
                     sliding_window=4,
                     max_position_embeddings=64,
                     rope_parameters={
                         "rope_type": "default",
                         "rope_theta": 150000.0
                     })),
}
KINDS = tuple(_KINDS)


def has_model(kind):
    """Whether the installed transformers has the model class of ``kind``."""
    import transformers
    return hasattr(transformers, _KINDS[kind][0])


def model_class(kind):
    import transformers
    return getattr(transformers, _KINDS[kind][0])


def config(kind, **sizes):
    """The config of the tiny ``kind`` model: the test sizes, updated by ``sizes`` (``None``: transformers' default)."""
    import transformers
    class_name, defaults = _KINDS[kind]
    settings = {key: value for key, value in {**defaults, **sizes}.items() if value is not None}
    return getattr(transformers, class_name.replace("ForCausalLM", "Config"))(**settings)


def deepseek_v4_config(**sizes):
    return config("deepseek_v4", **sizes)


def deepseek_v3_config(**sizes):
    return config("deepseek_v3", **sizes)


def glm4_moe_config(**sizes):
    return config("glm4_moe", **sizes)


def gpt_oss_config(**sizes):
    return config("gpt_oss", **sizes)


def tiny_model(kind, seed=0, **sizes):
    """The tiny ``kind`` model, fp32, initialised at random after ``torch.manual_seed(seed)`` (outside zero.Init)."""
    import torch
    cfg = config(kind, **sizes)
    torch.manual_seed(seed)
    return model_class(kind)(cfg)


def save_tiny_model(kind, directory, seed=0, **sizes):
    """``tiny_model(kind, seed, **sizes)`` written into ``directory`` by ``save_pretrained`` (``model.safetensors``,
    fp32). Returns the model."""
    model = tiny_model(kind, seed=seed, **sizes)
    model.save_pretrained(str(directory))
    return model
