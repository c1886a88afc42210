"""A projection's weight, stored once at load for the kernel choose_kernel picks: `Linear(w)(x)` is x @ w.T, or a
quantized sibling (make_projection). Each gives a row the same result whatever else shares the call, so a request's
tokens do not depend on its batch (why oneDNN's linear, not MKL's `x @ W`, without the C++ kernels).
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch

from .. import cpu_kernels
from .format import INT4_GROUP_SIZES, WeightFormat
from .kernels import W8A8_OP, W8A8_ZERO_POINT, choose_kernel
from .numerics import quantize_int4, quantize_int8

INT4_PACK_ROWS = 16  # torch's CPU int4 kernel packs output features in tiles of 16
INT4_VNNI_BLOCK = 16  # int4_matmul_vnni's outputs a block: one int32 lane each in its dot products
INT4_INNER_K_TILES = (8, 4, 2)  # CUDA's int4 packing: the largest tiling (16 input features each) that divides K


class _Quantized:
    scheme: str

    def __init__(self, weight: torch.Tensor) -> None:
        self.out_features, self.in_features = weight.shape
        self.choice = choose_kernel(self.scheme, weight.device, weight.dtype, in_features=self.in_features)
        self.kernel = self.choice.kernel.rsplit(".", 1)[-1]
        self.dtype, self.device = weight.dtype, weight.device  # the model's: what comes in and goes out

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.raw(x).to(x.dtype)

    def raw(self, x: torch.Tensor) -> torch.Tensor:
        """x @ W.T, left in the kernel's own dtype when x is fp32, for a caller whose next operation widens it
        exactly anyway (a cast saved per projection); otherwise in x's dtype."""
        if x.shape[0] == 0:
            return x.new_empty(0, self.out_features)
        y = self._matmul(x)
        # a no-op cast still costs its dispatch (docs/measurements.md, "The engine's own weight-only kernels")
        return y if x.dtype == torch.float32 or y.dtype == x.dtype else y.to(x.dtype)

    def weight_tensors(self) -> list[torch.Tensor]:
        """The tensors each call streams (engine/huge_pages.py places them)."""
        return []

    def cpp_plan(self) -> CppPlan | None:
        """How the C++ DecoderStack (models/llama.py) runs this projection itself, or None where it cannot."""
        return None

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.in_features} -> {self.out_features}, {self.scheme}, {self.kernel})"


def _as(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return x if x.dtype == dtype else x.to(dtype)


def _bytes(*tensors: torch.Tensor) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


@dataclass(frozen=True)
class CppPlan:
    """A projection as cpu_kernels.cpp's DecoderStack calls its kernel (kind: CPP_DENSE, CPP_INT8_VNNI, ...)."""
    kind: int
    packed: torch.Tensor
    scale: torch.Tensor
    group: int = 0


CPP_DENSE, CPP_INT8_VNNI, CPP_INT4_VNNI = 0, 1, 2  # cpu_kernels.cpp's ProjectionKind


INT8_K_MULTIPLE = 16  # both CPU kernels' step over input features (torch's returns garbage off it: measured)


class _WeightOnly(_Quantized):
    """int8 and int4: the engine's own C++ kernel where choose_kernel picks it, else torch's, which is fast only with
    bf16 activations. One choice per machine, whatever the rows: a row's result never depends on its batch."""

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__(weight)
        own = self.choice.kernel.split(" ")[0]  # "int4_matmul_vnni (C++)": the module's int4_matmul_vnni
        self._own = getattr(cpu_kernels.compiled(), own) if self.choice.own else None
        self.activation_dtype = self.dtype if self.choice.own else self.choice.activations
        self.input_dtype = self.activation_dtype

    @property
    def nbytes(self) -> int:
        return _bytes(*self.weight_tensors())


class Int8Linear(_WeightOnly):
    """Weight-only int8, one scale per output channel: x @ (q * scale).T. int8_matmul_vnni keeps q in
    pack_int8_vnni's layout; torch's _weight_int8pack_mm wants the scales in bf16, like its activations."""
    scheme = "int8"

    def __init__(self, weight: torch.Tensor, hessian: torch.Tensor | None = None) -> None:
        super().__init__(weight)
        if self.device.type == "cpu" and self.in_features % INT8_K_MULTIPLE:
            raise ValueError(f"int8 on CPU needs input features in multiples of {INT8_K_MULTIPLE} (its kernels step "
                             f"over them 16 at a time; torch's returns garbage otherwise), got {self.in_features}")
        self.vnni = self.choice.kernel.startswith("int8_matmul_vnni")
        scale_dtype = None if self._own is not None else self.activation_dtype
        q, scale = quantize_int8(weight, scale_dtype=scale_dtype, hessian=hessian)
        if self.vnni:
            self.packed, self.padded_scales = pack_int8_vnni(q, scale)
            self._qweight = self._scales = None
        else:
            self._qweight, self._scales = q, (scale if scale_dtype is None else scale.to(scale_dtype))

    @property
    def qweight(self) -> torch.Tensor:
        return unpack_int8_vnni(self.packed, self.out_features) if self.vnni else self._qweight

    @property
    def scales(self) -> torch.Tensor:
        return self.padded_scales[:self.out_features] if self.vnni else self._scales

    def weight_tensors(self) -> list[torch.Tensor]:
        return [self.packed, self.padded_scales] if self.vnni else [self._qweight, self._scales]

    def cpp_plan(self) -> CppPlan | None:
        return CppPlan(CPP_INT8_VNNI, self.packed, self.padded_scales) if self.vnni else None

    def _matmul(self, x: torch.Tensor) -> torch.Tensor:
        if self.vnni:
            return self._own(x.contiguous(), self.packed, self.padded_scales, self.out_features)
        if self._own is not None:
            return self._own(x.contiguous(), self.qweight, self.scales)
        return torch._weight_int8pack_mm(_as(x, self.activation_dtype), self.qweight, self.scales)


def pack_int4_vnni(q: torch.Tensor, scale: torch.Tensor, mid: torch.Tensor) -> torch.Tensor:
    """q [N, K] levels (uint8, 0-15), scale and mid [N, K / g] -> int4_matmul_vnni's bytes [ceil(N / 16) * 16,
    K / 2 + 4 * K / g]: N padded with zero weights to blocks of 16 outputs; per block and group of g features, the 16
    outputs' (scale, mid) bf16 pairs in one 64-byte line, then per run of 32 features 4 vectors of 64 bytes, vector z
    holding for output j features 4z..4z+3 in the low nibbles of bytes 4j..4j+3 and 16+4z..16+4z+3 in the high ones
    (the order of its dot products). Each block one stream: the pairs read where their weights are."""
    n, k = q.shape
    blocks = -(-n // INT4_VNNI_BLOCK)
    pad = blocks * INT4_VNNI_BLOCK - n
    if pad:
        q, scale, mid = (torch.nn.functional.pad(t, (0, 0, 0, pad)) for t in (q, scale, mid))
    runs = q.reshape(blocks, INT4_VNNI_BLOCK, k // 32, 2, 4, 4)  # [block, output, run, half, z, 4 features]
    nibbles = runs[:, :, :, 0] | runs[:, :, :, 1] << 4  # features 0-15 of a run low, 16-31 high
    groups = scale.shape[1]
    runs_of = nibbles.permute(0, 2, 3, 1, 4).reshape(blocks, groups, -1)  # [block, group, its runs' bytes]
    pairs = torch.stack([scale, mid], dim=-1).to(torch.bfloat16).reshape(blocks, INT4_VNNI_BLOCK, groups, 2)
    lines = pairs.permute(0, 2, 1, 3).contiguous().view(torch.uint8).reshape(blocks, groups, 64)
    return torch.cat([lines, runs_of], dim=-1).reshape(blocks * INT4_VNNI_BLOCK, -1)


def pack_int8_vnni(q: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q [N, K] int8, scale [N] -> int8_matmul_vnni's (packed, scale): N padded with zero weights and scales to blocks
    of 16 outputs; packed [ceil(N / 16) * 16, K] bytes q + 128 (the dot products take their first operand unsigned),
    per block and run of 32 features 8 vectors of 64 bytes, vector z holding features 4z..4z+3 of output j in bytes
    4j..4j+3."""
    n, k = q.shape
    blocks = -(-n // INT4_VNNI_BLOCK)
    pad = blocks * INT4_VNNI_BLOCK - n
    shifted = (q.to(torch.int16) + 128).to(torch.uint8)
    if pad:
        shifted = torch.nn.functional.pad(shifted, (0, 0, 0, pad), value=128)
        scale = torch.nn.functional.pad(scale, (0, pad))
    per_block = shifted.reshape(blocks, INT4_VNNI_BLOCK, k // 32, 8, 4).permute(0, 2, 3, 1, 4)  # [block, run, z, j, 4]
    return per_block.reshape(blocks * INT4_VNNI_BLOCK, k), scale.float().contiguous()


def unpack_int8_vnni(packed: torch.Tensor, n: int) -> torch.Tensor:
    """pack_int8_vnni's bytes back to q [N, K] int8."""
    rows, k = packed.shape
    per_block = packed.reshape(rows // INT4_VNNI_BLOCK, k // 32, 8, INT4_VNNI_BLOCK, 4)
    shifted = per_block.permute(0, 3, 1, 2, 4).reshape(rows, k)[:n]
    return (shifted.to(torch.int16) - 128).to(torch.int8)


class Int4Linear(_WeightOnly):
    """Weight-only int4 in groups of `group_size` input features, two values per byte, each group's scale and mid in
    bf16: for int4_matmul_vnni in pack_int4_vnni's layout; for int4_matmul (runs of 32 features: c in a low nibble,
    c + 16 high) pairs [N, K / g, 2]; for torch's, packed by torch, pairs [K / g, N, 2]."""
    scheme = "int4"

    def __init__(self, weight: torch.Tensor, group_size: int, hessian: torch.Tensor | None = None) -> None:
        super().__init__(weight)
        if group_size not in INT4_GROUP_SIZES:
            raise ValueError(f"quantization_group_size must be one of {INT4_GROUP_SIZES} for int4, got {group_size}")
        if self.in_features % group_size:
            raise ValueError(f"quantization_group_size={group_size} does not divide its {self.in_features} "
                             f"input features")
        self.group_size = group_size
        q, scale, mid = quantize_int4(weight, group_size, torch.bfloat16, hessian)
        self.vnni = self.choice.kernel.startswith("int4_matmul_vnni")
        if self.vnni:
            self.packed = pack_int4_vnni(q, scale, mid)
            self.scales_and_zeros = self.packed.new_empty(0)  # in packed, beside their weights
            return
        if self._own is not None:
            runs = q.reshape(self.out_features, -1, 2, 16)
            self.packed = (runs[:, :, 0] | runs[:, :, 1] << 4).reshape(self.out_features, -1).contiguous()
            self.scales_and_zeros = torch.stack([scale, mid], dim=-1).to(torch.bfloat16).contiguous()
            return
        if self.out_features % INT4_PACK_ROWS:
            raise ValueError(f"int4 with {self.kernel} needs output features in multiples of {INT4_PACK_ROWS}, "
                             f"got {self.out_features}")
        if self.device.type == "cuda":  # two values per byte, the even feature in the high nibble, then tiled
            tiles = next((t for t in INT4_INNER_K_TILES if self.in_features % (16 * t) == 0), None)
            if tiles is None:
                raise ValueError(f"int4 on CUDA needs input features in multiples of 32, got {self.in_features}")
            self.packed = torch._convert_weight_to_int4pack((q[:, ::2] << 4 | q[:, 1::2]).contiguous(), tiles)
        else:
            self.packed = torch._convert_weight_to_int4pack_for_cpu(q.to(torch.int32), 1)
        # the kernel computes (q - 8) * scale + zero, its "zero" being our mid
        self.scales_and_zeros = torch.stack([scale.t(), mid.t()], dim=-1).to(self.activation_dtype).contiguous()
        self._kernel = getattr(torch, self.kernel)  # looked up once, not per call

    def weight_tensors(self) -> list[torch.Tensor]:
        return [t for t in (self.packed, self.scales_and_zeros) if t.numel()]

    def cpp_plan(self) -> CppPlan | None:
        return CppPlan(CPP_INT4_VNNI, self.packed, self.scales_and_zeros, self.group_size) if self.vnni else None

    def _matmul(self, x: torch.Tensor) -> torch.Tensor:
        if self.vnni:
            return self._own(x.contiguous(), self.packed, self.group_size, self.out_features)
        if self._own is not None:
            return self._own(x.contiguous(), self.packed, self.scales_and_zeros, self.group_size)
        return self._kernel(_as(x, self.activation_dtype), self.packed, self.group_size, self.scales_and_zeros)


class W8A8Linear(_Quantized):
    """int8 weights per output channel (7-bit where fbgemm's sums need it) and uint8 activations per token,
    multiplied in exact integer sums by fbgemm: y = (x_q - zero) @ w_q.T * w_scale * x_scale, the same in any batch.
    fbgemm takes one zero point for the whole input, so it is given 128 and each row's own is corrected after:
    y -= (zero - 128) * w_scale * sum(w_q) per output channel."""
    scheme = "w8a8"
    input_dtype = torch.float32  # each row is quantized from fp32

    def __init__(self, weight: torch.Tensor, hessian: torch.Tensor | None = None) -> None:
        super().__init__(weight)
        q, scales = quantize_int8(weight, self.choice.weight_max, hessian=hessian)
        zeros = torch.zeros(self.out_features, dtype=torch.long)
        with warnings.catch_warnings():  # torch deprecates its quantized tensors; fbgemm's kernels still ship
            warnings.simplefilter("ignore", UserWarning)
            qweight = torch._make_per_channel_quantized_tensor(q, scales.double(), zeros, 0)
            self.packed = torch.ops.quantized.linear_prepack(qweight, None)  # fbgemm's packed layout
        stored_q, stored_scales = self.int8_weight()
        self.zero_point_unit = stored_q.double().sum(1).mul_(stored_scales.double()).float()
        self._quantize_rows, self._dequantize_rows, _ = cpu_kernels.row_helpers()
        # the op's one overload, called directly: the packet's Python dispatch checks cost time on every call
        # (docs/measurements.md, "The engine's own weight-only kernels")
        self._kernel = getattr(torch.ops.quantized, W8A8_OP).default

    def int8_weight(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(q [N, K] int8, scales [N]), read back from fbgemm's layout."""
        qweight, _ = torch.ops.quantized.linear_unpack(self.packed)
        return qweight.int_repr(), qweight.q_per_channel_scales().float()

    @property
    def nbytes(self) -> int:
        # int8 weights, plus fbgemm's scale and column offset and the zero-point correction per output channel
        return self.out_features * (self.in_features + 12)

    def _matmul(self, x: torch.Tensor) -> torch.Tensor:
        xq, x_scale, shifted = self._quantize_rows(_as(x, torch.float32).contiguous())
        # the kernel quantizes its input with scale 1 and zero point 128: integers in, so that step is exact
        y = self._kernel(xq, 1.0, W8A8_ZERO_POINT, self.packed)
        return _as(self._dequantize_rows(y, x_scale, shifted, self.zero_point_unit), x.dtype)


class Linear:
    scheme = None

    def __init__(self, weight: torch.Tensor) -> None:
        """weight: [out_features, in_features], as checkpoints store it."""
        self.out_features, self.in_features = weight.shape
        self.nbytes = weight.numel() * weight.element_size()
        self.dtype, self.device = weight.dtype, weight.device
        self.packed = self.weight_t = self._own = None
        self.choice = choose_kernel(None, weight.device, weight.dtype)
        if self.choice.own:
            ext = cpu_kernels.compiled()
            self.packed, self._own = ext.pack_dense(weight.contiguous()), ext.dense_matmul
        elif self.choice.kernel == "oneDNN":
            self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), None)
        else:
            self.weight_t = weight.t().contiguous()  # [in, out]: x @ W reads it row by row

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self._own is not None:
            rows = x.reshape(-1, self.in_features)
            y = self._own(rows if rows.stride(-1) == 1 else rows.contiguous(), self.packed, self.out_features)
            return y if x.dim() == 2 else y.view(*x.shape[:-1], self.out_features)
        if self.packed is not None and x.shape[0] > 0:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, None, "none", [], "")
        if self.packed is not None:  # no rows (nothing to sample this step)
            return x.new_empty(0, self.out_features)
        return x @ self.weight_t

    raw = __call__  # already in the model's dtype (see _Quantized.raw)

    def cpp_plan(self) -> CppPlan | None:
        """How the C++ DecoderStack runs it (dense_matmul), or None where oneDNN or torch does."""
        return None if self._own is None else CppPlan(CPP_DENSE, self.packed, self.packed.new_empty(0))

    def weight_tensors(self) -> list[torch.Tensor]:
        """The tensors each call streams (oneDNN's opaque one is not among them)."""
        return [t for t in (self.packed, self.weight_t) if t is not None]

    @property
    def input_dtype(self) -> torch.dtype:
        return self.dtype

    @property
    def kernel(self) -> str:
        return self.choice.kernel

    def __repr__(self) -> str:
        return f"Linear({self.in_features} -> {self.out_features}, {self.dtype}, {self.kernel})"


QUANTIZED_TYPES = (Int8Linear, Int4Linear, W8A8Linear)
Projection = Linear | Int8Linear | Int4Linear | W8A8Linear
PROJECTION_TYPES = (Linear, *QUANTIZED_TYPES)


def make_projection(weight_format: WeightFormat, weight: torch.Tensor, name: str, is_lm_head: bool = False,
                    hessian: torch.Tensor | None = None) -> Projection:
    """The projection for weight [out, in] stored as weight_format; name says which layer a refusal is about."""
    scheme = weight_format.head_scheme if is_lm_head else weight_format.quantization
    if scheme is None:
        return Linear(weight)
    try:
        if scheme == "int4":
            return Int4Linear(weight, weight_format.group_size, hessian)
        choose_kernel(scheme, weight.device, weight.dtype)  # an unknown scheme is refused here
        return {"int8": Int8Linear, "w8a8": W8A8Linear}[scheme](weight, hessian)
    except ValueError as exc:
        raise ValueError(f"{name}: {exc}") from None
