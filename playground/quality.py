"""What each precision should cost in quality: the project's quality goals, and which quality row each applies to.

The goals are targets, not results: a row's own numbers come from `engine.measure.quality` (measured on
this machine from the page, or shipped). A row whose spec changes more than one of these (int8 weights with an
int8 KV cache, bf16 with int4) matches none of them and has no goal.
"""
from __future__ import annotations

from dataclasses import dataclass

from engine.measure import resolve_spec


@dataclass(frozen=True)
class QualityGoal:
    what: str  # what the goal is for, in words
    min_top1_agreement: float  # with fp32's most likely next token
    max_perplexity_change: float | None = None  # relative to fp32's perplexity; None: no perplexity goal

    def describe(self) -> str:
        ppl = "" if self.max_perplexity_change is None else f", ppl ≤ {self.max_perplexity_change:+.0%}"
        return f"top-1 ≥ {self.min_top1_agreement:.0%}{ppl}"

    def verdict(self, row) -> str:
        """Met, or which part falls short (a QualityRow: top1_agreement, perplexity_change)."""
        short = []
        if row.top1_agreement < self.min_top1_agreement:
            short.append("top-1")
        if self.max_perplexity_change is not None and row.perplexity_change > self.max_perplexity_change:
            short.append("ppl")
        return f"{self.describe()}: " + ("met" if not short else f"{' and '.join(short)} short")


# The project's quality goals, per weight scheme (any group size, LM head quantized or not) and for the KV cache.
WEIGHT_GOALS = {"int8": QualityGoal("int8 weights", 0.97, 0.02), "w8a8": QualityGoal("w8a8", 0.95, 0.04),
                "int4": QualityGoal("int4 weights", 0.90, 0.10)}
KV_GOAL = QualityGoal("int8 KV cache", 0.98)


def goal_for(spec: str) -> QualityGoal | None:
    """The goal of the one precision change a quality spec makes, or None (several, or one without a goal)."""
    try:
        fields = resolve_spec(spec)
    except ValueError:  # a spec this version cannot read (a shipped file from another version): no goal
        return None
    scheme, kv, dtype = fields.get("quantization"), fields.get("kv_cache_dtype", "auto"), fields.get("dtype")
    if dtype not in (None, "float32"):
        return None
    if scheme is not None and kv == "auto":
        return WEIGHT_GOALS.get(scheme)
    if scheme is None and kv == "int8":
        return KV_GOAL
    return None
