"""Where an engine loop runs: by default on a thread of its own; app.py runs the served engine's loop on the
process's main thread instead (EngineHost), since on CPU a step's OpenMP work costs more from any other thread
(docs/measurements.md, "bf16, and vLLM on both cores", and "What the HTTP path costs")."""
from __future__ import annotations

import queue
import threading
from collections.abc import Callable

EngineLoop = Callable[[], None]


def on_its_own_thread(loop: EngineLoop) -> None:
    """The default place an engine loop runs: a daemon thread of its own, started now."""
    threading.Thread(target=loop, name="engine", daemon=True).start()


class EngineHost:
    """Runs engine loops one after another on the thread that calls serve() (app.py: the main thread). A service
    whose loop is queued here runs once the one before it has ended: a restart shuts the old one down first."""

    def __init__(self) -> None:
        self._loops: queue.Queue[EngineLoop | None] = queue.Queue()

    def run(self, loop: EngineLoop) -> None:
        """An EngineService's `runner`: the loop runs on the serving thread, after the loops queued before it."""
        self._loops.put(loop)

    def serve(self) -> None:
        """Run the queued loops until stop(); call it on the thread the engine should step on."""
        while (loop := self._loops.get()) is not None:
            loop()

    def stop(self) -> None:
        self._loops.put(None)
