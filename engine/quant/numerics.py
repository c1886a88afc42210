"""Quantization arithmetic, in one place: int8 rows (weights per output channel, K/V per token and head), uint8
rows (w8a8's activations per token) and int4 groups. Pure functions over tensors; the kernels that use them live in
quant/linear.py and attention/sdpa.py.

int8 is symmetric: x ~ q * scale, q in [-127, 127], scale = max|x| / 127 over the row, so the error of one element
is at most scale / 2. uint8 is asymmetric: x ~ (q - zero) * scale, q in [0, 255] over the row's [min, max]. int4 is
asymmetric per group of g input features: w ~ (q - 8) * scale + mid, q in [0, 15], scale = (max - min) / 15,
mid = min + 8 * scale, error at most scale / 2.

A weight's q is its nearest level, unless a `hessian` (H = X.T @ X over calibration inputs X of the projection)
is given: then GPTQ's rounding (Frantar et al., 2022) picks them column by column, each column's rounding error
pushed onto the columns not yet rounded in proportion to how the inputs correlate (through H's inverse), so the
projection's output over such inputs errs less though every weight still sits on the same grid with the same
scales.
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
    """Symmetric over the last dim into [-qmax, qmax] (127: int8; less for a kernel that needs headroom):
    (q int8 like x, scale fp32 of shape x.shape[:-1]). scale_dtype: the dtype a kernel keeps the scales in; they
    are rounded to it first and q is chosen against the rounded scale, so the error stays within half a step."""
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
    """Asymmetric over the last dim into [0, 255], for activations (w8a8's, per token): x ~ (q - zero) * scale, the
    row's [min, max] (widened to take in 0) split in 255 steps, zero the integer level 0 falls on. A lopsided row
    (after an RMSNorm or SiLU, most are) gets up to twice the levels the symmetric int8 form gives it. The rounded
    zero shifts the grid by at most half a step, so x / scale + zero stays within [-0.5, 255.5] and the error within
    half a step. Returns (q uint8, scale fp32, zero fp32), the last two of shape x.shape[:-1]."""
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
    """Asymmetric int4 per group of group_size along the last dim of w [N, K]: w ~ (q - 8) * scale + mid, q in 0..15,
    the group's range split in 15 steps, mid the weight q = 8 stands for (torch's int4 kernels take that form).
    Returns (q uint8 [N, K], scale fp32 [N, K / group_size], mid fp32 [N, K / group_size]). param_dtype: the dtype a
    kernel keeps scale and mid in; they are rounded to it first and q is chosen against them (a rounded mid would
    otherwise shift every weight of its group the same way)."""
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
    """w [N, K] with every column j replaced by level(column[rows], j, rows), its value on the grid, chosen in order
    so that the error over the calibration inputs, (w_rounded - w) @ X.T, stays small: each column's rounding
    error is carried onto the later columns through the inverse of H = X.T @ X (GPTQ, with its lazy batches).
    Input features no calibration input used (H's diagonal 0) are rounded as they are."""
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
