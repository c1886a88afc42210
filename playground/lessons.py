"""Lessons: the course taught live on the real engine. The content is data (presets/lessons/*.toml, one lesson a
file, in the course's order); this file loads and checks it, runs a lesson on the live engine, measures its
before and after from the engine's own time series, and keeps the session's record (HTML and JSON).

A lesson run: the engine is set to the lesson's configuration (the defaults, its feature preset and its own fields;
the weights stay as they are unless the lesson names them), its simulated users start, "before" runs for
`before_s`, then the switch flips (on time, or when the presenter presses Flip), "after" runs for `after_s`, and
the numbers of both phases (each phase's first quarter left out: the engine settling) are set side by side with
the direction the lesson expected. Leaving a lesson (Stop, Next, Previous, another lesson) stops its users and
puts the engine back as it was before the lesson began. No gradio here: lessons_tab.py lays it out.
"""
from __future__ import annotations

import dataclasses
import html
import json
import threading
import time
import tomllib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from engine.bench import load_feature_preset
from engine.config import LOAD_TIME_FIELDS, EngineConfig
from engine.workloads import list_workloads

from .room import plain

if TYPE_CHECKING:
    from .handlers import Playground

LESSON_DIR = Path(__file__).resolve().parent.parent / "presets" / "lessons"
CHARTS = ("blocks", "queues", "prefix", "throughput", "memory")  # the dashboard's figures (DashboardFigures)
SETTLE = 0.25  # share of each phase left out of its numbers: the engine filling up, or just rebuilt


@dataclass(frozen=True)
class Metric:
    label: str
    unit: str
    better: str  # "up" or "down": which way is better, for the record's wording
    fmt: str = "{:.1f}"


METRICS = {
    "tokens_per_s": Metric("tokens/s", "tok/s", "up"),
    "ttft_s": Metric("mean time to first token", "s", "down", "{:.2f}"),
    "tpot_s": Metric("time per output token (mean step)", "s", "down", "{:.3f}"),
    "time_per_token_ms": Metric("engine time per generated token (busy time / tokens)", "ms", "down", "{:.1f}"),
    "max_step_ms": Metric("longest step (the longest gap between two tokens)", "ms", "down", "{:.0f}"),
    "prefix_hit_rate": Metric("prefix-cache hit rate", "", "up", "{:.0%}"),
    "kv_blocks_used": Metric("KV blocks in use (mean)", "blocks", "down", "{:.0f}"),
    "peak_kv_blocks": Metric("KV blocks in use (peak)", "blocks", "down", "{:.0f}"),
    "preemptions": Metric("preemptions", "", "down", "{:.0f}"),
    "running": Metric("requests running at once (mean)", "", "up", "{:.1f}"),
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
    if lesson.needs and not lesson.measured:
        problems.append("a lesson that needs what a machine may lack says what was measured where (measured)")
    try:
        start = EngineConfig.from_kwargs(**_typed(lesson.configuration()))
        after = start.replace(**_typed(lesson.switch))
        if after == start:
            problems.append("the switch changes nothing from the starting configuration")
    except ValueError as exc:
        problems.append(str(exc))
    for text, name in ((lesson.idea, "idea"), (lesson.look_for, "look_for"), (lesson.question, "question")):
        if not text.strip():
            problems.append(f"{name} is empty")
    return problems


def _typed(fields: dict) -> dict:
    """TOML has no null: "none" is None (no quantization, an automatic size)."""
    return {k: (None if v == "none" else v) for k, v in fields.items()}


# ---- numbers from the engine's time series ------------------------------------------------------------------

def _increase(values: Sequence[float]) -> float:
    """How much a counter grew over consecutive readings, across a restart (where it starts again from 0)."""
    total = 0.0
    for a, b in zip(values, values[1:]):
        total += b - a if b >= a else b
    return total


def window_metrics(history: Iterable, t0: float, t1: float) -> dict[str, float | None]:
    """Every METRIC over the engine's history samples in [t0, t1] (wall times). The sample just before t0 is the
    counters' baseline; a number with nothing to say in the window (no request got its first token) is None."""
    samples = sorted(history, key=lambda s: s.time)
    inside = [s for s in samples if t0 <= s.time <= t1]
    before = [s for s in samples if s.time < t0][-1:]
    span = max(t1 - t0, 1e-9)
    counted = before + inside

    def grew(name: str) -> float:
        return _increase([getattr(s, name) for s in counted])

    def mean(values):
        values = [v for v in values if v is not None]
        return sum(values) / len(values) if values else None

    queries, generated = grew("prefix_cache_queries"), grew("generation_tokens_total")
    # with prefix caching off nothing is looked up: an engine that served requests then hit nothing (0), and
    # one that served none has no rate to give (None)
    hit_rate = grew("prefix_cache_hits") / queries if queries else 0.0 if generated else None
    return {
        "tokens_per_s": generated / span if counted else None,
        "ttft_s": mean(s.ttft_s for s in inside),
        # a request decoding gets one token a step, so its time per output token is the step's time: the mean of
        # the steps that produced tokens (finished requests' TPOT alone says nothing while none finishes)
        "tpot_s": mean(b.step_ms / 1e3 for a, b in zip(counted, counted[1:])
                       if b.time >= t0 and (b.generation_tokens_total > a.generation_tokens_total
                                            or 0 < b.generation_tokens_total < a.generation_tokens_total)),
        # what a token costs the engine: its steps' time over the tokens they made (a step of a speculating
        # request makes several; a naive one recomputes the whole text for one)
        "time_per_token_ms": sum(s.step_ms for s in inside) / generated if generated and inside else None,
        "max_step_ms": max((s.step_ms for s in inside), default=None),
        "prefix_hit_rate": hit_rate,
        "kv_blocks_used": mean(s.kv_blocks_used for s in inside),
        "peak_kv_blocks": max((s.kv_blocks_used for s in inside), default=None),
        "preemptions": grew("num_preemptions") if counted else None,
        "running": mean(s.num_running for s in inside),
    }


def series(history: Iterable, metric: str, t0: float, t1: float, bin_s: float = 2.0) -> list[tuple[float, float]]:
    """(seconds since t0, the metric over that bin): what the record's chart draws. The same numbers as the
    table's, bin by bin (window_metrics), so chart and table never disagree."""
    samples = list(history)
    out, t = [], t0
    while t < t1:
        value = window_metrics(samples, t, min(t + bin_s, t1))[metric]
        if value is not None:
            out.append((t - t0 + bin_s / 2, value))
        t += bin_s
    return out


# ---- a run -------------------------------------------------------------------------------------------------

@dataclass
class LessonRun:
    run_id: int
    lesson: Lesson
    started: float  # wall time the run began (setting up)
    phase: str = "setting up"  # setting up, before, flipping, after, done, stopped, unavailable, failed
    note: str = ""  # the latest line the run has to say (a refusal, a rebuild)
    t_before: float | None = None
    t_flip: float | None = None  # the switch asked to flip
    t_after: float | None = None  # the switch applied (after a rebuild, later than t_flip)
    t_end: float | None = None
    flip_now: threading.Event = field(default_factory=threading.Event)
    stop: threading.Event = field(default_factory=threading.Event)
    result: dict | None = None

    @property
    def active(self) -> bool:
        return self.phase in ("setting up", "before", "flipping", "after")


class LessonRunner:
    """The lessons, and the one run at a time on the page's engine. Every visitor reads it; only the presenter's
    handlers call start / flip / leave (access.py guards them)."""

    def __init__(self, pg: Playground, lessons: list[Lesson] | None = None, seconds: float | None = None,
                 device_type: str | None = None) -> None:
        """`seconds`: every phase this long instead of the lesson's own (a rehearsal, a short workshop, tests)."""
        self.pg = pg
        self.lessons = lessons if lessons is not None else load_lessons()
        self.seconds = seconds
        self.device_type = device_type or pg.llm.engine.model.device.type
        self.run: LessonRun | None = None
        self.records: list[dict] = []  # every finished lesson's numbers, in the order they ran
        self._ids = 0
        self._lock = threading.Lock()  # one start / leave at a time
        self._saved: dict | None = None  # the engine's settings before the lesson: put back on leaving
        self._thread: threading.Thread | None = None

    def index(self, slug: str) -> int:
        for i, lesson in enumerate(self.lessons):
            if lesson.slug == slug:
                return i
        raise ValueError(f"no lesson {slug!r}; lessons: {', '.join(x.slug for x in self.lessons)}")

    def durations(self, lesson: Lesson) -> tuple[float, float]:
        return (self.seconds, self.seconds) if self.seconds else (lesson.before_s, lesson.after_s)

    # ---- the presenter's -------------------------------------------------------------------------------
    def start(self, slug: str) -> str:
        lesson = self.lessons[self.index(slug)]
        with self._lock:
            self._leave()
            if why := self._cannot_run():
                return f"⚠️ Lesson not started: {why}."
            self._ids += 1
            run = LessonRun(self._ids, lesson, time.time())
            self.run = run
            if lesson.needs == "cuda" and self.device_type != "cuda":
                run.phase = "unavailable"
                self.pg.room.note(f"opened the lesson {lesson.title!r}")
                return (f"{lesson.title}: this lesson needs a CUDA GPU and this engine runs on "
                        f"{self.device_type}; the last measured result is shown instead.")
            self._saved = self._current()
            self._thread = threading.Thread(target=self._drive, args=(run,), name=f"lesson-{lesson.slug}",
                                            daemon=True)
            self._thread.start()
        self.pg.room.note(f"started the lesson {lesson.title!r}")
        return f"Started: {lesson.title}."

    def flip(self) -> str:
        run = self.run
        if run is None or run.phase not in ("setting up", "before"):
            return "Nothing to flip: no lesson is in its 'before' phase."
        run.flip_now.set()
        return f"Flipping {run.lesson.describe_switch()} now."

    def leave(self) -> str:
        """Stop the lesson (if one runs) and put the engine back as it was before it."""
        with self._lock:
            run = self.run
            said = self._leave()
        if run is not None:
            self.pg.room.note(f"left the lesson {run.lesson.title!r}")
        return said

    def step(self, offset: int) -> str:
        """Next (+1) or Previous (-1): leave the lesson and start the one beside it."""
        current = self.index(self.run.lesson.slug) if self.run else (-1 if offset > 0 else len(self.lessons))
        target = current + offset
        if not 0 <= target < len(self.lessons):
            return "That was the last lesson." if offset > 0 else "This is the first lesson."
        return self.start(self.lessons[target].slug)

    # ---- inside ----------------------------------------------------------------------------------------
    def _cannot_run(self) -> str | None:
        pg = self.pg
        if pg.remote is not None:
            return f"the page is attached to {plain(pg.remote.url)}: lessons drive this process's engine (detach first)"
        if pg.measurement is not None or pg.rebuilding:
            return pg._busy()
        traffic = pg.traffic.status()
        if traffic is not None and traffic.running:
            return "simulated users are running: stop them on the Dashboard first (a lesson brings its own)"
        return None

    def _current(self) -> dict:
        """The configuration the engine runs once pending changes apply, less what only a new load changes."""
        requested = self.pg.service.config_view().requested
        return {k: v for k, v in requested.items() if k not in ("model", "device")}

    def _leave(self) -> str:
        run, thread = self.run, self._thread
        if run is None:
            return "No lesson is open."
        run.stop.set()
        run.flip_now.set()
        if thread is not None:
            thread.join(timeout=120)
        self._thread = None
        if run.active:
            run.phase = "stopped"
        if self.pg.traffic.status() is not None and self.pg.traffic.status().running:
            self.pg.stop_traffic()
        said = f"Left {run.lesson.title}."
        if self._saved is not None:
            now = self._current()
            back = {k: v for k, v in self._saved.items() if now.get(k) != v}
            self._saved = None
            if back:
                outcome = self.pg._update(back)
                said += (f" The engine is back as it was ({', '.join(back)})." if not outcome.startswith("⚠️")
                         else f" {outcome}")
        self.run = None
        return said

    def _apply(self, run: LessonRun, changes: dict) -> bool:
        changes = {k: self.pg._config_value(k, v) for k, v in _typed(changes).items()}
        now = self._current()
        changes = {k: v for k, v in changes.items() if now.get(k) != v}
        if not changes:
            return True
        outcome = self.pg._update(changes)
        if outcome.startswith("⚠️"):
            run.phase, run.note = "failed", outcome
            return False
        run.note = outcome
        return True

    def _wait(self, run: LessonRun, seconds: float, flip_ends_it: bool = False) -> None:
        deadline = time.time() + seconds
        while not run.stop.is_set() and time.time() < deadline:
            if flip_ends_it and run.flip_now.is_set():
                return
            time.sleep(0.1)

    def _drive(self, run: LessonRun) -> None:
        lesson = run.lesson
        before_s, after_s = self.durations(lesson)
        try:
            # the defaults, but the weights stay as they are unless the lesson names them (a rebuild is slow)
            start = {k: v for k, v in EngineConfig().to_dict().items() if k not in LOAD_TIME_FIELDS}
            start.update(lesson.configuration())
            if not self._apply(run, start) or run.stop.is_set():
                return
            note = self.pg.start_traffic(lesson.workload, lesson.users, before_s + after_s + 60)
            if note:
                run.phase, run.note = "failed", note
                return
            run.phase, run.t_before = "before", time.time()
            self._wait(run, before_s, flip_ends_it=True)
            if run.stop.is_set():
                return
            run.phase, run.t_flip = "flipping", time.time()
            if not self._apply(run, lesson.switch):
                return
            self.pg.room.note(f"lesson {lesson.title!r}: flipped {lesson.describe_switch()}")
            run.phase, run.t_after = "after", time.time()
            self._wait(run, after_s)
            if run.stop.is_set():
                return
            run.t_end = time.time()
            run.result = self.measure(run)
            self.records.append(run.result)
            run.phase = "done"
            self.pg.stop_traffic()
        except Exception as exc:  # noqa: BLE001 - a lesson that breaks says why; the engine carries on
            run.phase, run.note = "failed", f"⚠️ the lesson stopped: {exc}"

    def measure(self, run: LessonRun) -> dict:
        """Before and after, each phase's settled part, from the engine's own history; and the record's chart."""
        history = list(self.pg.service.history)
        b0, b1 = run.t_before, run.t_flip
        a0, a1 = run.t_after, run.t_end
        before = window_metrics(history, b0 + SETTLE * (b1 - b0), b1)
        after = window_metrics(history, a0 + SETTLE * (a1 - a0), a1)
        lesson = run.lesson
        x, y = before[lesson.metric], after[lesson.metric]
        moved = None if x is None or y is None or x == y else ("up" if y > x else "down")
        return {"lesson": lesson.slug, "title": lesson.title, "switch": lesson.switch, "workload": lesson.workload,
                "users": lesson.users, "metric": lesson.metric, "expect": lesson.expect, "moved": moved,
                "as_expected": None if moved is None else moved == lesson.expect,
                "before": before, "after": after, "seconds": {"before": b1 - b0, "after": a1 - a0},
                "flip_at_s": a0 - b0, "started": run.started, "device": self.device_type,
                "precision": self.pg.service.snapshot().precision,
                "chart": series(history, lesson.metric, b0, a1)}

    # ---- what every visitor sees ------------------------------------------------------------------------
    def phase_line(self) -> str:
        run = self.run
        if run is None:
            return "No lesson is running. The presenter starts one; everyone's page follows."
        before_s, after_s = self.durations(run.lesson)
        now = time.time()
        line = {
            "setting up": "setting up the engine for this lesson",
            "before": f"**before** the switch: {now - (run.t_before or now):.0f}/{before_s:.0f} s, then "
                      f"{run.lesson.describe_switch()}",
            "flipping": f"flipping {run.lesson.describe_switch()}",
            "after": f"**after** {run.lesson.describe_switch()}: {now - (run.t_after or now):.0f}/{after_s:.0f} s",
            "done": "done: the numbers below were measured just now, on this engine",
            "stopped": "stopped",
            "unavailable": "not on this machine: below, the last measured result",
            "failed": "could not run",
        }[run.phase]
        return f"Lesson **{plain(run.lesson.title)}**: {line}" + (f"  \n{plain(run.note)}" if run.note else "")

    def result_table(self, result: dict | None) -> str:
        if not result:
            return ""
        rows = ["| | before | after |", "|---|---:|---:|"]
        for name, metric in METRICS.items():
            b, a = result["before"][name], result["after"][name]
            mark = " ◀" if name == result["metric"] else ""
            rows.append(f"| {metric.label}{mark} | {format_value(metric, b)} | {format_value(metric, a)} |")
        return "\n".join(rows) + "\n\n" + verdict(result)


def format_value(metric: Metric, value: float | None) -> str:
    return "–" if value is None else metric.fmt.format(value) + (f" {metric.unit}" if metric.unit else "")


def verdict(result: dict) -> str:
    metric = METRICS[result["metric"]]
    if result["moved"] is None:
        return f"{metric.label.capitalize()}: nothing to compare this time (no change measured)."
    said = ("as the lesson expected" if result["as_expected"]
            else f"not the way the lesson expected ({result['expect']})")
    return f"**{metric.label.capitalize()} went {result['moved']}**, {said}."


# ---- the session's record -----------------------------------------------------------------------------------

def record_json(records: list[dict], machine: str) -> str:
    return json.dumps({"machine": machine, "lessons": records}, indent=2, default=str) + "\n"


def record_html(records: list[dict], machine: str) -> str:
    """One self-contained page (no script, no link out): each lesson's before/after table and its chart as
    inline SVG, every text escaped."""
    parts = [f"<!doctype html><html><head><meta charset='utf-8'><title>Lessons: what the room measured</title>"
             f"<style>body{{font-family:sans-serif;max-width:60em;margin:2em auto}}table{{border-collapse:collapse}}"
             f"td,th{{border:1px solid #ccc;padding:.3em .6em;text-align:right}}td:first-child{{text-align:left}}"
             f"</style></head><body><h1>What the room measured</h1><p>{html.escape(machine)}</p>"]
    if not records:
        parts.append("<p>No lesson has finished yet.</p>")
    for r in records:
        metric = METRICS[r["metric"]]
        parts.append(f"<h2>{html.escape(r['title'])}</h2><p>Workload {html.escape(r['workload'])}, "
                     f"{r['users']} simulated users; switch: {html.escape(switch_text(r['switch']))}; "
                     f"{html.escape(r['precision'])} on {html.escape(r['device'])}.</p><table>"
                     "<tr><th></th><th>before</th><th>after</th></tr>")
        for name, m in METRICS.items():
            cells = (m.label, format_value(m, r["before"][name]), format_value(m, r["after"][name]))
            parts.append("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in cells) + "</tr>")
        parts.append(f"</table><p>{html.escape(verdict(r).replace('**', ''))}</p>")
        parts.append(svg_chart(r["chart"], r["flip_at_s"], f"{metric.label}" + (f" ({metric.unit})" if metric.unit
                                                                               else "")))
    parts.append("</body></html>")
    return "\n".join(parts)


def switch_text(switch: dict) -> str:
    return ", ".join(f"{k} → {_word(v)}" for k, v in switch.items())


def svg_chart(points: list, flip_at_s: float, label: str, width: int = 640, height: int = 200) -> str:
    if not points:
        return "<p>(no samples)</p>"
    xs, ys = [p[0] for p in points], [p[1] for p in points]
    x_max, y_max = max(max(xs), flip_at_s, 1e-9), max(max(ys), 1e-9)
    pad = 30

    def sx(x):
        return pad + (width - 2 * pad) * x / x_max

    def sy(y):
        return height - pad - (height - 2 * pad) * y / y_max
    path = " ".join(f"{'M' if i == 0 else 'L'}{sx(x):.1f},{sy(y):.1f}" for i, (x, y) in enumerate(points))
    return (f"<svg xmlns='http://www.w3.org/2000/svg' width='{width}' height='{height}' role='img'>"
            f"<text x='{pad}' y='16' font-size='12'>{html.escape(label)}; max {y_max:.3g}</text>"
            f"<line x1='{sx(flip_at_s):.1f}' x2='{sx(flip_at_s):.1f}' y1='{pad}' y2='{height - pad}' "
            f"stroke='#d33' stroke-dasharray='4'/><text x='{sx(flip_at_s) + 4:.1f}' y='{pad + 10}' font-size='11' "
            f"fill='#d33'>switch</text><path d='{path}' fill='none' stroke='#36c' stroke-width='2'/>"
            f"<text x='{pad}' y='{height - 8}' font-size='11'>0 s</text><text x='{width - pad - 30}' "
            f"y='{height - 8}' font-size='11'>{x_max:.0f} s</text></svg>")


def machine_name(runner: LessonRunner) -> str:
    """What the record says the numbers were measured on."""
    from .results import machine_description
    weights = runner.pg.service.snapshot().precision
    return f"{machine_description(runner.pg.llm)}, weights {weights}: measured with watch-llm"


def write_record(records: list[dict], machine: str, folder: Path) -> list[str]:
    folder.mkdir(parents=True, exist_ok=True)
    page, data = folder / "lessons-record.html", folder / "lessons-record.json"
    page.write_text(record_html(records, machine), encoding="utf-8")
    data.write_text(record_json(records, machine), encoding="utf-8")
    return [str(page), str(data)]


