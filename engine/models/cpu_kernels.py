"""w8a8's per-row work around fbgemm's matmul on CPU: quantizing each token's activations before it and scaling
the int32 sums back after, as one C++ pass each (csrc/w8a8_rows.cpp), compiled once per machine at the first
w8a8 load (about 30 s; torch's cpp_extension with gcc and ninja, kept in the cache) and Python otherwise.

Why: in torch calls each is about a dozen small operations, and for the few rows of a decode step those took
2-4x as long as the matmul itself (SmolLM2's four projections of a layer at 16 rows: 627 us with the torch calls
against 287 us fused, the matmuls alone 224 us; at one row 381 against 100; `python -m engine.bench kernels`).

Both paths compute the same floats, operation for operation (the test compares them bit for bit), so which one
runs changes the speed only. WATCHLLM_CPU_EXTENSIONS=0 keeps to Python; a failed build warns once and does too.
"""
from __future__ import annotations

import hashlib
import os
import platform
import sys
import threading
import warnings
from functools import cache
from pathlib import Path

import torch

from ..quant import quantize_uint8

SOURCE = Path(__file__).resolve().parent / "csrc" / "w8a8_rows.cpp"
W8A8_ZERO_POINT = 128  # the zero point fbgemm is given; each row's own is corrected after (linear.py)
_build_lock = threading.Lock()


def quantize_rows_python(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [T, K] fp32 -> (q - 128 as fp32 [T, K], scale [T], zero - 128 [T]): quant.quantize_uint8's rows, centred
    on fbgemm's zero point."""
    q, scale, zero = quantize_uint8(x)
    return q.float().sub_(W8A8_ZERO_POINT), scale, zero.sub_(W8A8_ZERO_POINT)


def dequantize_rows_python(y: torch.Tensor, scale: torch.Tensor, shifted: torch.Tensor,
                           unit: torch.Tensor) -> torch.Tensor:
    """y [T, N] in place: (y - shifted[t] * unit[n]) * scale[t]."""
    return y.sub_(torch.outer(shifted, unit)).mul_(scale.unsqueeze(-1))


def _cpu_key() -> str:
    """What the machine code depends on (it is built for this CPU): the CPU's flags, the Python and torch."""
    flags = platform.processor()
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith("flags")), flags)
    except OSError:
        pass
    key = f"{flags}|{sys.version_info[:2]}|{torch.__version__}"
    return hashlib.sha256(key.encode()).hexdigest()[:12]


@cache
def _compiled():
    """The compiled module, or None (disabled, or the build failed: warned once)."""
    if os.environ.get("WATCHLLM_CPU_EXTENSIONS", "1") == "0":
        return None
    from .loader import cache_dir  # (loader imports this module's users)
    name = f"watchllm_w8a8_rows_{_cpu_key()}"
    build = cache_dir() / "extensions" / name
    try:
        from torch.utils.cpp_extension import load
        build.mkdir(parents=True, exist_ok=True)
        return load(name, [str(SOURCE)], build_directory=str(build),
                    extra_cflags=["-O3", "-march=native", "-ffp-contract=off"], verbose=False)
    except Exception as exc:  # no compiler, no ninja, a read-only cache...: the Python path, same floats
        last = str(exc).strip().splitlines()[-1:] or [type(exc).__name__]
        warnings.warn(f"w8a8's C++ row helpers could not be built ({last[0]}); using the torch calls instead, "
                      f"which give the same results more slowly", RuntimeWarning, stacklevel=3)
        return None


def row_helpers():
    """(quantize_rows, dequantize_rows, name): the C++ pair when it builds here, else the Python one."""
    with _build_lock:  # two engines loading w8a8 at once build it once
        ext = _compiled()
    if ext is None:
        return quantize_rows_python, dequantize_rows_python, "torch calls"
    return ext.quantize_rows, ext.dequantize_rows, "C++"
