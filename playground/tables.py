"""The ablation and comparison tables as the page shows them: named columns, numbers rounded as the bench
reports' markdown (gr.Dataframe's {"headers": [...], "data": [[...]]})."""
from __future__ import annotations

from typing import Any

from engine.measure import Report
from engine.measure.report import COMPARE_HEADERS, format_cell

from .quality import goal_for

ABLATION_HEADERS = ["configuration", "tok/s", "x full engine", "mean TTFT (s)", "mean TPOT (s)", "peak KV blocks",
                    "preemptions", "draft acceptance", "same greedy output", "note"]
CUMULATIVE_HEADERS = ["configuration", "tok/s", "x previous (this feature)", "x naive loop", "mean TTFT (s)",
                      "mean TPOT (s)", "peak KV blocks", "preemptions", "prefix hits (tokens)", "draft acceptance",
                      "same greedy output", "note"]
__all__ = ["ABLATION_HEADERS", "COMPARE_HEADERS", "CUMULATIVE_HEADERS", "ablation_table", "cell", "compare_table",
           "concurrency_table", "cumulative_table", "memory_table", "quality_table"]


def cell(value: Any) -> str:
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float) and value == 0:
        return "0"
    return format_cell(value)


def same_output(row: Any, rows: list) -> str:
    """Whether greedy output equals the baseline's; a row in another precision (quantized) is not expected to,
    and says so instead of reading as a broken invariant."""
    base = getattr(rows[0], "precision", None)
    precision = getattr(row, "precision", None)
    other = precision and base and precision != base
    return cell(row.same_output_as_full) + (f" ({precision}: not expected to match)" if other else "")


def kernel_note(row: Any, rows: list) -> str:
    """A row's error, or, where its projections ran on another kernel than the first row's (a quantized row), that
    kernel and what its scheme measured against fp32 on this CPU: a "faster" precision that is slower here says so."""
    if getattr(row, "error", None):
        return row.error
    kernel, base = getattr(row, "kernel", None), getattr(rows[0], "kernel", None)
    if not kernel or kernel == base:
        return ""
    speed = getattr(row, "speed_vs_fp32", None)
    return kernel + (f": projections {speed}" if speed else "")


def ablation_table(rows: list) -> dict:
    """One line per AblationRow; an empty table (with its headers) before any ablation ran."""
    data = [[r.feature, cell(r.throughput_tok_s), _ratio(r.ratio), cell(r.mean_ttft_s), cell(r.mean_tpot_s),
             cell(r.peak_kv_blocks), cell(r.preemptions), cell(r.acceptance_rate), same_output(r, rows),
             kernel_note(r, rows)]
            for r in rows]
    return {"headers": ABLATION_HEADERS, "data": data}


def cumulative_table(rows: list) -> dict:
    """One line per AblationRow of a cumulative ablation: what each feature added, and the total."""
    data = [[r.feature, cell(r.throughput_tok_s), _ratio(r.step_ratio), _ratio(r.ratio), cell(r.mean_ttft_s),
             cell(r.mean_tpot_s), cell(r.peak_kv_blocks), cell(r.preemptions), cell(r.prefix_hits),
             cell(r.acceptance_rate), same_output(r, rows), kernel_note(r, rows)] for r in rows]
    return {"headers": CUMULATIVE_HEADERS, "data": data}


def concurrency_table(rows: list) -> dict:
    """One line per configuration, two columns per concurrency: tokens/s, and what the feature switched off in
    that line is worth there (the full engine's tokens/s over this line's, as the chart draws it)."""
    levels = sorted({r.concurrency for r in rows if r.concurrency is not None})
    lines: dict[str, list[str]] = {}
    for r in rows:
        line = lines.setdefault(r.feature, [r.feature] + ["-"] * 2 * len(levels))
        i = 1 + 2 * levels.index(r.concurrency)
        line[i] = cell(r.throughput_tok_s) if r.error is None else f"did not run: {r.error}"
        line[i + 1] = "reference" if r.switch is None else _ratio(1 / r.ratio if r.ratio else None)
    headers = ["configuration"] + [h for lv in levels for h in (f"tok/s @ {lv}", f"feature worth @ {lv}")]
    return {"headers": headers, "data": list(lines.values())}


def memory_table(rows: list) -> dict:
    """One line per MemoryRow; a "KV dtype" column only when rows carry one (a quantized KV cache's sweep)."""
    dtype = any(getattr(r, "kv_cache_dtype", None) for r in rows)
    headers = ["KV blocks", "KV MB", "layout", *(["KV dtype"] if dtype else []), "requests at once (peak)",
               "preemptions", "tok/s", "mean TTFT (s)", "memory efficiency", "note"]
    data = [[cell(r.num_kv_blocks), cell(r.kv_cache_mb) if r.kv_cache_mb else "-",
             "paged" if r.paged else "contiguous",
             *([getattr(r, "kv_cache_dtype", None) or "model's dtype"] if dtype else []),
             cell(r.peak_running), cell(r.preemptions), cell(r.throughput_tok_s), cell(r.mean_ttft_s),
             _percent(r.memory_efficiency), r.error or ""]
            for r in rows]
    return {"headers": headers, "data": data}


QUALITY_HEADERS = ["precision", "top-1 agreement with fp32", "mean |logprob diff|", "perplexity", "change vs fp32",
                   "kernel here", "speed vs fp32 here", "goal"]


def quality_table(rows: list) -> dict:
    """One line per QualityRow: how close each precision stays to fp32, and its goal if it has one."""
    data = [[r.precision, _percent(r.top1_agreement, 1), f"{r.mean_abs_logprob_diff:.3f}", f"{r.perplexity:.2f}",
             _signed_percent(r.perplexity_change), r.kernel or "-", r.speed_vs_fp32 or "-",
             goal.verdict(r) if (goal := goal_for(r.spec)) else "-"]
            for r in rows]
    return {"headers": QUALITY_HEADERS, "data": data}


def compare_table(report: Report) -> dict:
    """A comparison report's (bench.compare_report) "configurations" rows, their keys as headers."""
    rows = report.tables["configurations"]
    return {"headers": list(rows[0]), "data": [[cell(v) for v in r.values()] for r in rows]}


def _ratio(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"


def _signed_percent(x: float) -> str:
    """+1.23%, -0.40%; a change that rounds to nothing is 0.00%, not -0.00%."""
    text = f"{x:+.2%}"
    return "0.00%" if text in ("+0.00%", "-0.00%") else text


def _percent(x: float | None, digits: int = 0) -> str:
    return "-" if x is None else f"{100 * x:.{digits}f}%"
