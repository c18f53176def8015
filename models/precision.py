"""The target's numerics as a per-machine choice: which dtype it runs in, and the machine facts behind that choice.

`target.dtype=auto` picks bfloat16 only where the machine multiplies bf16 natively, and that is measured, not
assumed: on a GPU, torch's own capability check (bf16 tensor cores); on a CPU, a bf16 matmul of a verify block's
shape must take at most BF16_WIN of the float32 time (CPUs with AMX or avx512_bf16 run it several times faster;
without them torch emulates bf16 and it is slower than float32: measured ratios in docs/results/precision.md). Everything
else runs float32. The decision, the measured ratio and the CPU/GPU model and flags are recorded in the teacher
manifest and the eval results beside every figure.
"""
from __future__ import annotations

import functools
import platform
import statistics
import time
from pathlib import Path

import torch

BF16_WIN = 0.8  # auto picks bf16 on a CPU whose bf16 matmul takes at most this fraction of float32's time
CPU_FLAGS = ("avx2", "avx512f", "avx512_bf16", "avx512_fp16", "amx_tile", "amx_bf16", "amx_fp16")


@functools.cache
def machine() -> dict:
    """The CPU model, its flags that matter for reduced-precision matmul, torch's CPU kernel level, and the GPU."""
    name, flags = platform.processor() or platform.machine(), set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name":
                name = value.strip()
            elif key.strip() == "flags":
                flags = set(value.split())
    except OSError:
        pass
    info = {"cpu": name, "cpu_flags": [f for f in CPU_FLAGS if f in flags],
            "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(), "torch": torch.__version__}
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name()
    return info


@functools.cache
def bf16_matmul_ratio(rows: int = 8, width: int = 1024, repeats: int = 15) -> float:
    """Median time of a (rows x width) @ (width x 4 width) matmul in bf16 over the same in float32, on the CPU."""
    times = {}
    for dtype in (torch.float32, torch.bfloat16):
        a, b = torch.randn(rows, width, dtype=dtype), torch.randn(width, 4 * width, dtype=dtype)
        a @ b  # warm-up (kernel selection, packing)
        runs = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            for _ in range(4):
                a @ b
            runs.append(time.perf_counter() - t0)
        times[dtype] = statistics.median(runs)
    return times[torch.bfloat16] / times[torch.float32]


def resolve_dtype(name: str, device: str | torch.device = "cpu") -> tuple[str, dict]:
    """(dtype name, why) for target.dtype `name` on `device`: auto -> bfloat16 where bf16 matmul is native and
    measured faster (see module doc), else float32; any other name is kept. `why` is recorded with the results."""
    device = torch.device(device)
    if name != "auto":
        return name, {"requested": name}
    if device.type == "cuda":
        native = torch.cuda.is_bf16_supported()
        return ("bfloat16" if native else "float32"), {"requested": "auto", "gpu_bf16_supported": native}
    ratio = bf16_matmul_ratio()
    chosen = "bfloat16" if ratio <= BF16_WIN else "float32"
    return chosen, {"requested": "auto", "bf16_over_float32_matmul": round(ratio, 3), "threshold": BF16_WIN}
