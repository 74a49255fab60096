# Copyright (c) DeepSpeed Team.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""Which checkpoint tensors does transformers' ZeRO-3 loader fail to load? Every key of four tiny models.

    .venv/bin/python docs/upstream/survey_zero3_load.py [--out DIR] [--models deepseek_v4,gpt_oss] [--with-fix]

For each model (DeepSeek-V4, DeepSeek-V3, GLM-4-MoE, gpt-oss; tiny configs, random init, seed 0; and, as a control,
DeepSeek-V4 with its final norm renamed in the file to the original checkpoints' ``norm.weight``) the parent:

1. builds it whole (no zero.Init, so transformers' own init runs), records every state-dict tensor's initial value,
   then moves every floating tensor away from it (``t + 0.25 + U[0, 1)``: differs from init in every element) and
   writes the model with ``save_pretrained`` (safetensors, fp32);
2. loads it back with a plain ``from_pretrained(dtype=torch.float32)``, no DeepSpeed: the reference (and checks that
   it equals what was written);
3. starts 2 ranks (gloo, ``DS_ACCELERATOR=cpu``) that load it with ``from_pretrained(dtype=torch.bfloat16)`` while
   an ``HfDeepSpeedConfig`` (ZeRO-3, bf16) is alive, so transformers runs ``zero.Init`` and its ZeRO-3 loader;
   rank 0 gathers every parameter and buffer, and records the loading info and what transformers logged;
4. compares every key: the ZeRO-3 value must equal the plain value cast to the dtype ZeRO-3 holds it in (bf16, or
   fp32 where the model keeps it in fp32). A key that differs is reported with whether it holds its initial value.

``--with-fix`` runs the ZeRO-3 load with the fix proposed in docs/upstream/transformers_zero3_renaming_bug.md
applied by monkeypatching (a key that the renamings map to no model key but that is itself a model key keeps its
name, as the non-ZeRO-3 loader does). The output is a table per model and a JSON file in ``--out``.
"""

import argparse
import json
import logging
import os
import re
import socket
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))
from unit import tiny_hf_models  # noqa: E402  (the tiny transformers models the tests and benchmarks share)


def deepseek_v4():
    # All three attention layer types and both MoE types, so that every kind of key is there.
    return tiny_hf_models.model_class("deepseek_v4"), tiny_hf_models.deepseek_v4_config(
        num_hidden_layers=3,
        layer_types=["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"],
        mlp_layer_types=["hash_moe", "moe", "moe"],
        num_nextn_predict_layers=0)


def deepseek_v3():
    return tiny_hf_models.model_class("deepseek_v3"), tiny_hf_models.deepseek_v3_config(intermediate_size=32,
                                                                                        n_group=2,
                                                                                        topk_group=1,
                                                                                        first_k_dense_replace=1,
                                                                                        v_head_dim=8)


def glm4_moe():
    return tiny_hf_models.model_class("glm4_moe"), tiny_hf_models.glm4_moe_config()


def gpt_oss():
    return tiny_hf_models.model_class("gpt_oss"), tiny_hf_models.gpt_oss_config()


MODELS = {"deepseek_v4": deepseek_v4, "deepseek_v3": deepseek_v3, "glm4_moe": glm4_moe, "gpt_oss": gpt_oss}
# The same DeepSeek-V4 file with its final norm under the name of the original checkpoints, "norm.weight" (what
# save_pretrained writes as "model.norm.weight"): a control, loaded through the same renamings.
MODELS["deepseek_v4_norm_renamed"] = deepseek_v4
RENAME_IN_FILE = {"deepseek_v4_norm_renamed": {"model.norm.weight": "norm.weight"}}

# ---------------------------------------------------------------------------------------------------------------
# The proposed fix, as a monkeypatch (for --with-fix)
# ---------------------------------------------------------------------------------------------------------------


def apply_fix():
    """The ZeRO-3 loader's renaming gets the non-ZeRO-3 loader's fallback (core_model_loading.py, in
    convert_and_load_state_dict_in_model): a key that the renamings map to no model key, but that is itself a model
    key, keeps its name. integrations/deepspeed.py imports rename_source_key when it runs, so patching the module
    attribute reaches it; the non-ZeRO-3 loader already does the same check, so it is not changed by this."""
    import transformers.core_model_loading as cml
    original = cml.rename_source_key

    def rename_source_key(source_key,
                          weight_renamings,
                          weight_converters,
                          base_model_prefix=None,
                          meta_state_dict=None,
                          reverse=False):
        renamed, pattern = original(source_key, weight_renamings, weight_converters, base_model_prefix,
                                    meta_state_dict, reverse)
        if (not reverse and meta_state_dict is not None and renamed not in meta_state_dict
                and source_key in meta_state_dict):
            renamed, pattern = original(source_key, [], [], base_model_prefix, meta_state_dict)
        return renamed, pattern

    cml.rename_source_key = rename_source_key


# ---------------------------------------------------------------------------------------------------------------
# One rank
# ---------------------------------------------------------------------------------------------------------------


def rank_main(rank, world_size, port, out, names, with_fix):
    os.environ.update(RANK=str(rank),
                      LOCAL_RANK=str(rank),
                      WORLD_SIZE=str(world_size),
                      LOCAL_SIZE=str(world_size),
                      MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    import warnings
    warnings.filterwarnings("ignore")
    import torch
    import transformers
    import deepspeed
    from deepspeed.utils import logger as ds_logger
    ds_logger.setLevel(logging.ERROR)
    deepspeed.init_distributed(dist_backend="gloo")
    if with_fix:
        apply_fix()

    # Everything transformers logs at warning level or above while loading.
    logged = []

    class Keep(logging.Handler):

        def emit(self, record):
            message = re.sub(r"\x1b\[[0-9;]*m", "", record.getMessage())  # no terminal colours
            logged.append(f"{record.levelname}: {message}")

    transformers.logging.set_verbosity_warning()
    hf_logger = transformers.logging.get_logger("transformers")
    hf_logger.addHandler(Keep(level=logging.WARNING))

    for name in names:
        model_cls, _ = MODELS[name]()
        ds_config = {
            "train_micro_batch_size_per_gpu": 1,
            "zero_optimization": {
                "stage": 3
            },
            "bf16": {
                "enabled": True
            },
        }
        hf_ds_config = transformers.integrations.HfDeepSpeedConfig(ds_config)  # alive during from_pretrained
        logged.clear()
        model, info = model_cls.from_pretrained(str(out / name / "model"),
                                                dtype=torch.bfloat16,
                                                output_loading_info=True)
        params = dict(model.named_parameters())
        with deepspeed.zero.GatheredParameters(list(params.values())):
            values = {n: p.data.detach().clone() for n, p in params.items()}
        values.update({n: b.detach().clone() for n, b in model.named_buffers()})
        if rank == 0:
            torch.save(
                {
                    "values": values,
                    "missing_keys": sorted(info.get("missing_keys", [])),
                    "unexpected_keys": sorted(info.get("unexpected_keys", [])),
                    "logged": list(logged),
                }, out / name / "zero3.pt")
        del model, hf_ds_config
        deepspeed.comm.barrier()


# ---------------------------------------------------------------------------------------------------------------
# The parent
# ---------------------------------------------------------------------------------------------------------------


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def write_models(out, names):
    import torch
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file
    for name in names:
        model_cls, config = MODELS[name]()
        torch.manual_seed(0)
        model = model_cls(config)
        state = model.state_dict()  # shares storage with the parameters and persistent buffers
        initial = {k: v.detach().clone() for k, v in state.items()}
        with torch.no_grad():
            for t in state.values():
                if t.is_floating_point():
                    t.add_(torch.rand_like(t) + 0.25)
        written = {k: v.detach().clone() for k, v in model.state_dict().items()}
        model.save_pretrained(str(out / name / "model"))
        if name in RENAME_IN_FILE:
            file = out / name / "model" / "model.safetensors"
            tensors = load_file(str(file))
            for old, new in RENAME_IN_FILE[name].items():
                tensors[new] = tensors.pop(old)
            save_file(tensors, str(file), metadata={"format": "pt"})
        with safe_open(str(out / name / "model" / "model.safetensors"), framework="pt") as f:
            file_keys = sorted(f.keys())
        plain = model_cls.from_pretrained(str(out / name / "model"), dtype=torch.float32)
        plain_state = {k: v.detach().clone() for k, v in plain.state_dict().items()}
        bad = sorted(k for k in written if not torch.equal(plain_state[k], written[k]))
        assert set(plain_state) == set(written) and not bad, (name, bad)
        torch.save({"initial": initial, "plain": plain_state, "file_keys": file_keys}, out / name / "plain.pt")
        del model, plain


def compare(out, names):
    import torch
    results = {}
    for name in names:
        plain = torch.load(out / name / "plain.pt")
        zero3 = torch.load(out / name / "zero3.pt")
        wrong = {}
        for key, expected in plain["plain"].items():
            got = zero3["values"][key]
            if torch.equal(got, expected.to(got.dtype)):
                continue
            initial = plain["initial"][key]
            wrong[key] = {
                "dtype": str(got.dtype).replace("torch.", ""),
                "holds_init": torch.equal(got, initial.to(got.dtype)),
                "zero3_mean": got.float().mean().item(),
                "plain_mean": expected.float().mean().item(),
                "init_mean": initial.float().mean().item(),
            }
        results[name] = {
            "keys": len(plain["plain"]),
            "file_keys": len(plain["file_keys"]),
            "verbatim_file_keys": sorted(set(plain["file_keys"]) & set(plain["plain"])),
            "wrong": wrong,
            "missing_keys": zero3["missing_keys"],
            "logged": zero3["logged"],
        }
    return results


def report(results, with_fix):
    import torch
    import transformers
    import deepspeed
    print(f"transformers {transformers.__version__}, deepspeed {deepspeed.__version__} "
          f"({Path(deepspeed.__path__[0]).parent}), torch {torch.__version__}"
          f"{', with the proposed fix' if with_fix else ''}")
    print("ZeRO-3 bf16 from_pretrained on 2 CPU ranks vs plain fp32 from_pretrained, every state-dict key:")
    for name, r in results.items():
        ok = r["keys"] - len(r["wrong"])
        print(f"  {name}: {ok} of {r['keys']} keys load equal ({r['file_keys']} keys in the file; "
              f"{len(r['verbatim_file_keys'])} of them under the model's own name)")
        for key, w in r["wrong"].items():
            state = "its initial value" if w["holds_init"] else "neither the checkpoint nor its initial value"
            print(f"    WRONG {key} ({w['dtype']}): holds {state} (mean {w['zero3_mean']:.4f}; "
                  f"checkpoint {w['plain_mean']:.4f}, init {w['init_mean']:.4f})")
        print(f"    missing_keys reported by from_pretrained(output_loading_info=True): {r['missing_keys'] or 'none'}")
        print(f"    warnings logged by transformers during the ZeRO-3 load: {len(r['logged'])}")
        for line in r["logged"]:
            print("      " + line.replace("\n", "\n      "))


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="out/survey_zero3_load")
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--with-fix", action="store_true", help="load with the proposed fix monkeypatched in")
    parser.add_argument("--world-size", type=int, default=2)
    args = parser.parse_args()
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    out = Path(args.out).resolve()
    names = args.models.split(",")
    t0 = time.time()

    import transformers
    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    write_models(out, names)
    import torch.multiprocessing as mp
    mp.start_processes(rank_main,
                       args=(args.world_size, free_port(), out, names, args.with_fix),
                       nprocs=args.world_size,
                       start_method="spawn")
    results = compare(out, names)
    report(results, args.with_fix)
    with open(out / ("results_with_fix.json" if args.with_fix else "results.json"), "w") as f:
        json.dump(results, f, indent=1)
    print(f"({time.time() - t0:.0f} s; results in {out})")
    return 1 if any(r["wrong"] for r in results.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
