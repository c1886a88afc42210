"""Quantization: the arithmetic (numerics.py, the only part exported here), the formats (format.py), which kernel
runs them (kernels.py), the projections (linear.py), calibration (calibrate.py), and speed against fp32 (speed.py)."""
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
