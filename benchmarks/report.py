# Copyright (c) DeepSpeed Team.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""Tables, statistics and the machine's description, for the reports of run.py and compare_pristine.py."""

import math
import os
import platform


def machine_description():
    import torch
    info = {"python": platform.python_version(), "torch": torch.__version__, "platform": platform.platform()}
    cpu = platform.processor() or "unknown"
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    info["cpu"] = cpu
    # torch's CPU kernels: without AVX-512 bf16 (or AMX) torch's bf16 and fp16 matmuls fall to a path more than 100x
    # slower than fp32's (1024^3 on a 2-core AVX2 EPYC: 2.2 s against 13 ms), and a compute-bound step measures it
    info["cpu_capability"] = torch.backends.cpu.get_cpu_capability()
    info["bf16_matmul_kernels"] = _has_bf16_matmul_kernels()
    info["cores"] = os.cpu_count()
    try:
        info["cores_usable"] = len(os.sched_getaffinity(0))
    except AttributeError:
        info["cores_usable"] = os.cpu_count()
    try:
        with open("/proc/meminfo") as f:
            info["memory_gib"] = round(int(f.readline().split()[1]) / 2**20, 1)
    except (OSError, ValueError, IndexError):
        pass
    try:
        import transformers
        info["transformers"] = transformers.__version__
    except ImportError:
        pass
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
        info["gpus"] = torch.cuda.device_count()
        info["cuda"] = torch.version.cuda
    return info


def _has_bf16_matmul_kernels():
    """Whether the CPU has the instructions (avx512_bf16, amx_bf16) that oneDNN's bf16 matmuls need."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), [])
    except OSError:
        return None
    return bool({"avx512_bf16", "amx_bf16"} & set(flags))


def cpu_kernels(info):
    """torch's CPU capability and whether bf16 matmuls have their kernels, in words."""
    if "cpu_capability" not in info:
        return "CPU kernels unknown"
    bf16 = {True: "bf16 matmul kernels", False: "no bf16 matmul kernels", None: "bf16 matmul kernels unknown"}
    return f"torch CPU capability {info['cpu_capability']}, {bf16[info['bf16_matmul_kernels']]}"


def machine_line(info):
    line = (f"{info['cpu']}, {info['cores']} cores ({info['cores_usable']} usable), {cpu_kernels(info)}"
            f"{', %s GiB RAM' % info['memory_gib'] if 'memory_gib' in info else ''}; "
            f"Python {info['python']}, torch {info['torch']}, transformers {info.get('transformers', '?')}")
    if "gpu" in info:
        line += f"; GPU: {info['gpus']} x {info['gpu']} (CUDA {info['cuda']})"
    return line


def _bits(t):
    """The tensor's bit pattern as an integer tensor (so that comparisons are bitwise, NaN included)."""
    import torch
    ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
    return t.contiguous().view(ints[t.element_size()])


def compare_tensors(a, b):
    """(bitwise identical, max abs difference) of two tensors; shapes and dtypes must match to be identical."""
    if a.shape != b.shape:
        return False, float("nan")
    same = a.dtype == b.dtype and bool(torch_equal_bits(a, b))
    diff = (a.double() - b.double()).abs()
    return same, float(diff.max()) if diff.numel() else 0.0


def torch_equal_bits(a, b):
    import torch
    return torch.equal(_bits(a), _bits(b))


def stats(values):
    values = sorted(values)
    if not values:
        return {"min": math.nan, "median": math.nan, "max": math.nan}
    n = len(values)
    median = values[n // 2] if n % 2 else 0.5 * (values[n // 2 - 1] + values[n // 2])
    return {"min": values[0], "median": median, "max": values[-1]}


def markdown_table(header, rows):
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def text_table(header, rows):
    cells = [list(map(str, header))] + [[str(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    fmt = "  ".join("{:<%d}" % w for w in widths)
    lines = [fmt.format(*cells[0]), fmt.format(*("-" * w for w in widths))]
    lines += [fmt.format(*r) for r in cells[1:]]
    return "\n".join(lines)
