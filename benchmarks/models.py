# Copyright (c) DeepSpeed Team.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""The benchmarks' models: the tiny transformers models (tests/unit/tiny_hf_models.py, shared with the tests, the
demo and the accuracy study) at the benchmark's sizes, and a synthetic torch model whose listed share and width are
arguments. Nothing here imports DeepSpeed: the parent process writes the transformers models, the ranks build them.
"""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
from unit import tiny_hf_models  # noqa: E402  (the tiny transformers models the tests, demo and study share)

VOCAB = 256

# The benchmark's sizes of the shared tiny models (tests/unit/tiny_hf_models.py): wider than the tests' (hidden 64,
# vocabulary 256), so that a step does some arithmetic. None: transformers' default.
HF_SIZES = {
    "deepseek_v4":
    dict(vocab_size=VOCAB,
         hidden_size=64,
         num_attention_heads=4,
         head_dim=32,
         qk_rope_head_dim=8,
         q_lora_rank=32,
         o_lora_rank=32,
         moe_intermediate_size=64,
         index_head_dim=16,
         index_topk=4,
         sliding_window=8,
         num_nextn_predict_layers=0,
         max_position_embeddings=256),
    "gpt_oss":
    dict(vocab_size=VOCAB,
         hidden_size=64,
         intermediate_size=64,
         num_attention_heads=4,
         num_key_value_heads=2,
         sliding_window=8,
         layer_types=["sliding_attention", "full_attention"],
         max_position_embeddings=None,
         rope_parameters=None),
}
HF_MODELS = tuple(HF_SIZES)


def save_hf_model(kind, directory, seed=1234):
    """Randomly initialise the tiny ``kind`` model (seeded) and save it in fp32 safetensors. Returns the folder.

    In a child process (this file run as a script): transformers imports DeepSpeed when it builds a model, and the
    parent process must not import either build.
    """
    directory = Path(directory)
    if not (directory / "model.safetensors").exists():
        subprocess.run([sys.executable, __file__, kind, str(directory), str(seed)], check=True)
    return directory


def keep_elements_for_share(share, dim, layers, vocab=VOCAB):
    """Elements of the listed ``keep`` parameter per block so that they are ``share`` of all elements of TinyNet."""
    if not share:
        return 0
    other = 2 * vocab * dim + layers * (dim * dim + 2 * dim) + 2 * dim
    return max(1, round(share * other / (1.0 - share) / layers))


def _language_model(dim, layers, vocab, block):
    """Embedding, ``layers`` modules made by ``block()``, a final LayerNorm, head, cross-entropy loss."""
    import torch
    import torch.nn.functional as F

    class TinyNet(torch.nn.Module):

        def __init__(self):
            super().__init__()
            self.embed = torch.nn.Embedding(vocab, dim)
            self.blocks = torch.nn.ModuleList(block() for _ in range(layers))
            self.final_norm = torch.nn.LayerNorm(dim)
            self.head = torch.nn.Linear(dim, vocab, bias=False)

        def forward(self, input_ids, labels):
            h = self.embed(input_ids)
            for layer in self.blocks:
                h = layer(h)
            logits = self.head(self.final_norm(h)).float()
            return F.cross_entropy(logits[:, :-1].reshape(-1, vocab), labels[:, 1:].reshape(-1))

    return TinyNet()


def make_tiny_net(dim, layers, keep_per_block, vocab=VOCAB):
    """A small torch language model: embedding, ``layers`` blocks of Linear + LayerNorm, head, cross-entropy loss.

    With ``keep_per_block`` > 0 each block also has a parameter ``keep`` of that many elements that scales its
    output; the benchmark lists it with ``keep_in_fp32_modules: ["keep"]``. Nothing is listed by the model itself.
    """
    import torch

    class Block(torch.nn.Module):

        def __init__(self):
            super().__init__()
            self.proj = torch.nn.Linear(dim, dim, bias=False)
            self.norm = torch.nn.LayerNorm(dim)
            if keep_per_block:
                self.keep = torch.nn.Parameter(torch.randn(keep_per_block) * 0.1)

        def forward(self, h):
            out = torch.tanh(self.proj(self.norm(h)))
            if keep_per_block:
                out = out * (1 + self.keep.float().pow(2).mean()).to(out.dtype)
            return h + out

    return _language_model(dim, layers, vocab, Block)


# AutoEP (DeepSpeed's expert parallelism under ZeRO-3) replaces each block's ``moe`` with its own layer and router.
AUTOEP_CONFIG = {
    "enabled": True,
    "autoep_size": 2,
    "moe_layer_pattern": r"blocks\.\d+\.moe",
    "expert_w1": "w1",
    "expert_w2": "w2",
    "expert_w3": "w3",
    "top_k": 1,
    "use_grouped_mm": False,
}


def make_autoep_net(dim, layers, experts=2, ffn=16, vocab=VOCAB):
    """A small torch MoE language model for AutoEP (AUTOEP_CONFIG): embedding, ``layers`` blocks of LayerNorm and a
    top-1 MoE block (a router ``gate`` and SwiGLU experts stored as 3-D tensors, as transformers 5 stores them), head,
    cross-entropy loss. Nothing is listed by the model itself; AutoEP's router computes in the activations' dtype."""
    import torch

    class Experts(torch.nn.Module):

        def __init__(self):
            super().__init__()
            self.w1 = torch.nn.Parameter(torch.randn(experts, ffn, dim) * dim**-0.5)
            self.w2 = torch.nn.Parameter(torch.randn(experts, dim, ffn) * ffn**-0.5)
            self.w3 = torch.nn.Parameter(torch.randn(experts, ffn, dim) * dim**-0.5)

    class MoE(torch.nn.Module):

        def __init__(self):
            super().__init__()
            self.gate = torch.nn.Linear(dim, experts, bias=False)
            self.experts = Experts()

        def forward(self, h):
            raise AssertionError("AutoEP did not replace the MoE block")

    class Block(torch.nn.Module):

        def __init__(self):
            super().__init__()
            self.norm = torch.nn.LayerNorm(dim)
            self.moe = MoE()

        def forward(self, h):
            return h + self.moe(self.norm(h))

    return _language_model(dim, layers, vocab, Block)


def make_lm_head_net(dim=64, vocab_out=8192, layers=1, vocab=VOCAB):
    """A small torch language model whose output projection ``lm_head`` (``dim`` x ``vocab_out``, 64 x 8192 by
    default: 524,288 of its 545,152 elements) dominates, as in models that list their ``lm_head`` for fp32; the
    benchmark lists it with ``keep_in_fp32_modules: ["lm_head"]``. The head computes in its weight's dtype (fp32
    when kept). Inputs are token ids below ``vocab``; the loss is cross-entropy over ``vocab_out`` classes."""
    import torch
    import torch.nn.functional as F

    class Block(torch.nn.Module):

        def __init__(self):
            super().__init__()
            self.proj = torch.nn.Linear(dim, dim, bias=False)
            self.norm = torch.nn.LayerNorm(dim)

        def forward(self, h):
            return h + torch.tanh(self.proj(self.norm(h)))

    class LmHeadNet(torch.nn.Module):

        def __init__(self):
            super().__init__()
            self.embed = torch.nn.Embedding(vocab, dim)
            self.blocks = torch.nn.ModuleList(Block() for _ in range(layers))
            self.final_norm = torch.nn.LayerNorm(dim)
            self.lm_head = torch.nn.Linear(dim, vocab_out, bias=False)

        def forward(self, input_ids, labels):
            h = self.embed(input_ids)
            for block in self.blocks:
                h = block(h)
            h = self.final_norm(h)
            logits = F.linear(h.to(self.lm_head.weight.dtype), self.lm_head.weight).float()
            return F.cross_entropy(logits[:, :-1].reshape(-1, vocab_out), labels[:, 1:].reshape(-1))

    return LmHeadNet()


if __name__ == "__main__":
    import transformers
    transformers.utils.logging.disable_progress_bar()
    tiny_hf_models.save_tiny_model(sys.argv[1], sys.argv[2], seed=int(sys.argv[3]), **HF_SIZES[sys.argv[1]])
