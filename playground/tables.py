"""The ablation and comparison tables as the page shows them: named columns, numbers rounded for reading.

gr.Dataframe takes {"headers": [...], "data": [[...]]}; without headers it labels columns "1 2 3", and raw
floats ("5.665796017719589") are noise. Cells are strings formatted like the bench reports' markdown.
"""
from __future__ import annotations

from typing import Any

from engine.bench import Report
from engine.bench.report import COMPARE_HEADERS, format_cell

ABLATION_HEADERS = ["configuration", "tok/s", "x full engine", "mean TTFT (s)", "mean TPOT (s)", "peak KV blocks",
                    "preemptions", "draft acceptance", "same greedy output", "note"]
__all__ = ["ABLATION_HEADERS", "COMPARE_HEADERS", "ablation_table", "cell", "compare_table"]


def cell(value: Any) -> str:
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float) and value == 0:
        return "0"
    return format_cell(value)


def ablation_table(rows: list) -> dict:
    """One line per AblationRow; an empty table (with its headers) before any ablation ran."""
    data = [[r.feature, cell(r.throughput_tok_s), _ratio(r.ratio), cell(r.mean_ttft_s), cell(r.mean_tpot_s),
             cell(r.peak_kv_blocks), cell(r.preemptions), cell(r.acceptance_rate), cell(r.same_output_as_full),
             r.error or ""]
            for r in rows]
    return {"headers": ABLATION_HEADERS, "data": data}


def compare_table(report: Report) -> dict:
    """A comparison report's (bench.compare_report) "configurations" rows, their keys as headers."""
    rows = report.tables["configurations"]
    return {"headers": list(rows[0]), "data": [[cell(v) for v in r.values()] for r in rows]}


def _ratio(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"
