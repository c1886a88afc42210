"""The measurement tabs' side of the playground: an ablation or a comparison run over the loaded weights while
the live engine is held still, one at a time, cancellable, with progress every tab can read. A mixin of
Playground (playground/handlers.py)."""
from __future__ import annotations

import contextlib
import json
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from engine import measure
from engine.cache import cache_dir
from engine.workloads import load_workload

from .conversation import WARNING
from .settings import ProgressFn


@dataclass
class Measurement:
    """A run that holds the live engine still (ablation, comparison): every tab can say why, and for how long."""
    name: str
    total: int  # configurations to run
    progress: ProgressFn | None = None  # the caller's progress bar
    done: int = 0
    current: str = ""
    started: float = field(default_factory=time.monotonic)
    cancel: threading.Event = field(default_factory=threading.Event)
    reported: float | None = None  # when the last configuration ended (the estimate's clock)

    def report(self, done: int, total: int, current: str) -> None:
        """bench's progress callback, called before each configuration and once at the end."""
        self.done, self.total, self.current = done, total, current
        self.reported = time.monotonic()
        if self.progress:
            self.progress(done / total, f"{self.describe()} · running: {current}")

    def describe(self) -> str:
        """The time left: the configurations still to run at the mean time of those done, less what the one
        running has already taken (elapsed / done alone grew while a long configuration ran)."""
        if not self.done or self.reported is None:
            left = "estimating time left"
        else:
            per = (self.reported - self.started) / self.done
            remaining = per * (self.total - self.done) - (time.monotonic() - self.reported)
            left = f"~{remaining:.0f} s left" if remaining >= 1 else "almost done (this one runs longer than the mean)"
        return f"{self.name}: {self.done}/{self.total} configurations, {left}"


def ablation_store() -> Path:
    return cache_dir() / "last-ablation.json"


class MeasurementHandlers:
    """ablate, compare, cancel_measurement, last_ablation, and the `measuring` hold every run goes through."""

    def ablate(self, workload_name: str, quick: bool = True,
               progress: ProgressFn | None = None) -> list[measure.AblationRow]:
        """Raises measure.Cancelled if cancelled, ValueError if another measurement is running."""
        workload = load_workload(workload_name, quick)
        with self.measuring("ablation", len(measure.ABLATIONS) + 1, progress) as m:
            rows = measure.ablate(self.llm, workload, progress=m.report, should_stop=m.cancel.is_set)
        self.store.parent.mkdir(parents=True, exist_ok=True)
        kept = {"workload": workload.name, "quick": quick, "rows": rows}
        self.store.write_text(json.dumps(measure.to_jsonable(kept)))
        return rows

    def full_engine_note(self) -> str:
        """What the ablation's "full engine" is, and where the live engine differs from it (without this, "no
        quantization" came out fastest and the page did not say why)."""
        live = self.service.config_view().requested
        full = ", ".join(f"{k}={v}" for k, v in measure.FULL_FIELDS.items())
        differ = [f"{k}={live.get(k)}" for k, v in measure.FULL_FIELDS.items() if live.get(k) != v]
        return (f"The **full engine** of this run is every feature on: {full}. " + (
            f"The live engine differs: it runs {', '.join(differ)}." if differ else "The live engine runs the same."))

    def last_ablation(self) -> list[measure.AblationRow]:
        try:
            return [measure.AblationRow(**r) for r in json.loads(self.store.read_text())["rows"]]
        except (OSError, ValueError, KeyError, TypeError):  # none yet, or written by an older version
            return []

    def compare(self, workload_name: str, spec_a: str, spec_b: str, quick: bool = True,
                progress: ProgressFn | None = None) -> measure.CompareResult:
        """Raises measure.Cancelled if cancelled, ValueError for a bad spec or if another measurement is running."""
        workload = load_workload(workload_name, quick)
        with self.measuring("comparison", 2, progress) as m:
            return measure.compare(self.llm, workload, spec_a, spec_b, progress=m.report, should_stop=m.cancel.is_set)

    def cancel_measurement(self) -> str:
        if (measuring := self.measurement) is None:
            return "No measurement is running."
        measuring.cancel.set()
        self.room.note(f"cancelled the {measuring.name}")
        return f"Cancelling the {measuring.name}: the live engine resumes within a step."

    @contextlib.contextmanager
    def measuring(self, name: str, total: int, progress: ProgressFn | None) -> Iterator[Measurement]:
        """Hold the live engine still while a measurement runs (so its numbers are clean), say so to every tab,
        then restore the engine's state. One at a time: a second is refused rather than left waiting silently."""
        if note := self.local_only(f"The {name} (it measures this process's engine)"):
            raise ValueError(note.removeprefix(f"{WARNING} "))
        if not self._exclusive.acquire(blocking=False):
            raise ValueError(f"another measurement is running ({self._busy()}); wait for it or cancel it")
        try:
            service, was_paused = self.service, self.service.paused
            self.measurement = Measurement(name, total, progress)
            self.room.note(f"started a{'n' if name[0] in 'aeiou' else ''} {name} (the live engine pauses meanwhile)")
            service.pause()
            try:
                yield self.measurement
            finally:
                self.measurement = None
                if not was_paused and service.alive:  # not if it was restarted meanwhile
                    service.resume()
        finally:
            self._exclusive.release()
