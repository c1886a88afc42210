"""How a model's projections are stored: the quantization schemes, their settings, and the checks on them. Pure data:
which kernel runs a format is quant/kernels.py's choice, its arithmetic quant/numerics.py's."""
from __future__ import annotations

from dataclasses import dataclass

QUANTIZATION_SCHEMES = ("int8", "int4", "w8a8")  # quant/linear.py
INT4_GROUP_SIZES = (32, 64, 128, 256)  # the group sizes torch's int4 kernel accepts


def check_scheme(quantization, group_size, smoothing: bool, gptq: bool, lm_head: bool | str = True) -> None:
    """ValueError naming the problem when a configuration's quantization fields cannot go together."""
    if quantization is not None and quantization not in QUANTIZATION_SCHEMES:
        raise ValueError(f"quantization must be None or one of {QUANTIZATION_SCHEMES}, got {quantization!r}")
    if not isinstance(lm_head, bool) and lm_head not in QUANTIZATION_SCHEMES:
        raise ValueError(f"quantize_lm_head must be True (as the projections), False (the model's dtype) or one "
                         f"of {QUANTIZATION_SCHEMES} (the LM head's own scheme), got {lm_head!r}")
    if quantization is None and (smoothing or gptq):
        raise ValueError("quantization_smoothing and quantization_gptq calibrate how weights are quantized: they "
                         "need a quantization scheme (int8, int4 or w8a8); with quantization=None turn them off")
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size not in INT4_GROUP_SIZES:
        raise ValueError(f"quantization_group_size must be one of {INT4_GROUP_SIZES} (what the int4 kernel "
                         f"accepts), got {group_size!r}")


@dataclass(frozen=True)
class WeightFormat:
    quantization: str | None = None
    group_size: int = 32  # int4 only (EngineConfig.quantization_group_size's default)
    # the LM head: True as the projections, False in the model's dtype, or a scheme of its own (head_scheme)
    lm_head: bool | str = True
    smooth: bool = False  # inputs rescaled per channel before rounding (quant/calibrate.py)
    gptq: bool = False  # rounded by GPTQ over calibration inputs (quant/numerics.py)

    @classmethod
    def of(cls, config) -> WeightFormat:
        """The format an EngineConfig asks for, fields that do not apply at their defaults so equal formats compare
        equal."""
        if config.quantization is None:
            return cls()
        group = config.quantization_group_size if config.quantization == "int4" else cls.group_size
        head = config.quantize_lm_head
        if head == config.quantization:  # the same format, however it was said
            head = True
        return cls(config.quantization, group, head, config.quantization_smoothing, config.quantization_gptq)

    @property
    def head_scheme(self) -> str | None:
        """The LM head's scheme: None keeps it in the model's dtype."""
        if self.quantization is None or self.lm_head is False:
            return None
        return self.quantization if self.lm_head is True else self.lm_head

    def describe(self) -> str:
        """In words, as the engine's precision says it: "int4 weights (groups of 32) but the LM head, GPTQ",
        "int4 weights (groups of 32), the LM head int8"."""
        if self.quantization is None:
            return "unquantized"
        group = f" (groups of {self.group_size})" if self.quantization == "int4" else ""
        head = {self.quantization: "", None: " but the LM head"}.get(self.head_scheme,
                                                                     f", the LM head {self.head_scheme}")
        return (f"{self.quantization} weights{group}{head}"
                + (", smoothed" if self.smooth else "") + (", GPTQ" if self.gptq else ""))

    @property
    def calibrated(self) -> bool:
        """Whether quantizing needs calibration inputs (quant/calibrate.py)."""
        return self.quantization is not None and (self.smooth or self.gptq)


UNQUANTIZED = WeightFormat()
