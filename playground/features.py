"""The engine, feature by feature: each experiment run from the page through the playground's measurement, kept
across restarts, and what the tab shows of it: this machine's results, else the shipped ones (results.py)."""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path

from engine import measure
from engine.workloads import Workload, load_workload
from viz.figures import placeholder_figure
from viz.result_figures import concurrency_figure, cumulative_figure, memory_sweep_figure, quality_figure

from .handlers import Playground
from .quality import goal_for
from .results import (
    EXPERIMENTS,
    SHIPPED_RESULTS,
    Measured,
    load_local,
    load_shipped,
    machine_description,
    now,
    save_local,
)
from .settings import ProgressFn
from .tables import concurrency_table, cumulative_table, memory_table, quality_table

# What `python -m engine.bench` runs by default, so a run from the page measures what the shipped file holds.
DEFAULT_WORKLOADS = {"cumulative": "ablation", "concurrency": "ablation", "memory": "memory-pressure"}
CONCURRENCY_LEVELS = (1, 8, 32)
POOL_SIZES = (32, 64, 128, 256)  # KV blocks, `memory --blocks`' default
QUALITY_WINDOW = 1024  # tokens per teacher-forced prompt, `quality --window`'s default (shorter if the model is)
FEATURE_NAMES = {f.switch: f.name for f in measure.FEATURES}
NAMES = {"cumulative": "cumulative ablation", "quality": "quality against fp32", "concurrency": "concurrency sweep",
         "memory": "memory sweep"}
EMPTY = {"cumulative": "No results yet: press Run to add the features back one by one on this machine",
         "quality": "No results yet: press Run to score each precision against fp32 on this machine",
         "concurrency": "No results yet: press Run to measure each feature at concurrency 1, 8 and 32",
         "memory": "No results yet: press Run to try each KV pool size, paged and contiguous"}


@dataclass
class SectionView:
    """What one section of the tab shows."""
    figure: dict  # a plotly spec
    table: dict  # {"headers": [...], "data": [[...]]}
    source: str  # markdown: where and when the numbers were measured, and what they teach


def features_store(pg: Playground) -> Path:
    """Beside the ablation's store: a test's temporary store keeps both out of the user's cache."""
    return pg.store.parent / "feature-by-feature.json"


class FeatureExperiments:
    def __init__(self, pg: Playground, store: Path | None = None, shipped: Path = SHIPPED_RESULTS) -> None:
        self.pg = pg
        self.store = store or features_store(pg)
        self.shipped_path = shipped

    # ---- running ---------------------------------------------------------------------------------------
    def run(self, kind: str, workload_name: str | None = None, quick: bool = True,
            progress: ProgressFn | None = None, levels: Sequence[int] = CONCURRENCY_LEVELS,
            pool_sizes: Sequence[int] = POOL_SIZES, specs: Sequence[str] = measure.QUALITY_SPECS) -> list:
        """Run one experiment (EXPERIMENTS) and keep its rows. Raises measure.Cancelled if cancelled, ValueError if
        another measurement is running or the workload is unknown. quality takes specs, not a workload."""
        if kind not in EXPERIMENTS:
            raise ValueError(f"unknown experiment {kind!r}; one of {', '.join(EXPERIMENTS)}")
        if kind == "quality":
            return self.run_quality(specs, progress)
        name = workload_name or DEFAULT_WORKLOADS[kind]
        llm = self.pg.llm
        workload = load_workload(name, quick).tokenized(llm.tokenizer)
        quick_flag = " --quick" if quick else ""
        if kind == "memory":
            total = 2 * len(pool_sizes) * len(measure.KV_CACHE_DTYPES_SWEPT)
            command = f"python -m engine.bench memory --workload {name} --blocks {_csv(pool_sizes)}{quick_flag}"
            sweep = partial(measure.memory_sweep, llm, workload, pool_sizes)
        elif kind == "concurrency":
            total = len(levels) * (len(measure.FEATURES) + 1)
            command = f"python -m engine.bench ablate --concurrency {_csv(levels)} --workload {name}{quick_flag}"
            sweep = partial(measure.ablate_concurrency, llm, workload, levels)
        else:
            total = len(measure.FEATURES) + 1
            command = f"python -m engine.bench ablate --cumulative --workload {name}{quick_flag}"
            sweep = partial(measure.ablate_cumulative, llm, workload)
        with self.pg.measuring(NAMES[kind], total, progress) as m:
            rows = sweep(progress=m.report, should_stop=m.cancel.is_set)
        save_local(self.store, kind, Measured(
            rows, machine_description(llm), now(), command,
            kv_bytes_per_token=llm.engine.model.kv_bytes_per_token() if kind == "memory" else None,
            note=_seats_note(workload, levels) if kind == "concurrency" else ""))
        return rows

    def run_quality(self, specs: Sequence[str], progress: ProgressFn | None = None) -> list[measure.QualityRow]:
        """engine.measure.quality from the page: each spec's engine against the fp32 one over the shipped text. It
        has no stop check of its own: Cancel takes effect at its next progress call, between two specs."""
        specs = [s.strip() for s in specs if s and s.strip()]
        if not specs:
            raise ValueError("choose at least one precision to score against fp32")
        for spec in specs:
            measure.resolve_spec(spec)  # a bad spec is refused before the live engine pauses
        llm = self.pg.llm
        window = min(QUALITY_WINDOW, llm.engine.model.max_len - 1)  # one new token after each window must fit
        with self.pg.measuring(NAMES["quality"], len(specs) + 1, progress) as m:
            def report(done: int, total: int, current: str) -> None:
                if m.cancel.is_set():
                    raise measure.Cancelled(f"cancelled before {current!r} ({done}/{total} done)")
                m.report(done, total, current)
            rows = measure.quality(llm, specs, window=window, progress=report)
        command = "python -m engine.bench quality " + " ".join(f"--spec {s}" for s in specs) + (
            f" --window {window}" if window != QUALITY_WINDOW else "")
        save_local(self.store, "quality", Measured(rows, machine_description(llm), now(), command,
                                                   note=quality_note(rows, window)))
        return rows

    # ---- loading -----------------------------------------------------------------------------------------
    def shipped(self) -> tuple[dict[str, Measured], str]:
        """The repository's results, and a line saying where and when they were measured (or that there are
        none yet, or why they could not be read)."""
        try:
            shipped = load_shipped(self.shipped_path)
        except ValueError as exc:
            return {}, f"⚠️ The shipped results could not be read ({exc}): press Run to measure this machine."
        if not shipped:
            return {}, ("**No shipped results yet**: nobody has measured this repository's reference machine. "
                        "Press Run in each section to measure yours.")
        first = next(iter(shipped.values()))
        return shipped, (f"Shipped results: **measured on {first.measured_on}, {first.date}** — press Run to "
                         f"measure yours.")

    def results(self) -> dict[str, Measured]:
        """Per experiment, this machine's last results, else the shipped ones (absent when neither exists)."""
        return {**self.shipped()[0], **load_local(self.store)}

    # ---- what the tab shows --------------------------------------------------------------------------
    def view(self, kind: str, level: int | None = None) -> SectionView:
        """One section: its chart, its table and where its numbers come from. level: concurrency's selector."""
        measured = self.results().get(kind)
        rows = measured.rows if measured else []
        if kind == "cumulative":
            figure, table = cumulative_figure(rows), cumulative_table(rows)
        elif kind == "quality":
            goals = [(g.min_top1_agreement, g.max_perplexity_change) if (g := goal_for(r.spec)) else None
                     for r in rows]
            figure, table = quality_figure(rows, goals), quality_table(rows)
        elif kind == "concurrency":
            figure, table = concurrency_figure(rows, level, FEATURE_NAMES), concurrency_table(rows)
        else:
            figure, table = memory_sweep_figure(rows), memory_table(rows)
        lines = [source_line(measured)]
        if kind == "concurrency" and rows:
            lines.append(concurrency_lesson(rows))
        if kind == "memory":
            lines.append(self.kv_note())
        return SectionView(figure if rows else placeholder_figure(EMPTY[kind]), table,
                           "\n\n".join(line for line in lines if line))

    def kv_note(self, workload_name: str = DEFAULT_WORKLOADS["memory"]) -> str:
        """Why memory is the constraint, in the loaded model's KV bytes per token, per request and per reservation."""
        model = self.pg.llm.engine.model
        per_token, per_token_int8, s = model.kv_bytes_per_token(), model.kv_bytes_per_token("int8"), model.shape
        element = per_token // (2 * s.num_layers * s.num_kv_heads * s.head_dim)
        workload = load_workload(workload_name)
        mean = (workload.num_prompt_tokens + workload.num_output_tokens) / max(1, len(workload.requests))
        reserve = workload.config.get("max_model_len") or self.pg.llm.config.max_model_len
        return (f"**KV cache per token:** {per_token / 1024:.1f} KB for this model (K and V × {s.num_layers} layers "
                f"× {s.num_kv_heads} KV heads × {s.head_dim} dims × {element} bytes). A mean '{workload.name}' "
                f"request ({mean:.0f} tokens) holds {_mb(per_token * mean)} when paged; contiguous KV reserves "
                f"max_model_len = {reserve} tokens ({_mb(per_token * reserve)}) for every request however short. "
                f"An int8 KV cache (`kv_cache_dtype=int8`) takes {per_token_int8 / 1024:.1f} KB per token (1 byte "
                f"per element plus a 4-byte scale per token and KV head), {per_token / per_token_int8:.2f}x fewer: "
                f"the sweep gives it the same memory per pool, and the chart and the table show each KV dtype side "
                f"by side.")


def source_line(measured: Measured | None) -> str:
    if measured is None:
        return "No results yet: none shipped with the repository, none measured here. Press Run."
    what = (f"measured on {measured.measured_on}, {measured.date} (shipped with the repository) — press Run to measure "
            f"yours" if measured.shipped else f"measured on this machine ({measured.measured_on}), {measured.date}")
    command = f" · `{measured.command}`" if measured.command else ""
    return f"*{what}*{command}" + (f"\n\n{measured.note}" if measured.note else "")


def quality_note(rows: Sequence[measure.QualityRow], window: int) -> str:
    """What a quality run scored: the positions of the text, and fp32's own perplexity on it."""
    if not rows:
        return ""
    return (f"Teacher-forced over `{measure.QUALITY_TEXT.relative_to(measure.QUALITY_TEXT.parents[2])}`: "
            f"{rows[0].positions} positions in windows of {window} tokens; fp32's perplexity "
            f"{rows[0].reference_perplexity:.2f}.")


def concurrency_lesson(rows: Sequence[measure.AblationRow]) -> str:
    """Each feature's worth at the lowest and the highest concurrency, in words: speculation fades under load."""
    levels = sorted({r.concurrency for r in rows if r.concurrency is not None})
    if len(levels) < 2:
        return ""
    by = {(r.switch, r.concurrency): r for r in rows}
    parts = []
    for f in measure.FEATURES:
        lo, hi = by.get((f.switch, levels[0])), by.get((f.switch, levels[-1]))
        if lo and hi and lo.ratio and hi.ratio:
            parts.append(f"{f.name} {1 / lo.ratio:.2f}x → {1 / hi.ratio:.2f}x")
    return (f"From concurrency {levels[0]} to {levels[-1]}: " + " · ".join(parts)) if parts else ""


def _seats_note(workload: Workload, levels: Sequence[int]) -> str:
    """A quick run has fewer requests than the top level's seats: those seats stay empty, say so."""
    n = len(workload.requests)
    over = [lv for lv in levels if lv > n]
    return (f"⚠️ only {n} requests in this run: at concurrency {', '.join(map(str, over))} at most {n} run at once "
            f"(untick quick for the full workload)") if over else ""


def _csv(values: Sequence[int]) -> str:
    return ",".join(str(v) for v in values)


def _mb(num_bytes: float) -> str:
    return f"{num_bytes / 2**20:.1f} MB"
