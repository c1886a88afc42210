"""The course as data: each lesson a file (presets/lessons/NN-name.toml, in the course's order), loaded and checked
here, with the numbers a lesson may be about (METRICS) and how they are written. lessons.py runs a lesson on the
live engine; lesson_numbers.py measures it; lesson_record.py keeps the session's record.
"""
from __future__ import annotations

import dataclasses
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

from engine.config import EngineConfig
from engine.measure import load_feature_preset
from engine.workloads import list_workloads
from viz.dashboard import CHARTS

from .lesson_numbers import Evidence

LESSON_DIR = Path(__file__).resolve().parent.parent / "presets" / "lessons"


@dataclass(frozen=True)
class Metric:
    label: str
    unit: str
    fmt: str = "{:.1f}"


METRICS = {
    "tokens_per_s": Metric("tokens/s", "tok/s"),
    "ttft_s": Metric("mean time to first token", "s", "{:.2f}"),
    "tpot_s": Metric("time per output token (mean step)", "s", "{:.3f}"),
    "time_per_token_ms": Metric("engine time per generated token (busy time / tokens)", "ms", "{:.1f}"),
    "max_step_ms": Metric("longest step (the longest gap between two tokens)", "ms", "{:.0f}"),
    "prefix_hit_rate": Metric("prefix-cache hit rate", "", "{:.0%}"),
    "kv_blocks_used": Metric("KV blocks in use (mean)", "blocks", "{:.0f}"),
    "peak_kv_blocks": Metric("KV blocks in use (peak)", "blocks", "{:.0f}"),
    "preemptions": Metric("preemptions", "", "{:.0f}"),
    "running": Metric("requests running at once (mean)", "", "{:.1f}"),
}


@dataclass(frozen=True)
class Lesson:
    slug: str  # the file's name without .toml
    title: str
    idea: str  # two or three sentences
    workload: str  # presets/workloads/NAME.toml
    users: int  # simulated users
    switch: dict  # the EngineConfig fields flipped between before and after
    chart: str  # one of CHARTS
    look_for: str
    question: str
    metric: str  # one of METRICS: the number the question is about
    expect: str  # "up" or "down": the direction the lesson expects that number to move when the switch flips
    preset: str | None = None  # a feature preset (presets/features/) to start from
    start: dict = field(default_factory=dict)  # EngineConfig fields over the defaults and the preset
    before_s: float = 30.0  # the whole course in about 15 minutes, each effect on the chart within a minute
    after_s: float = 30.0
    needs: str | None = None  # "cuda": what this machine may lack
    measured: str = ""  # with `needs`: the last measured result, and where it was measured
    # more than LessonRunner.need asks for before a phase may end (requests, finished, tokens, prompt_tokens, steps)
    evidence: dict = field(default_factory=dict)

    def configuration(self) -> dict:
        """The fields the lesson starts from, over EngineConfig's defaults."""
        return {**(load_feature_preset(self.preset) if self.preset else {}), **self.start}

    def describe_switch(self) -> str:
        return switch_text(self.switch)


def _word(value) -> str:
    return "on" if value is True else "off" if value is False else "none" if value is None else str(value)


def load_lessons(folder: Path = LESSON_DIR) -> list[Lesson]:
    """Every lesson file, in file-name order (NN-name.toml: the course's order). A malformed file is refused by
    name: a lesson plan that silently skipped one would teach the room the wrong order."""
    lessons = []
    for path in sorted(folder.glob("*.toml")):
        with open(path, "rb") as f:
            data = tomllib.load(f)
        names = {f.name for f in dataclasses.fields(Lesson)} - {"slug"}
        if unknown := sorted(set(data) - names):
            raise ValueError(f"lesson {path.name}: unknown field(s) {', '.join(unknown)}")
        try:
            lessons.append(Lesson(slug=path.stem, **data))
        except TypeError as exc:
            raise ValueError(f"lesson {path.name}: {exc}") from exc
    return lessons


def check_lesson(lesson: Lesson) -> list[str]:
    """What is wrong with a lesson (empty when nothing): every name it uses must exist and its configurations
    must be ones the engine accepts."""
    problems = []
    if lesson.workload not in list_workloads():
        problems.append(f"workload {lesson.workload!r} is not in presets/workloads")
    if lesson.chart not in CHARTS:
        problems.append(f"chart {lesson.chart!r} is not one of {', '.join(CHARTS)}")
    if lesson.metric not in METRICS:
        problems.append(f"metric {lesson.metric!r} is not one of {', '.join(METRICS)}")
    if lesson.expect not in ("up", "down"):
        problems.append(f"expect must be 'up' or 'down', got {lesson.expect!r}")
    if not lesson.switch:
        problems.append("switch is empty: a lesson flips one thing")
    if not 1 <= lesson.users <= 64:
        problems.append(f"users must be 1-64, got {lesson.users}")
    if lesson.before_s <= 0 or lesson.after_s <= 0:
        problems.append("before_s and after_s must be > 0")
    if lesson.needs not in (None, "cuda"):
        problems.append(f"needs must be 'cuda' or absent, got {lesson.needs!r}")
    fields = {f.name for f in dataclasses.fields(Evidence)}
    if bad := sorted(k for k, v in lesson.evidence.items() if k not in fields or not isinstance(v, int) or v < 0):
        problems.append(f"evidence: {', '.join(bad)} (each of {', '.join(sorted(fields))}: a count >= 0)")
    if lesson.needs and not lesson.measured:
        problems.append("a lesson that needs what a machine may lack says what was measured where (measured)")
    try:
        start = EngineConfig.from_kwargs(**from_toml(lesson.configuration()))
        after = start.replace(**from_toml(lesson.switch))
        if after == start:
            problems.append("the switch changes nothing from the starting configuration")
    except ValueError as exc:
        problems.append(str(exc))
    for text, name in ((lesson.idea, "idea"), (lesson.look_for, "look_for"), (lesson.question, "question")):
        if not text.strip():
            problems.append(f"{name} is empty")
    return problems


def from_toml(fields: dict) -> dict:
    """TOML has no null: "none" is None (no quantization, an automatic size)."""
    return {k: (None if v == "none" else v) for k, v in fields.items()}


def switch_text(switch: dict) -> str:
    return ", ".join(f"{k} → {_word(v)}" for k, v in switch.items())


def format_value(metric: Metric, value: float | None) -> str:
    return "–" if value is None else metric.fmt.format(value) + (f" {metric.unit}" if metric.unit else "")


def verdict(result: dict) -> str:
    """The lesson's number in one sentence: which way it moved beyond the noise (its spread over the parts of each
    phase), or why there is nothing to say, and what to do about it."""
    metric = METRICS[result["metric"]]
    name = metric.label.capitalize()
    short = result.get("short") or {}
    thin = "; ".join(f"the {phase} phase had {what}" for phase, what in short.items())
    noise = _ranges(metric, result.get("spread") or {})
    if result["moved"] is None:
        if thin:
            return (f"{name}: nothing to compare this time: {thin} when its time ran out. To make it teach: "
                    f"{result.get('remedy') or 'lengthen the phases'}.")
        return f"{name}: no change beyond the noise this time" + (f" ({noise})." if noise else ".")
    said = ("as the lesson expected" if result["as_expected"]
            else f"not the way the lesson expected ({result['expect']})")
    return (f"**{name} went {result['moved']}**" + (f" beyond the noise ({noise})" if noise else "") + f", {said}."
            + (f" (On thin evidence: {thin}.)" if thin else ""))


def _ranges(metric: Metric, spread: dict) -> str:
    """"before 0%–0%, after 88%–95% over three parts of each phase" from the result's spread."""
    parts = [f"{phase} {format_value(metric, r[0])}–{format_value(metric, r[1])}" for phase in ("before", "after")
             if (r := spread.get(phase))]
    return ", ".join(parts) + " over the parts of each phase" if parts else ""
