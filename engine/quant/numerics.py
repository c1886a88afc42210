"""Quantization arithmetic, in one place: int8 rows (weights per output channel, K/V per token and head), uint8
rows (w8a8's activations per token) and int4 groups, each element within half a step of its value.

int8 is symmetric: x ~ q * scale, q in [-127, 127]. uint8 is asymmetric: x ~ (q - zero) * scale, q in [0, 255] over
the row's [min, max]. int4 is asymmetric per group: w ~ (q - 8) * scale + mid, q in [0, 15] (torch's int4 form).

A weight's q is its nearest level, unless a `hessian` (H = X.T @ X over the projection's calibration inputs) is
given: then GPTQ's rounding (Frantar et al., 2022) carries each column's rounding error onto the columns not yet
rounded through H's inverse, so the output over such inputs errs less on the same grid.
"""
from __future__ import annotations

from collections.abc import Callable

import torch

INT8_MAX = 127
UINT8_MAX = 255
INT4_LEVELS = 15
INT4_MID = 8
SCALE_DTYPE = torch.float32  # scales are kept in fp32 (4 bytes per row), whatever the model's dtype
_TINY = 1e-12  # an all-zero row gets this scale instead of dividing by zero (its q are 0 either way)
GPTQ_DAMP = 0.01  # added to H's diagonal, as a fraction of its mean: keeps the inverse well conditioned
GPTQ_BLOCK = 128  # columns rounded before the rest of the matrix is updated at once (GPTQ's lazy batches)
GPTQ_ROWS = 8192  # output channels rounded together (the LM head in chunks that stay in cache)


def quantize_int8(x: torch.Tensor, qmax: int = INT8_MAX, scale_dtype: torch.dtype | None = None,
                  hessian: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(q int8, scale fp32 [x.shape[:-1]]) over the last dim into [-qmax, qmax]. scale_dtype: the dtype a kernel
    keeps the scales in; q is chosen against the scale rounded to it, so the error stays within half a step."""
    xf = x.to(SCALE_DTYPE)
    scale = (xf.abs().amax(dim=-1, keepdim=True) / qmax).clamp_(min=_TINY)
    if scale_dtype is not None:
        scale = scale.to(scale_dtype).to(SCALE_DTYPE)
    if hessian is not None:
        xf = gptq(xf, hessian, lambda col, j, rows: torch.round(col / scale[rows, 0]).clamp_(-qmax, qmax)
                  * scale[rows, 0])
    q = torch.round(xf / scale).clamp_(-qmax, qmax).to(torch.int8)
    return q, scale.squeeze(-1)


def dequantize_int8(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return (q.to(SCALE_DTYPE) * scale.unsqueeze(-1)).to(dtype)


def quantize_uint8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q uint8, scale fp32, zero fp32) over the last dim, the row's [min, max] widened to take in 0: a lopsided row
    (after an RMSNorm or SiLU, most are) gets up to twice the levels the symmetric int8 form gives it."""
    xf = x.to(SCALE_DTYPE)
    low, high = xf.amin(dim=-1, keepdim=True).clamp_(max=0), xf.amax(dim=-1, keepdim=True).clamp_(min=0)
    scale = ((high - low) / UINT8_MAX).clamp_(min=_TINY)
    zero = torch.round(-low / scale)
    q = torch.round(xf / scale).add_(zero).clamp_(0, UINT8_MAX).to(torch.uint8)
    return q, scale.squeeze(-1), zero.squeeze(-1)


def dequantize_uint8(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return ((q.to(SCALE_DTYPE) - zero.unsqueeze(-1)) * scale.unsqueeze(-1)).to(dtype)


def quantize_int4(w: torch.Tensor, group_size: int, param_dtype: torch.dtype | None = None,
                  hessian: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q uint8 [N, K], scale and mid fp32 [N, K / group_size]) of w [N, K]. param_dtype: the dtype a kernel keeps
    scale and mid in; q is chosen against them rounded to it (a rounded mid would shift its whole group)."""
    n, k = w.shape
    if k % group_size:
        raise ValueError(f"group size {group_size} does not divide {k} input features")
    wg = w.to(SCALE_DTYPE).reshape(n, k // group_size, group_size)
    low, high = wg.amin(dim=-1), wg.amax(dim=-1)
    scale = ((high - low) / INT4_LEVELS).clamp_(min=_TINY)
    if param_dtype is not None:
        scale = scale.to(param_dtype).to(SCALE_DTYPE)
    mid = low + INT4_MID * scale
    if param_dtype is not None:
        mid = mid.to(param_dtype).to(SCALE_DTYPE)
    if hessian is not None:  # each group's scale and mid as found above, its levels chosen by GPTQ
        def level(col: torch.Tensor, j: int, rows: slice) -> torch.Tensor:
            sc, md = scale[rows, j // group_size], mid[rows, j // group_size]
            return (torch.round((col - md) / sc + INT4_MID).clamp_(0, INT4_LEVELS) - INT4_MID) * sc + md
        wg = gptq(wg.reshape(n, k), hessian, level).reshape(n, k // group_size, group_size)
    q = torch.round((wg - mid.unsqueeze(-1)) / scale.unsqueeze(-1) + INT4_MID).clamp_(0, INT4_LEVELS)
    return q.to(torch.uint8).reshape(n, k), scale, mid


def dequantize_int4(q: torch.Tensor, scale: torch.Tensor, mid: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    n, k = q.shape
    groups = scale.shape[-1]
    w = (q.reshape(n, groups, k // groups).to(SCALE_DTYPE) - INT4_MID) * scale.unsqueeze(-1) + mid.unsqueeze(-1)
    return w.reshape(n, k).to(dtype)


def gptq(w: torch.Tensor, hessian: torch.Tensor,
         level: Callable[[torch.Tensor, int, slice], torch.Tensor]) -> torch.Tensor:
    """w [N, K] with every column j replaced by level(column[rows], j, rows), its value on the grid, in order, with
    GPTQ's lazy batches. Input features no calibration input used (H's diagonal 0) are rounded as they are."""
    n, k = w.shape
    h = hessian.to(SCALE_DTYPE).clone()
    dead = h.diagonal() == 0
    h[dead, dead] = 1
    h.diagonal().add_(GPTQ_DAMP * h.diagonal().mean())
    hinv = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(h)), upper=True)
    out = torch.empty_like(w, dtype=SCALE_DTYPE)
    # each output channel (row) is rounded on its own: rows in chunks that stay in cache
    for r0 in range(0, n, GPTQ_ROWS):
        rows = slice(r0, min(r0 + GPTQ_ROWS, n))
        wr = w[rows].to(SCALE_DTYPE, copy=True)  # a copy: the caller's weight (a tied embedding, say) is left as it was
        for start in range(0, k, GPTQ_BLOCK):
            end = min(start + GPTQ_BLOCK, k)
            block, hb = wr[:, start:end].clone(), hinv[start:end, start:end]
            errors = torch.empty_like(block)
            for i in range(end - start):
                col = block[:, i]
                rounded = level(col, start + i, rows)
                out[rows, start + i] = rounded
                errors[:, i] = err = (col - rounded) / hb[i, i]
                block[:, i + 1:].addr_(err, hb[i, i + 1:], alpha=-1)
            wr[:, end:] -= errors @ hinv[start:end, end:]
    return out
