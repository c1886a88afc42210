"""Reports: captioned tables of plain rows, rendered as markdown by the CLI."""
from __future__ import annotations

import dataclasses
import json
import statistics
from dataclasses import dataclass, field
from typing import Any

from ..workloads import Workload
from .ablation import AblationRow, MemoryRow
from .experiments import CompareResult, HFStaticResult, TableRow
from .precision import QualityRow
from .runs import RunResult, StepBreakdown


@dataclass
class Report:
    title: str
    tables: dict[str, list[dict[str, Any]]] = field(default_factory=dict)  # caption -> rows
    notes: list[str] = field(default_factory=list)
    rows: list[Any] | None = None  # when set (dataclasses), --json writes these rows instead of the whole report


def breakdown_row(label: str, s: StepBreakdown) -> dict[str, Any]:
    return {"run": label, "steps": s.num_steps, "schedule ms": s.mean_ms["schedule_ms"],
            "prepare inputs ms": s.mean_ms["prepare_ms"], "forward ms": s.mean_ms["forward_ms"],
            "sample ms": s.mean_ms["sample_ms"], "retire ms": s.mean_ms["retire_ms"],
            "mean running": s.mean_running}


def table_report(rows: list[TableRow], input_len: int, output_len: int) -> Report:
    report = Report(f"Engine: prompt {input_len} tokens, {output_len} new tokens, greedy")
    report.tables["reference"] = [
        {"Batch": r.batch, "Time (s)": r.time_s, "TTFT (s)": r.ttft_s, "TPOT (s)": r.tpot_s,
         "Memory (GB)": r.memory_gb, "TPS": r.tps} for r in rows]
    if any(r.hf_tps is not None for r in rows):
        report.tables["vs transformers generate"] = [
            {"Batch": r.batch, "engine TPS": r.tps, "HF time (s)": r.hf_time_s, "HF TPS": r.hf_tps,
             "engine / HF": r.ratio} for r in rows]
    report.tables["per-step breakdown (mean per step)"] = [breakdown_row(f"batch {r.batch}", r.steps) for r in rows]
    return report


def compare_report(result: CompareResult) -> Report:
    report = Report(f"compare on workload {result.workload!r}")
    pairs = list(zip(result.labels, result.results, strict=True))
    report.tables["configurations"] = [_compare_row(label, r) for label, r in pairs]
    report.tables["per-step breakdown (mean per step)"] = [breakdown_row(label, r.steps) for label, r in pairs]
    report.notes.append(f"throughput b/a ({result.labels[1]} / {result.labels[0]}): {result.ratio:.2f}x"
                        + (f" (median of {len(result.ratios)}: {_spread(result.ratios)})" if len(result.ratios) > 1
                           else ""))
    if result.gap_ratios:
        report.notes.append(f"longest gap between two tokens of a request, a/b: {_spread(result.gap_ratios)}")
    report.notes.append(f"identical output token ids for every request: {'yes' if result.same_outputs else 'no'}")
    return report


def _spread(values: list[float]) -> str:
    return ", ".join(f"{v:.2f}x" for v in values)


COMPARE_HEADERS = ["config", "throughput tok/s", "mean TTFT (s)", "mean TPOT (s)", "peak KV blocks", "preemptions",
                   "prefix hits (tokens)", "hit rate", "wall time (s)", "max token gap (s)", "p95 token gap (s)",
                   "draft acceptance"]


def _compare_row(label: str, r: RunResult) -> dict[str, Any]:
    values = [label, r.throughput, r.mean_ttft_s, r.mean_tpot_s, r.peak_kv_blocks, r.preemptions, r.prefix_hits,
              r.hit_rate, r.wall_s, r.max_token_gap_s, r.p95_token_gap_s, r.acceptance_rate]
    return dict(zip(COMPARE_HEADERS, values, strict=True))


def hf_static_report(result: HFStaticResult) -> Report:
    report = Report(f"HF generate in static batches of {result.batch_size} vs the engine, "
                    f"workload {result.workload!r}")
    e = result.engine
    report.tables["throughput"] = [
        {"system": f"HF generate, {result.num_batches} static batch(es)", "useful tokens": result.hf_useful_tokens,
         "generated tokens": result.hf_generated_tokens, "wall time (s)": result.hf_wall_s,
         "throughput tok/s": result.hf_throughput},
        {"system": "engine", "useful tokens": e.generated_tokens, "generated tokens": e.generated_tokens,
         "wall time (s)": e.wall_s, "throughput tok/s": e.throughput}]
    report.notes.append(f"engine / HF throughput: {result.ratio:.2f}x (useful tokens only)")
    return report


def format_cell(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool) or not isinstance(value, float):
        return str(value)
    if value != value or value in (float("inf"), float("-inf")):
        return str(value)
    return f"{value:.1f}" if abs(value) >= 100 else f"{value:.2f}" if abs(value) >= 1 else f"{value:.4f}"


def rounds_text(values: list[float], digits: int = 2) -> str:
    """A measurement's rounds in one cell: "1.23, 1.25, 1.31"."""
    return ", ".join(f"{v:.{digits}f}" for v in values)


def markdown_table(rows: list[dict[str, Any]]) -> str:
    if not rows:
        return ""
    headers = list(rows[0])
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    lines += ["| " + " | ".join(format_cell(row.get(h)) for h in headers) + " |" for row in rows]
    return "\n".join(lines)


def render_report(report: Report) -> str:
    parts = [f"## {report.title}"]
    for caption, rows in report.tables.items():
        parts += [f"\n{caption}:\n", markdown_table(rows)]
    if report.notes:
        parts.append("\n" + "\n".join(report.notes))
    return "\n".join(parts)


def ablate_report(workload: Workload, rows: list[AblationRow], cumulative: bool = False) -> Report:
    title = "cumulative ablation (the engine, feature by feature)" if cumulative else "ablation"
    report = Report(f"{title} on workload {workload.name!r} ({len(workload.requests)} requests)", rows=rows)
    levels = sorted({r.concurrency for r in rows if r.concurrency is not None})
    if levels:  # one column of multipliers per concurrency
        table = {}
        for r in rows:
            line = table.setdefault(r.feature, {"configuration": r.feature, "switch off": r.switch or ""})
            line[f"x full @ {r.concurrency}"] = r.ratio if r.error is None else r.error[:40]
            line[f"tok/s @ {r.concurrency}"] = r.throughput_tok_s
        report.tables["each feature's multiplier at each concurrency"] = list(table.values())
        return report
    precisions = list(dict.fromkeys(r.precision for r in rows if r.precision))
    if len(precisions) > 1:
        report.notes.append(f"'same output' compares greedy tokens with the first row ({precisions[0]}); rows in "
                            f"another precision ({'; '.join(precisions[1:])}) are not expected to match it token "
                            f"for token, only rows in the same one.")
    if cumulative:
        report.tables["features added back in the course's order"] = [
            {"configuration": r.feature, "tok/s": r.throughput_tok_s, "x naive": r.ratio, "x previous": r.step_ratio,
             "mean TTFT (s)": r.mean_ttft_s, "mean TPOT (s)": r.mean_tpot_s, "peak KV blocks": r.peak_kv_blocks,
             "precision": r.precision, "same output": r.same_output_as_full, "error": r.error or ""} for r in rows]
        return report
    report.tables["each feature off in turn"] = [
        {"configuration": r.feature, "switch off": r.switch or "", "tok/s": r.throughput_tok_s,
         "x full engine": r.ratio, "mean TTFT (s)": r.mean_ttft_s, "mean TPOT (s)": r.mean_tpot_s,
         "peak KV blocks": r.peak_kv_blocks, "draft acceptance": r.acceptance_rate, "precision": r.precision,
         "same output": r.same_output_as_full, "error": r.error or ""} for r in rows]
    return report


def memory_report(workload: Workload, rows: list[MemoryRow], kv_bytes_per_token: int,
                  int8_kv_bytes_per_token: int | None = None) -> Report:
    report = Report(f"memory sweep on workload {workload.name!r} ({len(workload.requests)} requests)", rows=rows)
    dtypes = any(r.kv_cache_dtype for r in rows)
    report.tables["KV pool size vs what fits"] = [
        {"KV blocks": r.num_kv_blocks, "layout": "paged" if r.paged else "contiguous",
         **({"KV dtype": r.kv_cache_dtype} if dtypes else {}), "KV MB": r.kv_cache_mb,
         "peak running": r.peak_running, "preemptions": r.preemptions, "tok/s": r.throughput_tok_s,
         "mean TTFT (s)": r.mean_ttft_s, "memory efficiency": r.memory_efficiency, "error": r.error or ""}
        for r in rows]
    mean_tokens = (workload.num_prompt_tokens + workload.num_output_tokens) / max(1, len(workload.requests))
    report.notes.append(f"KV bytes per token: {kv_bytes_per_token:,}; a mean request ({mean_tokens:.0f} tokens) "
                        f"holds {kv_bytes_per_token * mean_tokens / 2**20:.1f} MB when paged; contiguous KV reserves "
                        f"max_model_len tokens for every request.")
    if int8_kv_bytes_per_token and dtypes:
        report.notes.append(f"int8 KV: {int8_kv_bytes_per_token:,} bytes per token (1 byte per element plus a 4-byte "
                            f"scale per token and KV head), {kv_bytes_per_token / int8_kv_bytes_per_token:.2f}x "
                            f"fewer: the same memory holds that many more blocks.")
    return report


def kernel_worth_report(rows: list, tokens: int) -> Report:
    report = Report(f"each C++ CPU kernel against its torch path (and the weights in 2 MB pages against 4 KB ones): "
                    f"ms per decode step ({tokens} steps a round), the rounds alternating in one process", rows=rows)
    report.tables["ms per decode step, on / off"] = [
        {"weights": r.spec, "kernel": r.kernel, "rows": r.rows,
         "on: ms (rounds)": rounds_text(r.on_ms, 1), "off: ms (rounds)": rounds_text(r.off_ms, 1),
         "off / on (median)": round(r.speedup, 3)} for r in rows]
    report.notes.append("off: a kernel on its torch path; huge pages: the weights in ordinary 4 KB pages")
    report.notes.append("> 1: it pays end to end here; near 1: it buys nothing measurable on this CPU")
    return report


def decode_report(rows: list, prompt_len: int, tokens: int) -> Report:
    report = Report(f"batch-1 decode: one greedy request, {tokens} tokens after a {prompt_len}-token prompt, no "
                    f"speculation; ms per token in each round (rounds go round every precision)", rows=rows)
    base = rows[0]
    report.tables["time per token"] = [
        {"precision": r.spec, "as the engine says": r.precision,
         "ms per token (rounds)": " / ".join(f"{t:.1f}" for t in r.ms_per_token), "median ms": r.median_ms,
         f"x {base.spec}'s time": r.ratio} for r in rows]
    report.notes.append("a ratio below 1 is faster; compare within one run: absolute times move with the machine's "
                        "load")
    return report


def to_jsonable(value: Any) -> Any:
    """Dataclasses (and lists of them) as plain JSON data; anything else JSON cannot hold as its str()."""
    def plain(v: Any) -> Any:
        if dataclasses.is_dataclass(v) and not isinstance(v, type):
            return dataclasses.asdict(v)
        return str(v)
    return json.loads(json.dumps(value, default=plain))


def quality_report(rows: list[QualityRow], window: int) -> Report:
    n = rows[0].positions if rows else 0
    report = Report(f"quality against fp32, teacher-forced over presets/quality/text.txt ({n} positions, windows "
                    f"of {window} tokens)", rows=rows)
    report.tables["each precision against the fp32 model"] = [
        {"spec": r.spec, "precision": r.precision, "top-1 agreement": r.top1_agreement,
         "mean abs logprob diff": r.mean_abs_logprob_diff, "max abs logprob diff": r.max_abs_logprob_diff,
         "perplexity": r.perplexity, "fp32 perplexity": r.reference_perplexity,
         "perplexity change": f"{r.perplexity_change:+.2%}", "seconds": r.seconds, "kernel": r.kernel,
         "projections vs fp32 here": r.speed_vs_fp32 or "-"} for r in rows]
    report.notes.append("top-1 agreement: positions where both sides' most likely next token is the same; logprob "
                        "differences and perplexity are of the text's own tokens (prose, code and dialogue).")
    return report


def closed_loop_report(rows, concurrency: int, requests: int, prompt_len: int, output_len: int,
                       busy: tuple[float, float] | None = None) -> Report:
    report = Report(f"a closed loop in-process: {concurrency} requests in flight, {requests} in all, "
                    f"{prompt_len} random prompt tokens and {output_len} new each, greedy "
                    f"({len(rows[0].tok_s)} rounds)", rows=rows)
    beside = len(rows) > 1
    report.tables["per condition"] = [
        {**({"busy neighbours": r.neighbours} if beside else {}),
         "output tok/s (median)": statistics.median(r.tok_s),
         "output tok/s (runs)": rounds_text(r.tok_s, 1),
         **({"vs quiet (median)": statistics.median(r.vs_quiet), "fair share": r.fair_share,
             "of fair share (median)": statistics.median(r.of_fair_share),
             "of fair share (runs)": rounds_text(r.of_fair_share),
             "threads (runs)": ", ".join(str(t) for t in r.threads)} if beside else {}),
         "decode step ms (median)": statistics.median(r.decode_step_ms),
         "mixed step ms (median)": statistics.median(r.mixed_step_ms)} for r in rows]
    if beside:
        what = ("always busy" if busy is None else
                f"busy {busy[0]:g} ms then idle {busy[1]:g} ms, {busy[0] / (busy[0] + busy[1]):.0%} of a core")
        report.notes.append(f"each round runs quiet, then beside each number of busy processes ({what}); vs quiet: "
                            "tok/s over the same round's quiet run")
        report.notes.append("fair share: of the quiet speed, what the engine keeps when every thread that wants a "
                            "CPU gets an equal slice of the cores (2 / (2 + k) for 2 threads on 2 cores beside k "
                            "busy processes); of fair share: vs quiet over it, 1 = a fair share kept")
        report.notes.append("threads: the engine's compute threads at the end of each run (engine/threads.py)")
    return report
