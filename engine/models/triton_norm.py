"""RMSNorm as one Triton kernel for the triton backend: transformers' is eight small kernels, and at batch 1 a GPU
step is bound by launches. Its reduction order differs from torch's (agreeing to a rounding step), so the sdpa
backend keeps transformers' formula. Row r is head r % heads of token r // heads (Qwen3's strided q/k heads).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

ROWS = 16  # rows per program: few programs for the interpreter, enough work per program on a GPU


@triton.jit
def _rms_norm(x_ptr, w_ptr, out_ptr, num_rows, heads, w_rows, stride_t, stride_h, eps,
              N: tl.constexpr, BLOCK: tl.constexpr, ROWS: tl.constexpr):
    r = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    c = tl.arange(0, BLOCK)
    row_ok = r < num_rows
    mask = row_ok[:, None] & (c[None, :] < N)
    t, h = r // heads, r % heads
    x = tl.load(x_ptr + (t * stride_t + h * stride_h)[:, None] + c[None, :], mask=mask, other=0.0)
    xf = x.to(tl.float32)
    variance = tl.sum(xf * xf, axis=1) / N
    normed = (xf * tl.rsqrt(variance + eps)[:, None]).to(x.dtype)
    w = tl.load(w_ptr + (h % w_rows)[:, None] * N + c[None, :], mask=mask, other=0.0)
    out = w.to(tl.float32) * normed.to(tl.float32)
    tl.store(out_ptr + r[:, None] * N + c[None, :], out.to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x: [T, N] or [T, heads, N] (each row contiguous); weight: [N] or [heads, N]; the result contiguous, in the
    promotion of the two dtypes."""
    n = x.shape[-1]
    if x.stride(-1) != 1:
        x = x.contiguous()
    heads = x.shape[1] if x.dim() == 3 else 1
    stride_h = x.stride(1) if x.dim() == 3 else 0
    out = torch.empty(x.shape, dtype=torch.promote_types(weight.dtype, x.dtype), device=x.device)
    rows = x.shape[0] * heads
    if rows:
        w_rows = weight.shape[0] if weight.dim() == 2 else 1
        _rms_norm[(triton.cdiv(rows, ROWS),)](x, weight.contiguous(), out, rows, heads, w_rows, x.stride(0), stride_h,
                                              eps, N=n, BLOCK=triton.next_power_of_2(n), ROWS=ROWS)
    return out
