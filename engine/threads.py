"""The engine's compute threads. The C++ kernels' parallel regions never wait for a thread that has not claimed a
share of the work, so beside a busy process the engine keeps a thread per core (KernelThreads) and torch's own calls
on one: an OpenMP region ends at a barrier, and its idle threads spin against the kernels' (docs/measurements.md,
"Beside a busy neighbour"). Without the C++ kernels, CoreShare sets torch's threads to the cores nobody else wants.
Readings in a row (DROP_AFTER, RISE_AFTER) are asked before anything moves, so a passing process does not make it flap.
"""
from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator
from pathlib import Path

import torch

from . import cpu_kernels

EVERY_S = 0.5
DROP_AFTER, RISE_AFTER = 2, 4
YIELD_US = 2000  # KernelThreads' idle workers yield this long before sleeping while a few others want a core


def _running_threads_of_this_process() -> int:
    count = 0
    for task in Path("/proc/self/task").iterdir():
        try:
            stat = (task / "stat").read_text()
        except OSError:  # the thread ended meanwhile
            continue
        if stat[stat.rindex(")") + 2:stat.rindex(")") + 3] == "R":
            count += 1
    return count


def others_running() -> int | None:
    """Threads of other processes that are running or want to run now; None where the system does not say."""
    try:
        for line in Path("/proc/stat").read_text().splitlines():
            if line.startswith("procs_running "):
                return max(0, int(line.split()[1]) - _running_threads_of_this_process())
    except (OSError, ValueError):
        return None
    return None


def wanting(others: int) -> str:
    return f"{others} other thread{'s want' if others != 1 else ' wants'} a core"


def usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


class FollowsOthers:
    """The other threads that want a core, read at most every EVERY_S; a subclass's adjust() acts on them."""

    def __init__(self) -> None:
        self.others = 0  # at the last reading
        self._due = 0.0

    def _reading(self, now: float | None) -> int | None:
        """A new reading when one is due, else None (None too where the system does not say)."""
        now = time.monotonic() if now is None else now
        if now < self._due:
            return None
        self._due = now + EVERY_S
        others = others_running()
        if others is not None:
            self.others = others
        return others

    def adjust(self, now: float | None = None) -> None:
        raise NotImplementedError

    def settle(self, gap_s: float = 0.02) -> None:
        """Take now the readings a change waits for: a measurement beside busy processes (bench closed-loop) then
        times their effect, not the engine's time to see them come."""
        for _ in range(max(DROP_AFTER, RISE_AFTER)):
            self._due = 0.0
            self.adjust()
            time.sleep(gap_s)


class CoreShare(FollowsOthers):
    """Sets torch's thread count (from the thread that steps: an OpenMP setting is that thread's) to the cores left
    over by everyone else."""

    def __init__(self, most: int | None = None) -> None:
        super().__init__()
        self.most = most or torch.get_num_threads()  # what it was given (a test lane's 1, a user's OMP_NUM_THREADS)
        self.threads = self.most
        self._fewer = self._more = 0

    def adjust(self, now: float | None = None) -> None:
        if self.most <= 1 or (others := self._reading(now)) is None:
            return
        want = max(1, min(self.most, usable_cores() - others))
        self._fewer = self._fewer + 1 if want < self.threads else 0
        self._more = self._more + 1 if want > self.threads else 0
        if self._fewer >= DROP_AFTER or self._more >= RISE_AFTER:
            self.threads, self._fewer, self._more = want, 0, 0
            torch.set_num_threads(self.threads)  # only on a change: whoever set it otherwise since is left alone

    @contextlib.contextmanager
    def computing(self) -> Iterator[None]:
        """Around a step: the count adjusted first, and left as it is after."""
        self.adjust()
        yield

    def describe(self) -> str:
        return (f"{self.threads} of {self.most} threads" + (f" ({wanting(self.others)})"
                                                            if self.threads < self.most else ""))


_given: int | None = None  # torch's threads when the process's first engine started: what the engine was given


class KernelThreads(FollowsOthers):
    """The C++ kernels on `most` threads (torch's count when the first engine started), at most a usable core each,
    and torch's own calls on one. While others want some of the cores but fewer than all, an idle worker yields
    YIELD_US before it sleeps (docs/measurements.md, "Where the share goes")."""

    def __init__(self, kernels, most: int | None = None) -> None:
        super().__init__()
        global _given
        if _given is None:
            _given = torch.get_num_threads()
        self.most = max(1, min(most or _given, usable_cores()))
        self.threads = kernels.kernel_threads(self.most)
        self._kernels, self.yield_us, self._differ = kernels, 0, 0

    def adjust(self, now: float | None = None) -> None:
        if self.threads <= 1 or (others := self._reading(now)) is None:
            return
        want = YIELD_US if 0 < others < usable_cores() else 0
        self._differ = self._differ + 1 if want != self.yield_us else 0
        if self._differ >= DROP_AFTER:
            self.yield_us, self._differ = self._kernels.kernel_yield_us(want), 0

    @contextlib.contextmanager
    def computing(self) -> Iterator[None]:
        """Around a step: the stepping thread's torch calls on one thread, its count put back after."""
        self.adjust()
        before = torch.get_num_threads()
        if before != 1:
            torch.set_num_threads(1)
        try:
            yield
        finally:
            if before != 1:
                torch.set_num_threads(before)

    def describe(self) -> str:
        return (f"{self.threads} threads (C++ kernels; torch's calls on 1)"
                + (f"; idle workers yield {self.yield_us} us ({wanting(self.others)})"
                   if self.yield_us else ""))


def compute_threads(device: torch.device) -> CoreShare | KernelThreads:
    """What a step computes on: the C++ kernels' threads, else torch's; beside a GPU, the one host thread."""
    if device.type != "cpu":
        return CoreShare(most=1)
    kernels = cpu_kernels.compiled()
    return KernelThreads(kernels) if kernels is not None else CoreShare()
