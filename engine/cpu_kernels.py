"""The CPU engine's own kernels (csrc/cpu_kernels.cpp), compiled once per machine at first use (about 30 s; torch's
cpp_extension with gcc and ninja, kept in the cache) and Python's torch calls otherwise. Each replaces torch calls
that spent most of their time outside the arithmetic for the few rows of a decode step:

- w8a8's per-row work around fbgemm's matmul: quantizing each token's activations before it and scaling the int32
  sums back after. As torch calls each is about a dozen small operations, which took 2-4x as long as the matmul
  itself (SmolLM2's four projections of a layer at 16 rows: 627 us with the torch calls against 287 us fused, the
  matmuls alone 224 us; at one row 381 against 100). Both paths compute the same floats, operation for operation
  (the test compares them bit for bit), so which one runs changes the speed only.
- decode attention straight over the paged KV pool (attention/sdpa.py): one query per row against its own slots,
  without first gathering K and V into a padded batch for SDPA (an int8 pool dequantized as it is read). Its sums
  run in another order than SDPA's, so it agrees with it to float rounding (tested), not bit for bit. With AVX-512
  (head sizes 16-128) each query and its sums stay in vector registers: 16 rows x 100 slots 52 us, one row 6.5 us
  (the portable loops: 132 and 18.5; SDPA over the gathered batch: 310 and 40).
- writing a decode step's K and V into an int8 pool: each token and KV head quantized and stored in one call per
  layer, where quantize_int8's torch calls, their dequantization and four scatters were ~26 (5-6 ms of an int4
  token at batch 1 with the int8 cache, measured on the Intel machine: 23.5 -> 17.5 ms, the same as without the
  int8 cache). The same integers and scales bit for bit (tested).
- int8 and int4 weight-only matmuls (models/linear.py), the weights widened in registers as they are read, the
  next block's prefetched, the activations taken as they come (fp32 or bf16) with fp32 sums: torch's kernels
  take bf16 activations only and moved about half the bytes a second at one row on the Intel machine (SmolLM2's
  projections of a step: int8 7.6 ms against 15.1, int4 6.4 against 7.8). Built with AVX-512 only (elsewhere
  torch's kernels run); a row's result is the same in any batch (tested).
- a decoder layer's elementwise steps (models/llama.py): RMSNorm with the residual add before it, RoPE, and
  silu(gate) * up, one call each where the torch formulas are 7, 6 and 4 calls, whose dispatch was about 40% of
  an int4 token's time at batch 1 (with the attention above: 11.2-11.8 -> 7.9-8.2 ms a token, faster than
  llama.cpp's 10.2-11.5 in the same runs; docs/measurements.md). Each rounds where
  transformers' formula rounds; RoPE is bit for bit the same, the norm's sum of squares and silu's exp differ in
  the last bits (tested; greedy tokens the same with and without).

WATCHLLM_CPU_EXTENSIONS=0 keeps to the torch calls; a failed build warns once and does too.
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

from .cache import cache_dir
from .quant import quantize_uint8

SOURCE = Path(__file__).resolve().parent / "csrc" / "cpu_kernels.cpp"
W8A8_ZERO_POINT = 128  # the zero point fbgemm is given; each row's own is corrected after (models/linear.py)
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


def _build_key() -> str:
    """What the machine code depends on: the source, the CPU's flags (it is built for this CPU), Python and torch.
    Each its own folder, so two checkouts with different sources never rebuild over each other."""
    flags = platform.processor()
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith("flags")), flags)
    except OSError:
        pass
    key = f"{SOURCE.read_bytes()!r}|{flags}|{sys.version_info[:2]}|{torch.__version__}"
    return hashlib.sha256(key.encode()).hexdigest()[:12]


@cache
def _build():
    if os.environ.get("WATCHLLM_CPU_EXTENSIONS", "1") == "0":
        return None
    name = f"watchllm_cpu_kernels_{_build_key()}"
    build = cache_dir() / "extensions" / name
    try:
        from torch.utils.cpp_extension import load
        build.mkdir(parents=True, exist_ok=True)
        # -fopenmp: at::parallel_for runs serially without it; -ffp-contract=off: no fused multiply-adds, so that
        # the w8a8 helpers round as the torch calls do
        return load(name, [str(SOURCE)], build_directory=str(build), extra_ldflags=["-fopenmp"],
                    extra_cflags=["-O3", "-march=native", "-ffp-contract=off", "-fopenmp"], verbose=False)
    except Exception as exc:  # no compiler, no ninja, a read-only cache...: the torch calls instead
        last = str(exc).strip().splitlines()[-1:] or [type(exc).__name__]
        warnings.warn(f"the engine's C++ CPU kernels could not be built ({last[0]}); using torch calls instead, "
                      f"which give the same results more slowly", RuntimeWarning, stacklevel=3)
        return None


def compiled():
    """The compiled module, or None (WATCHLLM_CPU_EXTENSIONS=0, or the build failed: warned once)."""
    with _build_lock:  # two engines loading at once build it once
        return _build()


def row_helpers():
    """w8a8's (quantize_rows, dequantize_rows, name): the C++ pair when it builds here, else the Python one."""
    ext = compiled()
    if ext is None:
        return quantize_rows_python, dequantize_rows_python, "torch calls"
    return ext.quantize_rows, ext.dequantize_rows, "C++"
