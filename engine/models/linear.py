"""A projection's weight, stored once at load for the fastest kernel this machine has: `Linear(w)(x)` is x @ w.T.

On CPU in float32, oneDNN's linear over a weight reordered once at load beats MKL's `x @ W` for the few rows a
decode batch or a speculative verify has (the 30 layers' projections plus the LM head of SmolLM2-135M, min of 7,
same process: 2 rows 56 ms vs 79, 5 rows 69 vs 158, 9 rows 77 vs 127, 16 rows 85 vs 159, 32 rows 106 vs 187;
one row 55 vs 52), and each row's result does not depend on how many rows share the call (MKL's does for
one or two rows), so a request's tokens are the same whoever it is batched with. Elsewhere (CUDA, other dtypes,
a torch without oneDNN) it is `x @ W` over the weight stored transposed.
"""
from __future__ import annotations

import torch


def onednn_available(weight: torch.Tensor) -> bool:
    return (weight.device.type == "cpu" and weight.dtype == torch.float32 and torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_linear_pointwise"))


class Linear:
    def __init__(self, weight: torch.Tensor) -> None:
        """weight: [out_features, in_features], as checkpoints store it."""
        self.out_features, self.in_features = weight.shape
        self.nbytes = weight.numel() * weight.element_size()
        self.dtype, self.device = weight.dtype, weight.device
        self.packed = self.weight_t = None
        if onednn_available(weight):
            self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), None)
        else:
            self.weight_t = weight.t().contiguous()  # [in, out]: x @ W reads it row by row

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is not None and x.shape[0] > 0:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, None, "none", [], "")
        if self.packed is not None:  # no rows (nothing to sample this step)
            return x.new_empty(0, self.out_features)
        return x @ self.weight_t

    def __repr__(self) -> str:
        kernel = "oneDNN" if self.packed is not None else "x @ W"
        return f"Linear({self.in_features} -> {self.out_features}, {self.dtype}, {kernel})"
