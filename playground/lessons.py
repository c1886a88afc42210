"""Lessons: the course (course.py) taught live on the real engine. No gradio here: lessons_tab.py lays it out.

A lesson run: the engine is set to the lesson's configuration, its simulated users start, "before" runs for
`before_s`, then the switch flips (on time, or when the presenter presses Flip), "after" runs for `after_s`, and
the numbers of both phases (lesson_numbers.py) are set side by side with the direction the lesson expected.
Leaving a lesson (Stop, Next, Previous, another lesson) stops its users and puts the engine back as it was.
"""
from __future__ import annotations

import dataclasses
import os
import queue
import statistics
import threading
import time
from dataclasses import dataclass, field
from typing import Protocol

from engine.config import LOAD_TIME_FIELDS, EngineConfig
from engine.sampling_params import SamplingParams
from engine.workloads import load_workload
from viz.lesson_figure import LessonChart, lesson_figure

from .course import METRICS, Lesson, format_value, from_toml, load_lessons, verdict
from .lesson_numbers import Evidence, evidence, moved_beyond_noise, series, spread, timed, window_metrics
from .room import plain


class LessonHost(Protocol):
    """What a lesson needs of the playground it runs on (handlers.Playground): its engine, its room, its users."""
    llm: object
    service: object  # the live EngineService
    traffic: object  # the TrafficGenerator
    room: object
    remote: object
    measurement: object
    rebuilding: str | None

    def start_traffic(self, workload_name: str, num_users: int, duration_s: float = 0.0, scale: float = 1.0,
                      who: str = "presenter") -> str: ...
    def stop_traffic(self, who: str = "presenter") -> str: ...
    def _update(self, changes: dict, progress=None) -> str: ...
    def _config_value(self, name: str, value): ...
    def _busy(self) -> str: ...

SETTLE = 0.25  # share of each phase left out of its numbers: the engine filling up, or just rebuilt
MAX_FACTOR = 4.0  # a phase waiting for its evidence runs at most this many times its own length
PROBE_TOKENS = 8  # the reply that measures the engine's speed before a lesson sizes its traffic
KEEP_AS_WRITTEN = 0.75  # replies that would need shortening by less than this share are left as written
MIN_SCALE = 1 / 16  # replies are never shortened below this share of the workload's lengths (nor below 4 tokens)
SPEED_METRICS = ("tokens_per_s", "time_per_token_ms", "tpot_s")


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
    need: Evidence = field(default_factory=Evidence)  # what each phase's number must rest on before it ends
    scale: float = 1.0  # the workload's reply lengths, sized for this engine's speed (1: as written)
    probe_tok_s: float | None = None  # the engine's speed at one reply, measured before the traffic started
    extended: str = ""  # why the phase now running goes on past its length ("" while it does not)
    short: dict = field(default_factory=dict)  # phase -> what its number still lacked when its time ran out
    restored: str = ""  # what letting go of the lesson's configuration did, once it was done

    @property
    def active(self) -> bool:
        return self.phase in ("setting up", "before", "flipping", "after")


# how often every page asks for news, and while a lesson runs (Playground.page_period says why)
PAGE_PERIOD_S, LESSON_PERIOD_S = 1.0, 0.5


class LessonRunner:
    """The lessons, and the one run at a time on the page's engine. Every visitor reads it; only the presenter's
    handlers call start / flip / leave (access.py guards them)."""

    def __init__(self, pg: LessonHost, lessons: list[Lesson] | None = None, seconds: float | None = None,
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
        self._chart: tuple | None = None  # (what it shows, the figure): one figure a second for every visitor
        self.record_files: tuple[int, list[str], str] | None = None  # the record prepared: (version, files, line)

    def index(self, slug: str) -> int:
        for i, lesson in enumerate(self.lessons):
            if lesson.slug == slug:
                return i
        raise ValueError(f"no lesson {slug!r}; lessons: {', '.join(x.slug for x in self.lessons)}")

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
        if pg.service.paused:
            return "the engine is paused (step mode): press Resume on the Step mode tab first"
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
        said = f"Left {run.lesson.title}." + self._restore()
        self.run = None
        return said

    def _restore(self) -> str:
        """Put the engine back as it was before the lesson (once); what that did, in words."""
        saved, self._saved = self._saved, None  # taken once: the lesson's thread at its end, or Stop / Next
        if saved is None:
            return ""
        back, outcome = self._change(saved)
        if not back:
            return ""
        return (f" The engine is back as it was before the lesson ({', '.join(back)})." if not outcome.startswith("⚠️")
                else f" {outcome}")

    def _change(self, changes: dict) -> tuple[dict, str]:
        """(the fields the engine does not run yet, what applying them said)."""
        now = self._current()
        changes = {k: v for k, v in changes.items() if now.get(k) != v}
        return changes, self.pg._update(changes) if changes else ""

    def _apply(self, run: LessonRun, changes: dict) -> bool:
        outcome = self._change({k: self.pg._config_value(k, v) for k, v in from_toml(changes).items()})[1]
        if outcome.startswith("⚠️"):
            run.phase, run.note = "failed", outcome
            return False
        return True

    def _wait_for_traffic(self, run: LessonRun, since: float, timeout_s: float = 30.0) -> None:
        """Until the engine steps on the lesson's traffic, so the before phase's clock measures an engine at work
        rather than a slow first step (a busy machine; a cold start). Bounded: traffic that never runs still ends."""
        deadline = time.time() + timeout_s
        while not run.stop.is_set() and time.time() < deadline:
            history = self.pg.service.history
            if history and history[-1].time >= since and history[-1].num_running > 0:
                return
            time.sleep(0.05)

    def limits(self, lesson: Lesson) -> tuple[tuple[float, float], tuple[float, float]]:
        """Each phase's (shortest, longest) time: its own length, and MAX_FACTOR times that."""
        before_s, after_s = (self.seconds, self.seconds) if self.seconds else (lesson.before_s, lesson.after_s)
        return (before_s, MAX_FACTOR * before_s), (after_s, MAX_FACTOR * after_s)

    def need(self, lesson: Lesson, longest_prompt: int = 0) -> Evidence:
        """What the lesson's number must rest on in each phase's measured part: most of the users' first round of
        requests, and what its metric is made of. A lesson file may ask for more (`evidence`)."""
        metric, users = lesson.metric, lesson.users
        requests = max(3, min(users, 8))
        need = Evidence(requests=requests,
                        tokens=64 if metric in SPEED_METRICS else 0,
                        steps=20 if metric in SPEED_METRICS else 30 if metric in ("running", "kv_blocks_used",
                                                                                  "peak_kv_blocks") else 0,
                        prompt_tokens=longest_prompt if metric == "max_step_ms" else 0,
                        finished=requests if metric == "preemptions" else 0)
        return dataclasses.replace(need, **lesson.evidence)

    def _size_traffic(self, run: LessonRun, requests: list, phase_s: float) -> None:
        """Shorten the workload's replies so one takes at most a quarter of a phase among the lesson's users, at the
        speed the engine makes now on one short reply: on a slow machine a 30 s phase would otherwise end before
        a single reply finished."""
        service = self.pg.service
        prompt = list(requests[0].prompt_token_ids)
        params = SamplingParams(temperature=0.0, max_tokens=PROBE_TOKENS, ignore_eos=True)
        rid, q = service.submit(prompt, params)
        first = last = None
        deadline = time.monotonic() + 120
        try:
            while not run.stop.is_set() and time.monotonic() < deadline:
                try:
                    out = q.get(timeout=0.25)
                except queue.Empty:
                    continue
                now = time.perf_counter()
                if out.token_ids and first is None:
                    first = (now, len(out.token_ids))
                last = (now, len(out.token_ids))
                if out.finished:
                    break
        finally:
            if service.is_streaming(rid):
                service.abort(rid)
        if first is None or last is None or last[1] <= first[1]:
            return  # no speed measured: the replies stay as written
        tpot = (last[0] - first[0]) / (last[1] - first[1])
        run.probe_tok_s = 1 / tpot if tpot > 0 else None
        typical = statistics.median(r.params.max_tokens for r in requests)
        per_reply_s = typical * tpot * max(1.0, run.lesson.users) ** 0.5  # a batch's steps are slower than one's
        scale = max(MIN_SCALE, min(1.0, (phase_s / 4) / per_reply_s))
        run.scale = 1.0 if scale > KEEP_AS_WRITTEN else scale  # a reply a little long is no reason to change it

    def _phase(self, run: LessonRun, name: str, limits: tuple[float, float], flip_ends_it: bool = False) -> None:
        """Until the phase's number rests on the evidence it needs (within its shortest and longest time), or a flip
        or a stop; what is still short at its longest time is kept for the verdict."""
        shortest, longest = limits
        started = time.time()
        run.extended = ""
        while not run.stop.is_set():
            if flip_ends_it and run.flip_now.is_set():
                return
            elapsed = time.time() - started
            if elapsed >= shortest:
                got = evidence(timed(self.pg.service.history), started + SETTLE * elapsed, time.time())
                if got.covers(run.need):
                    run.extended = ""
                    return
                if elapsed >= longest:
                    run.short[name] = got.missing(run.need)
                    run.extended = ""
                    return
                run.extended = (f"going on past {shortest:.0f} s (up to {longest:.0f} s): the number needs more to "
                                f"rest on, so far {got.missing(run.need)}")
            time.sleep(0.25 if elapsed >= shortest else 0.1)

    def _drive(self, run: LessonRun) -> None:
        lesson = run.lesson
        before, after = self.limits(lesson)
        try:
            # the defaults, but the weights stay as they are unless the lesson names them (a rebuild is slow)
            start = {k: v for k, v in EngineConfig().to_dict().items() if k not in LOAD_TIME_FIELDS}
            start.update(lesson.configuration())
            # every page's next tick brings it to the lesson and to the lesson's faster period: the engine changes
            # once the room is watching, so each page shows the change within a second of it
            if run.stop.wait(max(0.0, PAGE_PERIOD_S - (time.time() - run.started))):
                return
            if not self._apply(run, start) or run.stop.is_set():
                return
            requests = load_workload(lesson.workload).tokenized(self.pg.llm.tokenizer).requests
            run.need = self.need(lesson, max(len(r.prompt_token_ids) for r in requests))
            self._size_traffic(run, requests, before[0])
            if run.stop.is_set():
                return
            traffic_at = time.time()
            note = self.pg.start_traffic(lesson.workload, lesson.users, before[1] + after[1] + 60, scale=run.scale,
                                         who=f"the lesson {lesson.title!r}")
            if note:
                run.phase, run.note = "failed", note
                return
            self._wait_for_traffic(run, traffic_at)
            if run.stop.is_set():
                return
            run.phase, run.t_before = "before", time.time()
            self._phase(run, "before", before, flip_ends_it=True)
            if run.stop.is_set():
                return
            run.phase, run.t_flip = "flipping", time.time()
            if not self._apply(run, lesson.switch):
                return
            self.pg.room.note(f"lesson {lesson.title!r}: flipped {lesson.describe_switch()}")
            run.phase, run.t_after = "after", time.time()
            self._phase(run, "after", after)
            if run.stop.is_set():
                return
            run.t_end = time.time()
            run.result = self.measure(run)
            self.records.append(run.result)
            self.pg.stop_traffic(who=f"the lesson {lesson.title!r}")
            # the lesson lets go: the presenter's own configuration comes back now, not at Stop or Next
            run.restored = self._restore()
            run.phase = "done"
            if run.restored:
                self.pg.room.note(f"lesson {lesson.title!r} done: the engine is back as it was before it")
        except Exception as exc:  # noqa: BLE001 - a lesson that breaks says why; the engine carries on
            run.phase, run.note = "failed", f"⚠️ the lesson stopped: {exc}"

    def measure(self, run: LessonRun) -> dict:
        """The run's record: each phase's settled part, its noise (spread) and what it rested on, and the chart."""
        history = timed(self.pg.service.history)
        b0, b1 = run.t_before, run.t_flip
        a0, a1 = run.t_after, run.t_end
        windows = {"before": (b0 + SETTLE * (b1 - b0), b1), "after": (a0 + SETTLE * (a1 - a0), a1)}
        before, after = (window_metrics(history, *windows[k]) for k in ("before", "after"))
        lesson = run.lesson
        noise = {k: spread(history, lesson.metric, *w) for k, w in windows.items()}
        moved = moved_beyond_noise(before[lesson.metric], after[lesson.metric], noise["before"], noise["after"])
        return {"lesson": lesson.slug, "title": lesson.title, "switch": lesson.switch, "workload": lesson.workload,
                "users": lesson.users, "metric": lesson.metric, "expect": lesson.expect, "moved": moved,
                "as_expected": None if moved is None else moved == lesson.expect,
                "before": before, "after": after, "spread": noise,
                "evidence": {k: dataclasses.asdict(evidence(history, *w)) for k, w in windows.items()},
                "short": dict(run.short), "remedy": self.remedy() if run.short else "",
                "scale": run.scale, "probe_tok_s": run.probe_tok_s,
                "seconds": {"before": b1 - b0, "after": a1 - a0},
                "flip_at_s": a0 - b0, "started": run.started, "device": self.device_type,
                "precision": self.pg.service.snapshot().precision,
                "chart": series(history, lesson.metric, b0, a1)}

    def remedy(self) -> str:
        """What to do when a phase ran out of time before its number had enough to rest on."""
        try:
            load = os.getloadavg()[0]
        except OSError:
            load = None
        cores = os.cpu_count() or 1
        busy = (f"this machine is busy (load average {load:.1f} on {cores} cores): stop what else runs on it, "
                if load is not None and load > cores else "")
        return (f"{busy}run a faster configuration (e.g. start with --preset int8), or lengthen the phases "
                f"(--lesson-seconds 60)")

    # ---- what every visitor sees ------------------------------------------------------------------------
    def phase_line(self) -> str:
        run = self.run
        if run is None:
            return "No lesson is running. The presenter starts one; everyone's page follows."
        (before_s, _), (after_s, _) = self.limits(run.lesson)
        now = time.time()
        line = {
            "setting up": "setting up the engine for this lesson, and measuring its speed on one short reply",
            "before": f"**before** the switch: {now - (run.t_before or now):.0f}/{before_s:.0f} s, then "
                      f"{run.lesson.describe_switch()}",
            "flipping": f"flipping {run.lesson.describe_switch()}",
            "after": f"**after** {run.lesson.describe_switch()}: {now - (run.t_after or now):.0f}/{after_s:.0f} s",
            "done": "done: the numbers below were measured just now, on this engine",
            "stopped": "stopped",
            "unavailable": "not on this machine: below, the last measured result",
            "failed": "could not run",
        }[run.phase]
        notes = [run.note]
        if run.extended and run.phase in ("before", "after"):
            notes.append(f"⏳ {run.extended}")
        if run.scale < 1 and run.phase in ("before", "flipping", "after"):
            notes.append(f"Sized for this machine: replies at {run.scale:.0%} of the workload's lengths (the engine "
                         f"made {run.probe_tok_s:.1f} tokens/s on one reply, too slow for the replies as written)")
        if run.phase == "done" and run.restored:
            notes.append(run.restored.strip())
        return f"Lesson **{plain(run.lesson.title)}**: {line}" + "".join(f"  \n{plain(n, 400)}" for n in notes if n)

    def chart(self, lesson: Lesson | None) -> dict | None:
        """The chart of the lesson shown: the running one's number so far, or the picked one's last result in this
        session. Rebuilt at most once a second while a lesson runs (every visitor's clock asks for it), and the
        same object until then, so each page is sent it only when it changed."""
        run = self.run
        if run is not None and run.lesson is lesson and run.t_before is not None:
            live = run.active
            key = (run.run_id, run.phase, int(time.time()) if live else None)

            def drawn() -> tuple:  # (points, flip at, now, result)
                now = time.time() if live else (run.t_end or time.time())
                return (series(timed(self.pg.service.history), lesson.metric, run.t_before, now),
                        run.t_after - run.t_before if run.t_after else None, now - run.t_before, run.result or {})
        elif lesson is None:
            return None
        else:
            record = next((r for r in reversed(self.records) if r["lesson"] == lesson.slug), None)
            key = ("record", id(record), lesson.slug)

            def drawn() -> tuple:
                points = [tuple(p) for p in record["chart"]] if record else []
                return (points, record["flip_at_s"] if record else None, points[-1][0] if points else 0.0,
                        record or {})
        if self._chart is None or self._chart[0] != key:
            points, flip_at_s, now_s, result = drawn()
            metric = METRICS[lesson.metric]
            self._chart = (key, lesson_figure(LessonChart(
                lesson.title, metric.label, metric.unit, "%" in metric.fmt, lesson.describe_switch(), points,
                flip_at_s, now_s, (result.get("before") or {}).get(lesson.metric),
                (result.get("after") or {}).get(lesson.metric))))
        return self._chart[1]

    def result_table(self, result: dict | None) -> str:
        if not result:
            return ""
        rows = ["| | before | after |", "|---|---:|---:|"]
        for name, metric in METRICS.items():
            b, a = result["before"][name], result["after"][name]
            mark = " ◀" if name == result["metric"] else ""
            rows.append(f"| {metric.label}{mark} | {format_value(metric, b)} | {format_value(metric, a)} |")
        return "\n".join(rows) + "\n\n" + verdict(result)
