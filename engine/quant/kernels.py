"""Which kernel runs a projection: `choose_kernel` alone decides it, and says why; everything else asks it.

On CPU, with the C++ kernels built and AVX-512: the engine's own (dense fp32, bf16 with AVX-512 BF16 or on AMX's
tiles; int8 / int4 on VNNI's integer dot products where K runs in 32s, else widening the weights in registers);
otherwise oneDNN's linear (fp32, bf16 with bf16 instructions), x @ W, or torch's int8 / int4 kernels on bf16
activations. w8a8 is fbgemm's. On CUDA: x @ W, and torch's int4 kernel.
An int8 or w8a8 model on CUDA is refused (measured: slower than bf16 there, NO_KERNEL_BECAUSE), never run
unquantized. Whether a scheme's kernel is faster than fp32 on the CPU at hand is measured, not assumed: quant/speed.py.
"""
from __future__ import annotations

import platform
import warnings
from dataclasses import dataclass
from functools import cache

import torch

from .. import cpu_kernels
from .format import QUANTIZATION_SCHEMES

W8A8_OP = "linear_with_input_q_dq_qweight_dq_output_fp32"
W8A8_ZERO_POINT = cpu_kernels.W8A8_ZERO_POINT
# scheme -> {device type: torch's kernel}; a device not listed has no kernel in this engine
TORCH_KERNELS = {"int8": {"cpu": "torch._weight_int8pack_mm"},
                 "int4": {"cpu": "torch._weight_int4pack_mm_for_cpu", "cuda": "torch._weight_int4pack_mm"},
                 "w8a8": {"cpu": f"torch.ops.quantized.{W8A8_OP}"}}
# why a scheme has no kernel on a device, measured (docs/measurements.md, "On a GPU"), for the refusal to say
NO_KERNEL_BECAUSE = {("int8", "cuda"): "torch's _weight_int8pack_mm was 3-700x slower than bf16 there",
                     ("w8a8", "cuda"): "torch's _int_mm needs more than 16 rows and was 7x slower than bf16 there"}
# the activations' dtype torch's weight-only kernels are fast with (far slower with fp32 ones: docs/measurements.md,
# "The engine's own weight-only kernels")
TORCH_WEIGHT_ONLY_ACTIVATIONS = torch.bfloat16
FBGEMM_ENGINES = ("x86", "fbgemm")
# fbgemm multiplies uint8 activations by int8 weights; on AVX2 it adds pairs of products in int16, which overflows
# when both use 8 bits (measured: 52% error at full range), so weights get 7 bits there
W8A8_WEIGHT_MAX_BY_SUMS = {"int32": 127, "int16 pairs": 63}
VNNI_K_MULTIPLE = 32  # the VNNI kernels' input features: one scale of the activations per run of 32


def _cpuinfo(field: str) -> str:
    """The value of /proc/cpuinfo's first `field` line; "" where there is none to read."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((line.partition(":")[2].strip() for line in f if line.startswith(field)), "")
    except OSError:
        return ""


@cache
def cpu_features() -> frozenset[str]:
    """This CPU's instruction-set flags."""
    return frozenset(_cpuinfo("flags").split())


def cpu_name() -> str:
    return _cpuinfo("model name") or platform.processor() or platform.machine()


def isa(features: frozenset[str]) -> str:
    """The widest vector instructions a CPU has, in the words the page uses."""
    if "amx_tile" in features:
        return "AMX"
    if "avx512f" in features:
        return "AVX-512"
    if "avx2" in features:
        return "AVX2"
    return "no AVX2"


@dataclass(frozen=True)
class KernelChoice:
    """The kernel a projection of `scheme` runs on `device`, and why that one."""
    scheme: str | None  # None: unquantized
    device: str
    kernel: str  # the function called: "int4_matmul (C++)", "torch._weight_int4pack_mm_for_cpu", "oneDNN", ...
    why: str
    activations: torch.dtype | None = None  # what the kernel takes its inputs in (None: the model's dtype)
    own: bool = False  # the engine's C++ kernel
    weight_max: int = 127  # w8a8: the largest |q| its weights may take here
    model_dtype: str = "float32"  # what comes in and goes out

    @property
    def short(self) -> str:
        """The kernel in a few words, as the status line and the tables show it."""
        if self.own:
            return f"C++ {self._isa()} kernel"
        if self.kernel in ("oneDNN", "x @ W"):
            return f"{self.kernel} kernel"
        if self.scheme == "w8a8":
            return "fbgemm kernel" + (", rows in C++" if "C++" in self.kernel else "")
        return "torch kernel"

    def _isa(self) -> str:
        if self.device != "cpu":
            return self.device
        return "AVX-512 VNNI" if "vnni" in self.kernel else "AVX-512"

    def describe(self) -> str:
        """"int4 weights · C++ AVX-512 kernel", "float32 weights · oneDNN kernel"."""
        return f"{self.scheme or self.model_dtype} weights · {self.short}"

    def to_dict(self) -> dict:
        return {"scheme": self.scheme, "device": self.device, "kernel": self.kernel, "short": self.short,
                "why": self.why, "own": self.own, "describe": self.describe()}


def _ships(path: str) -> bool:
    """Whether this torch has the function at a dotted path such as 'torch.ops.quantized.linear_prepack'."""
    obj = torch
    for part in path.split(".")[1:]:
        try:
            obj = getattr(obj, part)
        except (AttributeError, RuntimeError):
            return False
    return True


@cache
def fbgemm_sums() -> str:
    """How this machine's fbgemm adds uint8 x int8 products, found by trying the case that overflows int16 pair sums
    (255 x 127 twice): "int32" if the result is exact (AVX-512 VNNI), else "int16 pairs" (AVX2)."""
    weight = torch.full((2, 64), 127, dtype=torch.int8)
    weight[1] = -127
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        packed = torch.ops.quantized.linear_prepack(torch._make_per_channel_quantized_tensor(
            weight, torch.ones(2, dtype=torch.double), torch.zeros(2, dtype=torch.long), 0), None)
    x = torch.full((1, 64), 255.0 - W8A8_ZERO_POINT)  # uint8 255 once the kernel adds its zero point
    exact = torch.equal(getattr(torch.ops.quantized, W8A8_OP)(x, 1.0, W8A8_ZERO_POINT, packed), x @ weight.float().T)
    return "int32" if exact else "int16 pairs"


def w8a8_weight_max() -> int:
    """The largest |q| w8a8's weights may take on this machine (see W8A8_WEIGHT_MAX_BY_SUMS)."""
    return W8A8_WEIGHT_MAX_BY_SUMS[fbgemm_sums()]


def _dense_amx(ext) -> bool:
    """Whether the built module's bf16 dense_matmul runs on AMX here."""
    return bool(getattr(ext, "dense_amx", lambda: False)())


def _unquantized(device: str, dtype: torch.dtype, features: frozenset[str], ext) -> KernelChoice:
    name = str(dtype).removeprefix("torch.")
    bf16 = dtype == torch.bfloat16
    # with AMX, oneDNN's bf16 linear runs on the tiles, far ahead of AVX-512 BF16's dot products at many rows: the
    # engine's own matmul takes bf16 there only where it runs on the tiles too
    amx = bf16 and "amx_bf16" in features
    if (ext is not None and name in ext.dense_dtypes() and ("avx512_bf16" if bf16 else "avx512f") in features
            and (not amx or _dense_amx(ext))):
        how = "AMX" if amx else "AVX-512 BF16" if bf16 else "AVX-512"
        return KernelChoice(None, device, "dense_matmul (C++)", own=True, model_dtype=name,
                            why=f"{name} with {how} and the engine's C++ kernels built: its own matmul, over a weight "
                                f"packed once at load, ahead of oneDNN's linear at a decode step's rows where measured "
                                f"(docs/measurements.md), and a row's result does not depend on its batch")
    onednn = device == "cpu" and torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn,
                                                                                  "_linear_pointwise")
    if onednn and dtype == torch.float32:
        return KernelChoice(None, device, "oneDNN", model_dtype=name,
                            why="fp32 on CPU: oneDNN's linear over a weight reordered once at load beat MKL's x @ W at "
                                "2-32 rows, and a row's result does not depend on its batch")
    if onednn and dtype == torch.bfloat16 and torch.ops.mkldnn._is_mkldnn_bf16_supported():
        amx = ("; with AMX, oneDNN's runs on its tiles, which this build of the engine's own matmul cannot use here"
               if "amx_bf16" in features else "")
        return KernelChoice(None, device, "oneDNN", model_dtype=name,
                            why=f"bf16 with bf16 instructions: oneDNN beat bf16 x @ W at every size measured{amx}")
    why = ("bf16 without AVX-512 BF16 / AMX: oneDNN refuses it" if onednn and dtype == torch.bfloat16
           else "oneDNN's linear is CPU-only" if device != "cpu" else "this torch has no oneDNN linear")
    return KernelChoice(None, device, "x @ W", why, model_dtype=name)


def choose_kernel(scheme: str | None, device: torch.device | str, dtype: torch.dtype = torch.float32,
                  features: frozenset[str] | None = None, extension=..., in_features: int | None = None
                  ) -> KernelChoice:
    """The kernel for scheme's projections on device, and why; ValueError when this engine has none there (never
    run unquantized instead). extension: the compiled C++ module or None (default: cpu_kernels.compiled());
    in_features: the projection's K where known, which the VNNI kernels need in runs of VNNI_K_MULTIPLE."""
    device, name = torch.device(device).type, str(dtype).removeprefix("torch.")
    if device == "cpu":
        features = cpu_features() if features is None else features
        ext = cpu_kernels.compiled() if extension is ... else extension
    else:
        features, ext = frozenset(), None
    if scheme is None:
        return _unquantized(device, dtype, features, ext)
    if scheme not in TORCH_KERNELS:
        raise ValueError(f"unknown quantization scheme {scheme!r}; one of {', '.join(QUANTIZATION_SCHEMES)}")
    kernel = TORCH_KERNELS[scheme].get(device)
    if kernel is None:
        why = NO_KERNEL_BECAUSE.get((scheme, device))
        raise ValueError(f"quantization={scheme!r} has no kernel on {device} in this engine (it runs on "
                         f"{', '.join(TORCH_KERNELS[scheme])}{': ' + why if why else ''}); it is refused rather than "
                         f"run unquantized")
    if scheme in ("int8", "int4") and device == "cpu":
        vnni = ext is not None and "avx512_vnni" in features and getattr(ext, "vnni_available", lambda: False)()
        off_runs = vnni and in_features is not None and in_features % VNNI_K_MULTIPLE != 0
        if vnni and not off_runs:
            bits = "4" if scheme == "int4" else "8"
            return KernelChoice(scheme, device, f"{scheme}_matmul_vnni (C++)", f"AVX-512 VNNI here and the engine's "
                                f"C++ kernels built: the weights stay {bits}-bit integers, multiplied by the "
                                f"activations made integers in two 8-bit parts (about 15 bits) on VNNI's dot "
                                f"products, several times fewer instructions than widening every weight to a float, "
                                f"which ran out of them before the memory ran out of bytes", own=True,
                                model_dtype=name)
        if ext is not None and "avx512f" in features and ext.weight_only_available():
            off = (f"{in_features} input features, not a multiple of {VNNI_K_MULTIPLE} as the VNNI kernel needs, "
                   f"so " if off_runs else "")
            return KernelChoice(scheme, device, f"{scheme}_matmul (C++)", f"{off}AVX-512 here and the engine's C++ "
                                "kernels built: its own kernel widens the weights in registers and takes the "
                                "activations as they come (torch's takes bf16 only)", own=True, model_dtype=name)
        why = ("the engine's C++ kernels are not built here (make kernels)" if ext is None else
               f"{isa(features)} on this CPU: the engine's own {scheme} kernel is AVX-512 only")
    else:
        why = f"the only {scheme} kernel this engine has on {device}"
    if not _ships(kernel):
        raise ValueError(f"quantization={scheme!r} needs {kernel}, which torch {torch.__version__} does not ship; "
                         f"it is refused rather than run unquantized")
    if scheme == "w8a8":
        if torch.backends.quantized.engine not in FBGEMM_ENGINES:
            raise ValueError(f"quantization='w8a8' needs torch's fbgemm quantized engine (one of {FBGEMM_ENGINES}), "
                             f"but torch.backends.quantized.engine is {torch.backends.quantized.engine!r}")
        rows = "C++" if ext is not None else "torch calls"
        weight_max = w8a8_weight_max()
        bits = "8-bit weights (VNNI: int32 sums)" if weight_max == 127 else "7-bit weights (int16 pair sums)"
        return KernelChoice(scheme, device, f"{W8A8_OP} (rows quantized by {rows})", f"{why}; {bits}",
                            activations=torch.float32, weight_max=weight_max, model_dtype=name)
    return KernelChoice(scheme, device, kernel, why, activations=TORCH_WEIGHT_ONLY_ACTIVATIONS, model_dtype=name)
