# Copyright (c) DeepSpeed Team.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""What keeping costs on a model that keeps a GPU busy: a DeepSeek-V3-shaped MoE on one accelerator.

For every stage of ``--stages``, one process (world size 1: NCCL on CUDA, gloo on the CPU) builds two engines of
the patched DeepSpeed from the same weights, ``keep_in_fp32_modules: []`` and ``"auto"`` (DeepSeek-V3's
``_keep_in_fp32_modules_strict``: every MoE layer's router weight and ``e_score_correction_bias``), and trains them
on the same batches in alternating steps (worker.py's paired timing, as run.py's). Measured:

* step time: the median of the per-step ratios kept / [] with a 95 % bootstrap interval, and each engine's median;
* device memory of each engine as if it were alone (worker.py ``_engine_memory``): what it holds once its optimizer
  state exists, and the allocator's peak during a step above that; and the allocator's reserved memory. A small
  engine of the same config trains one step first and is dropped, so that the process's one-off allocations
  (cuBLAS workspaces, the optimizer op's buffers) are not counted as the first measured engine's;
* the losses, first and last: the data are learnable (each sample counts up from a random token), so they fall.

The model (``--size gpu``, the default on CUDA): transformers' ``DeepseekV3ForCausalLM`` at hidden 2048, 12 layers
(the first dense), 8 routed experts of 1408 and one shared, top-2, MLA attention, vocabulary 32768: about 1.2 billion
parameters (2.4 GiB in bf16), built whole with its own weight initialisation on the device. AdamW is the config's
(FusedAdam on CUDA, DeepSpeedCPUAdam for ``3-offload``; on the CPU, torch's AdamW, as run.py), bf16, gradient
clipping 1.0, ZeRO's default bucket sizes. ``--size tiny`` is the same shape at hidden 64 (the CPU rehearsal).

    .venv/bin/python benchmarks/paired_moe.py --out out/paired-moe                       # CUDA: every stage
    .venv/bin/python benchmarks/paired_moe.py --size tiny --stages 3 --steps 4 --out out/paired-moe-tiny

Writes DIR/results.json and DIR/results.md.
"""

import argparse
import json
import shlex
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import configs  # noqa: E402
import launch  # noqa: E402
import report  # noqa: E402
from run import bootstrap_median_ci  # noqa: E402

# DeepSeek-V3's shape: the first layer dense, then MoE layers of 8 routed experts (top-2) and one shared, MLA attention
SHAPE = dict(first_k_dense_replace=1, n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1, n_group=1,
             topk_group=1)
SIZES = {
    "gpu":
    dict(SHAPE,
         vocab_size=32768,
         hidden_size=2048,
         intermediate_size=5632,
         moe_intermediate_size=1408,
         num_hidden_layers=12,
         num_attention_heads=16,
         num_key_value_heads=16,
         q_lora_rank=1536,
         kv_lora_rank=512,
         qk_rope_head_dim=64,
         qk_nope_head_dim=128,
         v_head_dim=128,
         max_position_embeddings=4096),
    "tiny":
    dict(SHAPE, vocab_size=256, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=3,
         num_attention_heads=4, num_key_value_heads=4, q_lora_rank=32, kv_lora_rank=16, qk_rope_head_dim=8,
         qk_nope_head_dim=8, v_head_dim=16, max_position_embeddings=256),
}
# ZeRO's own defaults (configs.py sets small buckets for its tiny models)
ZERO_DEFAULTS = {
    "reduce_bucket_size": 500_000_000,
    "allgather_bucket_size": 500_000_000,
    "stage3_prefetch_bucket_size": 50_000_000,
    "stage3_param_persistence_threshold": 100_000,
}


def stage_config(stage, keep, args, on_gpu):
    config = configs.ds_config(args.micro_batch, 1, keep=keep, stage=stage)
    zero = config["zero_optimization"]
    for key, value in ZERO_DEFAULTS.items():
        if key in zero:
            zero[key] = value
    if on_gpu:
        # the engine builds it: FusedAdam on the device, DeepSpeedCPUAdam for optimizer offload (both JIT-built)
        config["optimizer"] = {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.0}}
        config.pop("zero_force_ds_cpu_optimizer", None)
    return config


def mib(x):
    return f"{x / 2**20:,.0f}"


def count_parameters(size):
    """The model's parameters, counted on the meta device in a child process (this one imports no DeepSpeed)."""
    code = ("import sys; sys.path.insert(0, 'tests'); from unit import tiny_hf_models as t; import torch\n"
            f"c = t.config('deepseek_v3', **{SIZES[size]!r})\n"
            "with torch.device('meta'): m = t.model_class('deepseek_v3')(c)\n"
            "print(sum(p.numel() for p in m.parameters()))")
    got = subprocess.run([sys.executable, "-c", code], cwd=launch.ROOT, capture_output=True, text=True)
    return int(got.stdout.split()[-1]) if got.returncode == 0 else None


def write_results(out, args, size, seq, on_gpu, n_params, results, failures):
    """results.json and results.md, rewritten after every stage (a run stopped early keeps what it measured)."""
    (out / "results.json").write_text(
        json.dumps({"size": size, "sizes": SIZES[size], "n_params": n_params, "results": results,
                    "failures": failures}, indent=1))
    rows = []
    for stage, s in results.items():
        row = [
            stage, f"{s['fp32_params'][0]} / {s['fp32_params'][1]}", s["steps"], f"{s['empty_median'] * 1e3:.2f}",
            f"{s['kept_median'] * 1e3:.2f}", f"{s['median_step_ratio']:.3f} [{s['median_step_ratio_ci95'][0]:.3f}, "
            f"{s['median_step_ratio_ci95'][1]:.3f}]",
            " / ".join(f"{losses[0]:.3f} -> {losses[-1]:.3f}" for losses in s["losses"])
        ]
        m = s["memory"]
        if m:
            row += [
                f"{mib(m[0]['held_bytes'])} / {mib(m[1]['held_bytes'])}",
                f"{mib(m[0]['peak_alone_bytes'])} / {mib(m[1]['peak_alone_bytes'])}",
                f"{m[1]['peak_alone_bytes'] / m[0]['peak_alone_bytes']:.4f}",
                f"{mib(m[1]['max_reserved_bytes'])}"
            ]
        else:
            row += ["-", "-", "-", "-"]
        rows.append(row)
    md = [
        f"# Kept / [] on a DeepSeek-V3-shaped MoE ({size}: hidden {SIZES[size]['hidden_size']}, "
        f"{SIZES[size]['num_hidden_layers']} layers, {SIZES[size]['n_routed_experts']} experts" +
        (f", {n_params / 1e6:,.1f} M parameters" if n_params else "") +
        f"), world size 1, {'CUDA' if on_gpu else 'CPU'}", "",
        f"Command: `{' '.join(shlex.quote(a) for a in [sys.executable, *sys.argv])}`  ",
        f"Micro-batch {args.micro_batch} x {seq} tokens, bf16, {args.warmup} warm-up pairs; paired steps "
        "(one process, the two engines alternate).", "",
        report.markdown_table([
            "stage", "fp32 params ([] / kept)", "step pairs", "[] step ms", "kept step ms",
            "kept / [] (median of step ratios [95 % CI])", "loss first -> last ([] / kept)", "held MiB ([] / kept)", "peak alone MiB ([] / kept)",
            "peak kept / []", "max reserved MiB (after kept's step)"
        ], rows), ""
    ]
    md += [f"- FAILED: {f}" for f in failures]
    (out / "results.md").write_text("\n".join(md) + "\n")
    return md


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--stages", default="0,1,2,3,3-offload")
    parser.add_argument("--size", choices=list(SIZES), default=None, help="default: gpu on CUDA, tiny on the CPU")
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=None, help="tokens per sample (default: 512 gpu, 32 tiny)")
    parser.add_argument("--steps", type=int, default=20, help="timed step pairs per stage")
    parser.add_argument("--offload-steps", type=int, default=6, help="timed step pairs for 3-offload")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--timeout", type=int, default=600, help="seconds per stage")
    parser.add_argument("--out", default=str(launch.ROOT / "out" / "paired-moe"))
    args = parser.parse_args()
    stages = configs.parse_stages(args.stages)
    on_gpu = launch.on_gpu()
    size = args.size or ("gpu" if on_gpu else "tiny")
    seq = args.seq or (512 if size == "gpu" else 32)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results, failures = {}, []
    n_params = count_parameters(size)
    for stage in stages:
        steps = args.offload_steps if "offload" in stage else args.steps
        paired = [stage_config(stage, keep, args, on_gpu) for keep in ([], configs.UNSET)]
        spec = dict(model="hf_config",
                    hf_kind="deepseek_v3",
                    hf_sizes=SIZES[size],
                    vocab=SIZES[size]["vocab_size"],
                    dtype="bf16",
                    micro_batch=args.micro_batch,
                    seq=seq,
                    seed=1234,
                    warmup=args.warmup,
                    steps=steps,
                    config=paired[0],
                    paired=paired,
                    memory=True,
                    warmup_sizes=SIZES["tiny"],
                    data="sequences")
        start = time.time()
        try:
            ranks = launch.launch(spec, "patched", 1, out / "jobs" / f"zero{stage}", timeout=args.timeout)
        except RuntimeError as err:
            lines = [line.strip() for line in str(err).splitlines() if "Error" in line]
            failures.append(f"stage {stage}: {(lines[-1] if lines else str(err).splitlines()[0])[:400]}")
            print(f"  stage {stage}: FAILED: {failures[-1]}", flush=True)
            write_results(out, args, size, seq, on_gpu, n_params, results, failures)
            continue
        r = ranks[0]
        empty, kept = r["step_times"]
        ratios = [b / a for a, b in zip(empty, kept)]
        results[stage] = {
            "seconds": time.time() - start,
            "steps": len(ratios),
            "fp32_params": r["fp32_params"],
            "empty_median": report.stats(empty)["median"],
            "kept_median": report.stats(kept)["median"],
            "median_step_ratio": report.stats(ratios)["median"],
            "median_step_ratio_ci95": bootstrap_median_ci([ratios]),
            "losses": r["losses"],
            "memory": r.get("memory"),
        }
        s = results[stage]
        print(f"  stage {stage:<10} {s['seconds']:6.1f} s  [] {s['empty_median'] * 1e3:8.2f} ms  kept "
              f"{s['kept_median'] * 1e3:8.2f} ms  kept / [] {s['median_step_ratio']:.3f}",
              flush=True)
        write_results(out, args, size, seq, on_gpu, n_params, results, failures)

    print("\n".join(write_results(out, args, size, seq, on_gpu, n_params, results, failures)))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
