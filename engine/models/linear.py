"""A projection's weight, stored once at load for the fastest kernel this machine has: `Linear(w)(x)` is x @ w.T,
or one of its quantized siblings (engine/quant/linear.py) when the model's weight format asks for one. Which kernel
runs is engine/quant/kernels.py's choose_kernel, asked by every projection here.

On CPU in float32, oneDNN's linear over a weight reordered once at load beats MKL's `x @ W` for the few rows a
decode batch or a speculative verify has (the 30 layers' projections plus the LM head of SmolLM2-135M, min of 7,
same process: 2 rows 56 ms vs 79, 5 rows 69 vs 158, 9 rows 77 vs 127, 16 rows 85 vs 159, 32 rows 106 vs 187;
one row 55 vs 52), and each row's result does not depend on how many rows share the call (MKL's does for
one or two rows), so a request's tokens are the same whoever it is batched with. So in bf16 on a CPU with bf16
instructions. Elsewhere (CUDA, bf16 without them, a torch without oneDNN) it is `x @ W` over the weight stored
transposed. Quantized formats are chosen by measurement (docs/measurements.md, `python -m engine.bench kernels`;
quant/speed.py says, per machine, whether one is faster than fp32 here at all).
"""
from __future__ import annotations

import torch

from ..quant.format import WeightFormat
from ..quant.kernels import choose_kernel
from ..quant.linear import QUANTIZED_TYPES, Int4Linear, Int8Linear, W8A8Linear


class Linear:
    scheme = None

    def __init__(self, weight: torch.Tensor) -> None:
        """weight: [out_features, in_features], as checkpoints store it."""
        self.out_features, self.in_features = weight.shape
        self.nbytes = weight.numel() * weight.element_size()
        self.dtype, self.device = weight.dtype, weight.device
        self.packed = self.weight_t = None
        self.choice = choose_kernel(None, weight.device, weight.dtype)
        if self.choice.kernel == "oneDNN":
            self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), None)
        else:
            self.weight_t = weight.t().contiguous()  # [in, out]: x @ W reads it row by row

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is not None and x.shape[0] > 0:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, None, "none", [], "")
        if self.packed is not None:  # no rows (nothing to sample this step)
            return x.new_empty(0, self.out_features)
        return x @ self.weight_t

    raw = __call__  # already in the model's dtype (see _Quantized.raw)

    @property
    def input_dtype(self) -> torch.dtype:
        """The activations' dtype the kernel computes in (a caller may hand them over in it already)."""
        return self.dtype

    @property
    def kernel(self) -> str:
        return self.choice.kernel

    def __repr__(self) -> str:
        return f"Linear({self.in_features} -> {self.out_features}, {self.dtype}, {self.kernel})"


Projection = Linear | Int8Linear | Int4Linear | W8A8Linear
PROJECTION_TYPES = (Linear, *QUANTIZED_TYPES)


def make_projection(weight_format: WeightFormat, weight: torch.Tensor, name: str, is_lm_head: bool = False,
                    hessian: torch.Tensor | None = None) -> Projection:
    """The projection for weight [out, in] stored as weight_format; name says which layer a refusal is about;
    hessian: X.T @ X over its calibration inputs, for GPTQ's rounding."""
    scheme = weight_format.quantization
    if scheme is None or (is_lm_head and not weight_format.lm_head):
        return Linear(weight)
    try:
        if scheme == "int4":
            return Int4Linear(weight, weight_format.group_size, hessian)
        choose_kernel(scheme, weight.device, weight.dtype)  # an unknown scheme is refused here
        return {"int8": Int8Linear, "w8a8": W8A8Linear}[scheme](weight, hessian)
    except ValueError as exc:
        raise ValueError(f"{name}: {exc}") from None
