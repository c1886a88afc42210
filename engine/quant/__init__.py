"""Quantization, in one package: the arithmetic (numerics.py), the schemes and their settings (format.py), which
kernel runs them here and why (kernels.py), the quantized projections (linear.py), calibration (calibrate.py) and
whether a scheme is faster than fp32 on this CPU at all (speed.py). The package itself exports the arithmetic only,
which the attention and the C++ kernels' Python fallbacks use."""
from .numerics import (
    INT4_LEVELS,
    INT4_MID,
    INT8_MAX,
    SCALE_DTYPE,
    UINT8_MAX,
    dequantize_int4,
    dequantize_int8,
    dequantize_uint8,
    gptq,
    quantize_int4,
    quantize_int8,
    quantize_uint8,
)

__all__ = ["INT4_LEVELS", "INT4_MID", "INT8_MAX", "SCALE_DTYPE", "UINT8_MAX", "dequantize_int4", "dequantize_int8",
           "dequantize_uint8", "gptq", "quantize_int4", "quantize_int8", "quantize_uint8"]
