"""EngineService: the engine in one background thread, with thread-safe submit / abort / stream / config.

Only the service thread touches the engine: callers send commands through a queue and get replies through futures.
After each step the thread stores a snapshot and a history sample, so any number of viewers can read them without
slowing the engine. A configuration change (engine/reconfigure.py) waits for a step boundary, or applies at once to
an idle engine.
"""
from __future__ import annotations

import contextlib
import queue
import threading
import time
import traceback
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Protocol

from .engine import LLMEngine
from .host import EngineLoop, on_its_own_thread
from .reconfigure import Reconfiguration
from .request import RequestMetrics, RequestOutput
from .sampling_params import SamplingParams
from .snapshot import EngineCounters, EngineSnapshot, StepCounters

# Requests allowed to wait for a seat before new ones are refused (ServiceBusy): a burst beyond it gets "retry
# later" at once instead of growing the queue, and its memory, without limit.
DEFAULT_MAX_WAITING_REQUESTS = 256
# while the engine steps, its whole snapshot (every block's state, every live request) is taken at most this often:
# a reader polls it at most a few times a second, and taking it every step cost a share of a batch-1 step worth
# saving (docs/measurements.md, "The weights in 2 MB pages, and the snapshot every 50 ms").
SNAPSHOT_INTERVAL_S = 0.05
# steps the time series keeps: it must outlast the dashboard's 180 s charts and a lesson's phases at the fastest step
# (docs/measurements.md, "The lessons, rehearsed")
HISTORY_LEN = 60_000


class ServiceBusy(RuntimeError):
    """Too many requests are waiting already: retry later (an HTTP server answers 429)."""


class EngineStopped(RuntimeError):
    """The engine thread has stopped (shut down, replaced by a restart, or died): nothing sent to it now runs."""


class OutputSink(Protocol):
    """Where a request's outputs go. put() is called on the engine thread: it must return at once."""
    def put(self, item: RequestOutput) -> None: ...


@dataclass
class FinishedRequestStats:
    finish_reason: str
    e2e_latency: float  # seconds from arrival to the last output
    num_prompt_tokens: int
    num_generation_tokens: int


@dataclass
class IterationStats:
    """What one engine step did, with the meanings of vLLM's IterationStats, for counters and histograms that
    add steps up (the metrics endpoint). Deltas, never totals, so they survive an engine restart."""
    num_prompt_tokens: int = 0  # prompt lengths of the requests that got their first token in this step
    num_generation_tokens: int = 0
    num_preemptions: int = 0
    prefix_cache_queries: int = 0  # tokens
    prefix_cache_hits: int = 0
    spec_num_drafts: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    time_to_first_tokens: list[float] = field(default_factory=list)
    inter_token_latencies: list[float] = field(default_factory=list)  # one per request that gained tokens, not first
    finished: list[FinishedRequestStats] = field(default_factory=list)


@dataclass(slots=True)
class HistorySample(StepCounters):
    """One point of the dashboard's time series: the engine's counters after a step, and the step's own measures."""
    time: float  # when (time.time())
    step_ms: float  # how long the step took
    ttft_s: float | None  # of requests that got their first token in this step (mean)
    tpot_s: float | None  # of requests that finished in this step (mean)
    num_started: int = 0  # requests that got their first token in this step (a step's count, not a total)
    num_finished: int = 0  # requests that finished in this step
    prompt_tokens: int = 0  # the prompts of the requests that got their first token in this step


RESTARTED = "restarted"  # a ConfigChange's action when the engine itself was replaced (its step counts from 0 again)


@dataclass(frozen=True)
class ConfigChange:
    """A configuration change as the engine applied it (or refused to build it), with the wall time it took effect:
    the time-series charts draw one marker per change, so "before" and "after" sit side by side."""
    time: float  # time.time() when the step that applied it began, or when an idle engine applied it
    step: int
    changes: dict
    action: str
    error: str | None = None  # set when the new configuration could not be built and the old one kept serving


@dataclass(frozen=True)
class ConfigView:
    """The configuration the engine runs once its pending changes apply: what a settings form should show, so
    that sending the form back never undoes a change still waiting for a step boundary."""
    requested: dict  # as asked: None for a size left automatic
    resolved: dict  # the numbers it runs with
    automatic: dict[str, int]  # what each size left empty comes to under the other fields
    running: dict  # as asked, what runs now: differs from `requested` while changes wait for a step boundary

    @property
    def pending(self) -> dict:
        return {k: v for k, v in self.requested.items() if v != self.running[k]}


class EngineService:
    def __init__(self, engine: LLMEngine, history_len: int = HISTORY_LEN,
                 max_waiting_requests: int | None = DEFAULT_MAX_WAITING_REQUESTS,
                 stat_listeners: list[Callable[[IterationStats], None]] | None = None,
                 follows: EngineService | None = None,
                 runner: Callable[[EngineLoop], None] = on_its_own_thread) -> None:
        """`stat_listeners`: called on the engine thread after every step; the list is kept, not copied, so its owner
        can add to it later (and hand it to the service that replaces this one after a restart). `follows`: the
        service this one replaces: its time series and configuration changes carry on here, with a marker for the
        restart. `runner`: where the engine loop runs (its own thread, or an EngineHost's)."""
        if max_waiting_requests is not None and (isinstance(max_waiting_requests, bool)
                                                 or not isinstance(max_waiting_requests, int)
                                                 or max_waiting_requests < 1):
            raise ValueError(f"max_waiting_requests must be an integer >= 1 or None, got {max_waiting_requests!r}")
        self.engine = engine
        self.reconfig = Reconfiguration.of(engine)  # what was asked, what runs, what waits, the last change
        self.max_waiting_requests = max_waiting_requests
        self.stat_listeners = stat_listeners if stat_listeners is not None else []
        self._commands: queue.Queue = queue.Queue()  # (thunk, Future or None), run on the engine thread
        self._streams: dict[str, OutputSink] = {}
        self._progress: dict[str, tuple[float, int]] = {}  # request -> (time of its last new tokens, tokens so far)
        self._snapshot: EngineSnapshot = engine.snapshot()
        self._snapshot_at = time.perf_counter()
        self._counters: EngineCounters = engine.counters()
        self._config_view = self._view_config()
        self.history: deque[HistorySample] = deque(maxlen=history_len)
        self.config_changes: deque[ConfigChange] = deque(maxlen=256)
        self._seen_reconfig = self.reconfig.last  # only the last record is kept: note each new one
        self.paused = False
        self._step_waiters: deque[Future] = deque()  # step_once callers, one step each
        self.error: str | None = None
        self._stop_reason = "shut down"  # what shutdown() was told: a request sent too late is told the same
        # when this engine replaced another (a restart or a rebuild): its counters start again from 0 here
        self.replaced_at: float | None = time.time() if follows is not None else None
        if follows is not None:
            self.history.extend(follows.history)
            self.config_changes.extend(follows.config_changes)
            self.config_changes.append(ConfigChange(time.time(), 0, {}, RESTARTED))
        self._stop = threading.Event()
        self._ended = threading.Event()  # the engine loop has returned (stopped, or died with self.error)
        runner(self._run)

    # ---- API for any thread --------------------------------------------------------------------------
    def submit(self, prompt: str | list[int], params: SamplingParams,
               sink: OutputSink | None = None, priority: int = 0) -> tuple[str, queue.Queue]:
        """Add a request; raises ValueError (bad input) or ServiceBusy in the caller's thread. Returns (id, its
        stream): a new queue.Queue, or `sink` if given (an asyncio server passes one that hands each output to
        its event loop, so no thread waits on a queue per request). `priority`: lower first (engine/policies.py)."""
        rid, stream = self._call(self._add, prompt, params, sink, priority)
        return rid, stream

    def stream(self, prompt: str | list[int], params: SamplingParams,
               timeout: float = 600.0) -> Iterator[RequestOutput]:
        """Yield the request's outputs as they come; the last one has finished=True."""
        rid, q = self.submit(prompt, params)
        yield from self.follow(rid, q, timeout)

    def follow(self, rid: str, q: queue.Queue, timeout: float = 600.0,
               latest: bool = False) -> Iterator[RequestOutput]:
        """The outputs of a request already submitted, as `stream` yields them (for a caller that needs the id first).
        `latest`: skip to the newest output already waiting (each holds the whole text so far, not a delta), so a
        consumer slower than the engine (a busy web server) shows the newest text instead of falling behind."""
        try:
            while True:
                out = q.get(timeout=timeout)
                while latest and not (out.finished or out.error):
                    try:
                        out = q.get_nowait()
                    except queue.Empty:
                        break
                yield out
                if out.finished:
                    return
        finally:  # the consumer went away (stop button, closed tab): free the request's blocks
            if rid in self._streams:
                self.abort(rid)

    def is_streaming(self, request_id: str) -> bool:
        """Whether the request's final output has yet to be published (it is waiting, running or just aborted)."""
        return request_id in self._streams

    def abort(self, request_id: str) -> None:
        self._commands.put((lambda: self._abort(request_id), None))

    def update_config(self, **changes) -> dict | None:
        """Validated now (ValueError keeps the old config). An idle engine applies it at once and its reconfiguration
        record comes back (with an "error" key if the new pool could not be built); a busy one applies it at its
        next step boundary, and None comes back."""
        return self._call(self._update_config, changes)

    def config_view(self) -> ConfigView:
        """What the engine runs once pending changes apply; readable even after the engine thread stopped."""
        return self._config_view

    def snapshot(self) -> EngineSnapshot:
        return self._snapshot

    def pause(self) -> None:
        self._call(self._set_paused, True)

    def resume(self) -> None:
        self._call(self._set_paused, False)

    def step_once(self) -> EngineSnapshot:
        """While paused: run exactly one step and return the snapshot after it."""
        done: Future = Future()
        self._call(self._allow_step, done)
        return done.result(timeout=120)

    def shutdown(self, reason: str = "the engine was shut down (restarted)") -> None:
        """Stop the engine thread; every request still open ends with an error saying `reason`."""
        self._stop_reason = reason
        self._stop.set()
        self._commands.put((lambda: None, None))
        if self._ended.wait(timeout=30):  # a stream still open would otherwise wait for a step that never comes
            self._fail_all(reason)

    @property
    def alive(self) -> bool:
        return not self._ended.is_set() and self.error is None

    @property
    def stopped_because(self) -> str:
        """Why the engine thread stopped (its error, or what shutdown() was told); meaningful once not alive."""
        return self.error or self._stop_reason

    # ---- the engine thread ---------------------------------------------------------------------------
    def _call(self, fn: Callable, *args, **kwargs):
        if not self.alive:
            raise EngineStopped(f"the engine thread has stopped: {self.stopped_because}")
        future: Future = Future()
        self._commands.put((lambda: fn(*args, **kwargs), future))
        return future.result(timeout=120)

    def _add(self, prompt, params, sink, priority: int = 0) -> tuple[str, OutputSink]:
        waiting = len(self.engine.scheduler.waiting)
        if self.max_waiting_requests is not None and waiting >= self.max_waiting_requests:
            raise ServiceBusy(f"busy: {waiting} requests are already waiting for the engine "
                              f"(max_waiting_requests={self.max_waiting_requests}); retry in a moment")
        self.reconfig.check_request(prompt, params, priority)  # it must fit a change about to apply too
        rid = self.engine.add_request(prompt, params, priority=priority)
        q = sink if sink is not None else queue.Queue()
        self._streams[rid] = q
        if self.paused:  # no step will refresh the snapshot: the queue chart and /metrics show the request now
            self._refresh()
        return rid, q

    def _update_config(self, changes: dict) -> dict | None:
        self.reconfig.update(changes, self.engine)
        # Idle, no step would come to apply it: the form would show the old values and send them back.
        record = None if self.engine.has_unfinished() else self.reconfig.apply(self.engine)
        self._note_reconfig(time.time())
        self._refresh()
        return record

    def _refresh(self) -> None:
        """A new snapshot and configuration view for the page, /metrics and step_once to read."""
        self._snapshot = self.engine.snapshot()
        self._config_view = self._view_config()
        self._snapshot_at = time.perf_counter()

    def _view_config(self) -> ConfigView:
        requested, resolved = self.reconfig.pending_view()
        return ConfigView(requested.to_dict(), resolved.to_dict(), self.reconfig.automatic_sizes(requested),
                          self.reconfig.requested.to_dict())

    def _set_paused(self, paused: bool) -> None:
        self.paused = paused

    def _abort(self, request_id: str) -> None:
        self.engine.abort(request_id)
        if not self._should_step():  # paused, or that was the last request: no step will refresh the snapshot,
            self._refresh()  # and the queues would show it waiting on

    def _allow_step(self, done: Future) -> None:
        self._step_waiters.append(done)

    def _run_commands(self, block: bool) -> None:
        try:
            fn, future = self._commands.get(timeout=0.05 if block else 0)
        except queue.Empty:
            return
        while True:
            try:
                result = fn()
                if future is not None:
                    future.set_result(result)
            except Exception as exc:  # bad input: the caller gets the error, the engine carries on
                if future is None:
                    raise
                future.set_exception(exc)
            try:
                fn, future = self._commands.get_nowait()
            except queue.Empty:
                return

    def _should_step(self) -> bool:
        return bool(self._step_waiters) or (not self.paused and self.engine.has_unfinished())

    def _run(self) -> None:
        try:
            self._loop()
        finally:
            self._ended.set()

    def _loop(self) -> None:
        try:
            while not self._stop.is_set():
                if not self._should_step() and self._snapshot.step != self.engine.step_count:
                    self._refresh()  # idle or paused now: the page shows the engine as it stays
                self._run_commands(block=not self._should_step())
                if not self._should_step():  # the commands just run may have paused it or added work
                    continue
                t0 = time.perf_counter()
                self.reconfig.apply(self.engine)  # a waiting change, between two steps
                outputs = self.engine.step()
                self._publish(outputs, (time.perf_counter() - t0) * 1e3)
                if self._step_waiters:
                    self._step_waiters.popleft().set_result(self._snapshot)
        except Exception as exc:
            self.error = f"{type(exc).__name__}: {exc}"
            traceback.print_exc()
            self._fail_all(self.error)

    def _publish(self, outputs: list[RequestOutput], step_ms: float) -> None:
        stats = self._iteration_stats(outputs)
        tpots = [out.metrics.tpot for out in outputs if out.finished and out.metrics.tpot is not None]
        for out in outputs:
            q = self._streams.get(out.request_id)
            if q is not None:
                try:
                    q.put(out)
                except Exception:  # the sink's consumer is gone (its event loop closed): nobody reads the request
                    traceback.print_exc()
                    self._streams.pop(out.request_id, None)
                    self.engine.abort(out.request_id)
                    continue
                if out.finished:
                    del self._streams[out.request_id]
        changed = self._note_reconfig(time.time() - step_ms / 1e3)  # a change applies at the start of a step
        prev, now = self._counters, self.engine.counters()
        self._counters = now
        self._add_counter_deltas(stats, prev, now)
        ttfts = stats.time_to_first_tokens
        self.history.append(HistorySample(
            now.step, now.num_running, now.num_waiting, now.num_preemptions, now.kv_blocks_used,
            now.prefix_cache_queries, now.prefix_cache_hits, now.generation_tokens_total, time=time.time(),
            step_ms=step_ms, ttft_s=sum(ttfts) / len(ttfts) if ttfts else None,
            tpot_s=sum(tpots) / len(tpots) if tpots else None, num_started=len(ttfts),
            num_finished=len(stats.finished), prompt_tokens=stats.num_prompt_tokens))
        # the whole snapshot at most every SNAPSHOT_INTERVAL_S while stepping; at once for step_once, a configuration
        # change, or the last step before idling
        if (changed or self._step_waiters or not self._should_step()
                or time.perf_counter() - self._snapshot_at >= SNAPSHOT_INTERVAL_S):
            self._refresh()
        self._tell_listeners(stats)

    def _tell_listeners(self, stats: IterationStats) -> None:
        for listener in list(self.stat_listeners):
            try:
                listener(stats)
            except Exception:  # a broken listener (the metrics) must not stop the engine
                traceback.print_exc()

    def _iteration_stats(self, outputs: list[RequestOutput]) -> IterationStats:
        """Token counts and latencies of this step's outputs. A request's first tokens give its time to first
        token (and count its prompt); later ones an inter-token latency since its previous ones."""
        now, stats = time.perf_counter(), IterationStats()
        for out in outputs:
            rid, num_tokens = out.request_id, len(out.token_ids)
            last = self._progress.get(rid)
            new = num_tokens - (last[1] if last else 0)
            if new > 0:
                if last is None:
                    stats.num_prompt_tokens += len(out.prompt_token_ids)
                    if out.metrics.ttft is not None:
                        stats.time_to_first_tokens.append(out.metrics.ttft)
                else:
                    stats.inter_token_latencies.append(now - last[0])
                stats.num_generation_tokens += new
                self._progress[rid] = (now, num_tokens)
            if out.finished:
                self._progress.pop(rid, None)
                m = out.metrics
                stats.finished.append(FinishedRequestStats(out.finish_reason or "error",
                                                           (m.finished_time or now) - m.arrival_time,
                                                           len(out.prompt_token_ids), num_tokens))
        return stats

    @staticmethod
    def _add_counter_deltas(stats: IterationStats, prev: EngineCounters, now: EngineCounters) -> None:
        """The engine's own counters (preemptions, prefix cache, drafts), as what this step added to them."""
        for name in ("num_preemptions", "prefix_cache_queries", "prefix_cache_hits", "spec_num_drafts",
                     "spec_num_draft_tokens", "spec_num_accepted_tokens"):
            setattr(stats, name, max(0, getattr(now, name) - getattr(prev, name)))

    def _note_reconfig(self, when: float) -> bool:
        """Record the last reconfiguration if it is new; whether it was."""
        record = self.reconfig.last
        if record is None or record is self._seen_reconfig:
            return False
        self._seen_reconfig = record
        self.config_changes.append(ConfigChange(when, record["step"], dict(record["changes"]), record["action"],
                                                record.get("error")))
        return True

    def _fail_all(self, reason: str) -> None:
        """The engine thread ended: end every open stream with an error instead of leaving it hanging, and count
        each as aborted (vLLM's request_success{finished_reason="abort"}), as a client's abort is."""
        now, ended = time.perf_counter(), IterationStats()
        for rid in self._streams:
            req = self.engine.requests.get(rid)
            if req is not None:
                ended.finished.append(FinishedRequestStats("abort", now - req.metrics.arrival_time,
                                                           req.num_prompt_tokens, req.num_output_tokens))
        if ended.finished:
            self._tell_listeners(ended)
        for rid, q in list(self._streams.items()):
            with contextlib.suppress(Exception):  # one gone consumer must not keep the others waiting
                q.put(RequestOutput(rid, None, [], "", [], True, "error", RequestMetrics(time.perf_counter()),
                                    error=reason))
        self._streams.clear()
        self._progress.clear()
        while True:
            try:
                _, future = self._commands.get_nowait()
            except queue.Empty:
                break
            if future is not None:
                future.set_exception(EngineStopped(f"the engine thread has stopped: {reason}"))
