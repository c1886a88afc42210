"""Sustained traffic: N simulated users, each sending a request, waiting for its reply, thinking, sending again.

Users look the engine service up at every request, so a restarted engine is used as soon as it is back; a refused
or failed request is counted and shown, never fatal to the run."""
from __future__ import annotations

import queue
import random
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from engine.sampling_params import SamplingParams
from engine.service import EngineStopped
from engine.workloads import WorkloadRequest


class Service(Protocol):
    """What a user needs of EngineService."""
    def submit(self, prompt: list[int], params: SamplingParams, sink=None, priority: int = 0
               ) -> tuple[str, queue.Queue]: ...
    def abort(self, request_id: str) -> None: ...


# people are priority 0 to 999 (access.Seats): under the engine's priority policy a simulated user's request waits
# while a person's is read, and gives its seat to one (engine/policies.py)
SIMULATED_PRIORITY = 1000
POLL_S = 0.25  # how often a waiting user looks up from its reply to see whether Stop was pressed
RATE_WINDOW_S = 10.0  # tokens/s is measured over this much recent time


@dataclass
class TrafficStatus:
    """A run's counts, as the page shows them."""
    workload: str
    num_users: int
    duration_s: float  # 0: each user sends once
    elapsed_s: float
    running: bool  # some user still has a request in flight or more to send
    stopping: bool  # Stop was pressed, or the duration is over and the last replies are finishing
    stopped: bool  # Stop was pressed
    users_waiting: int  # users with a request in flight (the others are thinking)
    requests_sent: int
    requests_done: int  # replies that finished normally
    requests_refused: int  # the engine said no (too long for max_model_len, engine stopped, ...)
    requests_failed: int  # replies ended by an engine error, a restart or an abort from elsewhere
    requests_stopped: int  # replies cut short by Stop
    tokens: int  # generated for this run's requests
    tokens_per_s: float  # over the last RATE_WINDOW_S
    last_problem: str  # why the last request was refused or failed

    @property
    def fraction(self) -> float:
        """How far the run is: by time for a timed run, by replies for a one-shot run; a run stopped early shows
        where it stopped."""
        if not self.running and not self.stopped:
            return 1.0
        if self.duration_s > 0:
            return min(1.0, self.elapsed_s / self.duration_s)
        ended = self.requests_done + self.requests_refused + self.requests_failed + self.requests_stopped
        return min(1.0, ended / max(1, self.num_users))

    def describe(self) -> str:
        """Markdown: a progress bar (text, so it reads the same in any tab and under any load), then the counts."""
        if self.duration_s > 0:
            span = f"{self.elapsed_s:.0f} of {self.duration_s:.0f} s"
        else:
            span = f"each user once, {self.elapsed_s:.0f} s"
        state = ("stopping" if self.stopped else "finishing the last replies" if self.stopping else "running"
                 ) if self.running else "stopped" if self.stopped else "done"
        lines = [f"`{progress_bar(self.fraction)}` {self.fraction:.0%}",
                 f"**{state}** · {self.num_users} users from '{self.workload}' · {span} · "
                 f"**{self.users_waiting}** waiting for a reply, {self.num_users - self.users_waiting} thinking",
                 f"requests sent {self.requests_sent} · done **{self.requests_done}** · "
                 f"refused {self.requests_refused} · failed {self.requests_failed} · {self.tokens} tokens · "
                 f"**{self.tokens_per_s:.1f}** tokens/s (last {RATE_WINDOW_S:.0f} s)"
                 + (f" · {self.requests_stopped} cut short by Stop" if self.requests_stopped else "")]
        if self.last_problem:
            lines.append(f"⚠️ last refused or failed request: {self.last_problem}")
        return "\n\n".join(lines)


def progress_bar(fraction: float, cells: int = 30) -> str:
    full = round(max(0.0, min(1.0, fraction)) * cells)
    return "█" * full + "░" * (cells - full)


@dataclass
class _Run:
    workload: str
    requests: Sequence[WorkloadRequest]
    num_users: int
    duration_s: float
    started: float = field(default_factory=time.monotonic)
    ended: float | None = None  # when the last user finished: the run's clock stops there
    users_left: int = 0
    stop: threading.Event = field(default_factory=threading.Event)  # Stop pressed: abort what is in flight
    threads: list[threading.Thread] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)
    waiting: int = 0
    sent: int = 0
    done: int = 0
    refused: int = 0
    failed: int = 0
    stopped: int = 0
    tokens: int = 0
    recent: deque = field(default_factory=deque)  # (time, tokens) of the last RATE_WINDOW_S
    last_problem: str = ""

    def time_up(self) -> bool:
        return self.duration_s > 0 and time.monotonic() - self.started >= self.duration_s

    def count(self, **deltas: int) -> None:
        with self.lock:
            for name, delta in deltas.items():
                setattr(self, name, getattr(self, name) + delta)

    def problem(self, kind: str, reason: str) -> None:
        with self.lock:
            setattr(self, kind, getattr(self, kind) + 1)
            self.last_problem = reason

    def add_tokens(self, n: int) -> None:
        if n > 0:
            with self.lock:
                self.tokens += n
                self.recent.append((time.monotonic(), n))


class _Reply:
    """A simulated user's reply as the engine makes it: its tokens are counted on the engine's thread as they come,
    and the user's own thread wakes once, when the reply has ended (a queue per reply woke 32 threads every step,
    each taking the interpreter from the engine and the page's server)."""

    def __init__(self, run: _Run):
        self.run, self.seen, self.last = run, 0, None
        self.ended = threading.Event()

    def put(self, out) -> None:
        self.run.add_tokens(len(out.token_ids) - self.seen)
        self.seen = len(out.token_ids)
        if out.finished:
            self.last = out
            self.ended.set()


class TrafficGenerator:
    """start / stop / status over a run of simulated users; one run at a time."""

    def __init__(self, service: Callable[[], Service | None], think_s: tuple[float, float] = (0.5, 3.0),
                 seed: int = 0) -> None:
        """`service`: returns the live engine service (Playground.restart replaces it), or None while it is
        being replaced (a user then waits rather than send to the engine that is going)."""
        self._service = service
        self.think_s = think_s
        self.seed = seed
        self._run: _Run | None = None
        self._lock = threading.Lock()

    def start(self, workload: str, requests: Sequence[WorkloadRequest], num_users: int, duration_s: float) -> None:
        """User i sends requests i, i + N, i + 2N, ... of the workload (cycling). Raises ValueError for a run
        already going, no users, a negative duration or an empty workload."""
        num_users, duration_s = int(num_users), float(duration_s)
        if num_users < 1 or duration_s < 0 or not requests:
            raise ValueError(f"need at least one user, a duration >= 0 and requests to send "
                             f"(got {num_users} users, {duration_s:g} s, {len(requests)} requests)")
        with self._lock:
            if self.running:
                raise ValueError("traffic is already running: press Stop first")
            run = _Run(workload, list(requests), num_users, duration_s, users_left=num_users)
            run.threads = [threading.Thread(target=self._user, args=(run, i), name=f"traffic-user-{i}", daemon=True)
                           for i in range(num_users)]
            self._run = run
        for t in run.threads:
            t.start()

    def stop(self) -> bool:
        """Stop now: no user sends again, replies in flight are aborted (their blocks freed). False if none ran."""
        run = self._run
        if run is None or not self.running:
            return False
        run.stop.set()
        return True

    def wait(self, timeout: float | None = None) -> TrafficStatus | None:
        """Block until the run has ended (or timeout); its status."""
        run = self._run
        if run is not None:
            deadline = None if timeout is None else time.monotonic() + timeout
            for t in run.threads:
                t.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
        return self.status()

    @property
    def running(self) -> bool:
        run = self._run
        return run is not None and any(t.is_alive() for t in run.threads)

    def status(self) -> TrafficStatus | None:
        """The current (or last) run's counts; None before the first run."""
        run = self._run
        if run is None:
            return None
        running = self.running
        with run.lock:
            now = run.ended if run.ended is not None and not running else time.monotonic()
            while run.recent and run.recent[0][0] < now - RATE_WINDOW_S:
                run.recent.popleft()
            window = min(RATE_WINDOW_S, max(now - run.started, 1e-3))
            return TrafficStatus(
                workload=run.workload, num_users=run.num_users, duration_s=run.duration_s,
                elapsed_s=now - run.started, running=running, stopping=running and (run.stop.is_set() or run.time_up()),
                stopped=run.stop.is_set(), users_waiting=run.waiting, requests_sent=run.sent, requests_done=run.done,
                requests_refused=run.refused, requests_failed=run.failed, requests_stopped=run.stopped,
                tokens=run.tokens, tokens_per_s=sum(n for _, n in run.recent) / window if running else 0.0,
                last_problem=run.last_problem)

    # ---- one simulated user, in its own thread ----------------------------------------------------------
    def _user(self, run: _Run, index: int) -> None:
        try:
            self._send_until_done(run, index)
        finally:
            with run.lock:
                run.users_left -= 1
                if run.users_left == 0:
                    run.ended = time.monotonic()

    def _send_until_done(self, run: _Run, index: int) -> None:
        rng = random.Random(self.seed * 1_000_003 + index)
        turn = 0
        while not run.stop.is_set() and not run.time_up():
            if run.duration_s == 0 and turn == 1:
                return
            request = run.requests[(index + turn * run.num_users) % len(run.requests)]
            turn += 1
            service = self._service()  # an abort must go to the engine that has the request: ids restart at 0
            while service is None:  # the engine is being replaced: wait for the new one, not a refusal from the old
                if run.stop.wait(POLL_S) or run.time_up():
                    return
                service = self._service()
            try:
                reply = _Reply(run)
                rid, _ = service.submit(list(request.prompt_token_ids), request.params, sink=reply,
                                        priority=SIMULATED_PRIORITY)
            except EngineStopped as exc:  # sent as a restart or a rebuild stopped the engine: ended by it
                run.count(sent=1)
                run.problem("failed", str(exc))
            except (ValueError, RuntimeError) as exc:  # too long for the engine now, or too many waiting
                run.count(sent=1)
                run.problem("refused", str(exc))
            else:
                run.count(sent=1, waiting=1)
                try:
                    self._wait_for_reply(run, service, rid, reply)
                finally:
                    run.count(waiting=-1)
            if run.duration_s > 0:  # thinking; Stop, or the end of the run, cuts it short
                left = run.duration_s - (time.monotonic() - run.started)
                run.stop.wait(max(0.0, min(rng.uniform(*self.think_s), left)))

    def _wait_for_reply(self, run: _Run, service: Service, rid: str, reply: _Reply) -> None:
        while not reply.ended.wait(POLL_S):
            if run.stop.is_set():
                service.abort(rid)  # on a stopped service this frees nothing and raises nothing
                run.count(stopped=1)
                return
        out = reply.last
        if out.error or out.finish_reason in ("error", "abort"):
            run.problem("failed", out.error or f"request {rid} was aborted")
        else:
            run.count(done=1)
