"""What the playground's buttons, chats and timers do. No gradio layout here; functions return plain values.

The live engine runs in an EngineService thread; ablation and comparison runs build their own engines over
the same loaded weights, with the live engine paused meanwhile so their measurements are clean.
"""
from __future__ import annotations

import contextlib
import json
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path

from engine import LLM, EngineConfig, SamplingParams, bench
from engine.config import BUILT_SWITCHES, WEIGHT_FIELDS
from engine.gpu import resolve_dtype
from engine.models.linear import WeightFormat
from engine.models.loader import cache_dir
from engine.service import DEFAULT_MAX_WAITING_REQUESTS, EngineService, IterationStats
from engine.workloads import list_workloads, load_workload
from viz.dashboard import ChatView, DashboardFigures, FigureCache

from . import conversation
from .access import Seats
from .conversation import QUEUED, WARNING
from .remote import NOT_REMOTE, RemoteServer
from .room import Room, describe_changes, plain
from .stepmode import describe_step, plural
from .traffic import TrafficGenerator, TrafficStatus

SIZE_FIELDS = ["block_size", "num_kv_blocks", "max_num_seqs", "max_num_batched_tokens", "max_model_len"]
# the KV pool's element type, and whether an int8 pool's keys are smoothed: a pool rebuild, like its size
KV_DTYPE_FIELDS = ("kv_cache_dtype", "kv_cache_smoothing")
AUTOMATIC_FIELDS = {"num_kv_blocks": "blocks", "max_num_batched_tokens": "tokens", "max_model_len": "tokens"}
ProgressFn = Callable[[float, str], None]
QUEUED_NOTE = f"{QUEUED} queued: the engine is paused (step mode). Press Step or Resume on the Step mode tab to run it."
PENDING_S = 120.0  # a message sent this long ago whose chat never started (cancelled in gradio's queue) is given up
NO_QUANTIZATION = "none"  # the form's word for quantization=None (a dropdown cannot hold None)
# A new engine, in the order they happen: the first only for a change of the weights, while the old one serves.
REBUILD_STAGES = ("loading and quantizing the weights (the engine keeps serving meanwhile)",
                  "building the engine with its KV pool (the old one has stopped)", "warming up")
ENDED_BY_REBUILD = "the engine was rebuilt ({what}): this request was ended; send it again"


@dataclass
class ChatSession:
    """One browser tab's chat, kept in its gr.State and changed in place: the tab's live view (another event of the
    same session, polling) sees at once which request is this tab's, and whether one is on its way."""
    request_id: str | None = None  # the engine's id of the tab's latest reply
    sent: int = 0  # messages sent (counted as the live view starts polling)
    handled: int = 0  # chats that ended (replied, refused, stopped): while fewer than sent, a reply is on its way
    sent_at: float = 0.0
    refused: str = ""  # why the tab's latest message was refused ("" when it was not): its live view says so

    def expecting(self) -> bool:
        return self.handled < self.sent and time.monotonic() - self.sent_at < PENDING_S


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

    def report(self, done: int, total: int, current: str) -> None:
        """bench's progress callback, called before each configuration and once at the end."""
        self.done, self.total, self.current = done, total, current
        if self.progress:
            self.progress(done / total, f"{self.describe()} · running: {current}")

    def describe(self) -> str:
        elapsed = time.monotonic() - self.started
        left = f"~{elapsed / self.done * (self.total - self.done):.0f} s left" if self.done else "estimating time left"
        return f"{self.name}: {self.done}/{self.total} configurations, {left}"


def ablation_store() -> Path:
    return cache_dir() / "last-ablation.json"


class Playground:
    def __init__(self, llm: LLM, store: Path | None = None,
                 max_waiting_requests: int | None = DEFAULT_MAX_WAITING_REQUESTS) -> None:
        """`max_waiting_requests`: beyond it a new request (chat, traffic, API) is refused as busy, to retry."""
        self.llm = llm
        self.max_waiting_requests = max_waiting_requests
        # after every step (the metrics endpoint adds them up); the same list goes to the engine after a restart
        self.stat_listeners: list[Callable[[IterationStats], None]] = []
        self.service = self._new_service(llm.engine)
        self.figures = FigureCache()
        self.store = store or ablation_store()
        self._exclusive = threading.Lock()  # one ablation / comparison at a time
        self.measurement: Measurement | None = None  # the one running now, for every tab's status line
        self.replies: deque[str] = deque(maxlen=32)  # final texts of recent chat replies
        self.traffic = TrafficGenerator(lambda: self.service)  # the live service, even after a restart
        self.remote: RemoteServer | None = None  # attached: the dashboard and the chat show that server instead
        self.attach_error = ""  # why the last attach failed, for the status line
        self.rebuilding: str | None = None  # what a restart or a rebuild is doing now, for every tab's status line
        self._engine_up = threading.Event()  # cleared while the engine is replaced: a chat sent meanwhile waits
        self._engine_up.set()
        self.room = Room()  # who changed what, for every visitor's status line
        self.seats = Seats()  # the audience's fair shares of the engine (public and token modes)

    # ---- another server ------------------------------------------------------------------------------------
    def attach(self, url: str) -> str:
        """Point the dashboard and the chat at another server (OpenAI API + vLLM's /metrics). A server that is
        not there, or has no vLLM metrics, is refused with the reason, and the page keeps showing what it did."""
        try:
            remote = RemoteServer(url)
            remote.connect()
        except ValueError as exc:
            self.attach_error = f"could not attach to {plain(url, 80)}: {plain(exc)}"
            return f"{WARNING} {self.attach_error}"
        self.detach()
        remote.start()
        self.remote, self.attach_error = remote, ""
        self.room.note(f"attached the page to {remote.url}")
        return (f"Attached to {plain(remote.url)}" + (f" (model {plain(remote.model)})" if remote.model else "")
                + ": the dashboard's queue, KV, prefix and throughput charts and the chat now show that server.")

    def detach(self) -> str:
        remote, self.remote, self.attach_error = self.remote, None, ""
        if remote is None:
            return "Not attached: the page shows the engine in this process."
        remote.stop()
        self.room.note(f"detached the page from {remote.url}")
        return f"Detached from {plain(remote.url)}: the page shows the engine in this process again."

    def local_only(self, what: str) -> str | None:
        """Why `what` cannot run now (it needs this process's engine and a remote server is attached), or None."""
        if self.remote is None:
            return None
        return f"{WARNING} {what}: {NOT_REMOTE} ({self.remote.url}); detach on the Remote server tab first."

    # ---- chat --------------------------------------------------------------------------------------------
    def chat(self, message: str, history: list[dict], temperature: float = 0.7, max_tokens: int = 256,
             session: ChatSession | None = None, audience: str | None = None) -> Iterator[tuple[list[dict], str]]:
        """Stream the assistant's reply into the history; the second value is the reply's stats line.
        The model sees the conversation without the playground's notes (warnings, "queued"), and without its
        oldest turns when it no longer fits max_model_len (the stats line says so).
        `session`: the tab's ChatSession; its request_id becomes the engine's id for this reply as soon as the
        request is submitted (the tab's live view highlights that request).
        `audience`: the visitor's key when they are audience on a shared page: their share of the engine is
        bounded (self.seats: replies in flight, max_tokens)."""
        seated = False
        try:
            if audience is not None and message and message.strip():
                if int(max_tokens) > self.seats.max_tokens:
                    max_tokens = self.seats.max_tokens
                try:
                    self.seats.take(audience)
                    seated = True
                except ValueError as exc:
                    yield list(history or []) + [{"role": "user", "content": message},
                                                 {"role": "assistant", "content": f"{WARNING} {exc}"}], ""
                    return
            if (remote := self.remote) is not None:
                yield from remote.chat(message, history, temperature, max_tokens)
            else:
                yield from self._chat(message, history, temperature, max_tokens, session)
        finally:
            if seated:
                self.seats.give_back(audience)
            if session is not None:
                session.handled += 1

    def chat_sent(self, session: ChatSession) -> None:
        """A tab sent a message: its live view keeps polling until the chat for it has ended."""
        session.sent += 1
        session.sent_at = time.monotonic()

    def _chat(self, message: str, history: list[dict], temperature: float, max_tokens: int,
              session: ChatSession | None) -> Iterator[tuple[list[dict], str]]:
        history = list(history or [])
        if not message or not message.strip():
            yield history, ""
            return
        messages = conversation.for_model(history) + [{"role": "user", "content": message}]
        history = history + [{"role": "user", "content": message}]
        if (rebuilding := self.rebuilding) is not None:  # the engine is being replaced: wait for the new one
            yield history + [{"role": "assistant", "content": f"{QUEUED} queued: {rebuilding}; the reply starts "
                                                               f"when the new engine is up"}], "queued"
            self._engine_up.wait(PENDING_S)
        try:
            config = self.service.snapshot().config
            prompt, dropped = conversation.fit(messages, self.llm.apply_chat_template,
                                               conversation.prompt_budget(config, int(max_tokens)))
            oldest = "the oldest turn" if dropped == 1 else f"the {dropped} oldest turns"
            trimmed = f"too long for max_model_len {config['max_model_len']}: left out {oldest} · " if dropped else ""
            service = self.service
            rid, q = service.submit(prompt, SamplingParams(temperature=float(temperature), max_tokens=int(max_tokens),
                                                           seed=None))
            if session is not None:
                session.request_id, session.refused = rid, ""
            try:
                if note := self.queued_note():  # say so now rather than show an empty reply until the engine runs
                    yield history + [{"role": "assistant", "content": note}], trimmed + "queued"
                else:  # the message shows at once, before the first token
                    yield history, trimmed + "sent, waiting for the first token"
                history = history + [{"role": "assistant", "content": ""}]
                for out in service.follow(rid, q, latest=True):
                    if out.error:
                        history[-1]["content"] += f"\n\n[engine error: {out.error}]"
                        replaced = self.rebuilding is not None or self.service is not service
                        yield history, ("ended by an engine restart: send the message again" if replaced else
                                        "the engine stopped; restart it from the Engine settings tab")
                        return
                    history[-1]["content"] = out.text
                    if out.finished:
                        self.replies.append(out.text)
                    yield history, trimmed + reply_stats(out)
            finally:  # Stop pressed or tab closed, even while queued: abort the request now, freeing its blocks
                if service.is_streaming(rid):
                    service.abort(rid)
        except (ValueError, RuntimeError) as exc:  # too long, bad settings, engine down: say so in the chat
            if session is not None:  # and beside it: the live view no longer shows the previous reply as current
                session.request_id, session.refused = None, str(exc)
            history = [m for m in history if m.get("content") != ""]
            history.append({"role": "assistant", "content": f"{WARNING} {exc}"})
            yield history, ""

    # ---- dashboard -------------------------------------------------------------------------------------
    def dashboard(self) -> DashboardFigures:
        if (remote := self.remote) is not None:
            return remote.figures()
        return self.figures.get(self.service.snapshot(), self.service.history, self.service.config_changes)

    def chat_view(self, session: ChatSession | None) -> tuple[ChatView, bool]:
        """A chat tab's live view (the block table with its request highlighted, from the shared figure cache), and
        whether to keep polling: its reply still streams, one is on its way, or the view drawn still shows it."""
        if (remote := self.remote) is not None:
            return remote.chat_view(), False
        service, rid = self.service, session.request_id if session else None
        streaming = rid is not None and service.is_streaming(rid)
        view = self.figures.chat_view(service.snapshot(), service.history, rid, streaming, service.config_changes)
        polling = streaming or view.in_snapshot or bool(session and session.expecting())
        if rid is not None and rid in (waiting := service.snapshot().waiting):
            view = replace(view, summary=f"⏳ your request waits for a seat: place {waiting.index(rid) + 1} of "
                                         f"{len(waiting)} in the queue\n\n{view.summary}")
        if session is not None and session.refused:
            view = replace(view, summary=f"{WARNING} your last message was refused, nothing of it reached the "
                                         f"engine: {session.refused}\n\n{view.summary}")
        return view, polling

    def status(self) -> str:
        if (remote := self.remote) is not None:
            return remote.status()
        snap = self.service.snapshot()
        measuring = self.measurement
        state = (f"⟳ {self.rebuilding}" if self.rebuilding else
                 "⛔ engine thread stopped: " + self.service.error if self.service.error else
                 f"⏸ paused for a measurement ({measuring.describe()})" if measuring else
                 "⏸ paused (step mode)" if self.service.paused else "▶ running")
        traffic = self.traffic.status()
        users = (f" · traffic: {traffic.num_users} users, " + (f"{traffic.elapsed_s:.0f}/{traffic.duration_s:.0f} s"
                 if traffic.duration_s else "each once") + f", {traffic.requests_done} done"
                 if traffic is not None and traffic.running else "")
        return (f"**{state}** · {snap.precision} · steps done: {snap.step} · running {snap.num_running} · "
                f"waiting {snap.num_waiting} · preemptions {snap.num_preemptions} · "
                f"KV {snap.kv_blocks_used}/{snap.kv_blocks_total} blocks · "
                f"prefix hits {snap.prefix_cache_hits}/{snap.prefix_cache_queries} tokens · "
                f"generated {plural(snap.generation_tokens_total, 'token')}{users}"
                + (f" · {WARNING} {self.attach_error}" if self.attach_error else "") + self.room_line())

    def room_line(self) -> str:
        """The latest change to the shared engine, for every visitor's status line ("" when none lately)."""
        notice = self.room.latest()
        return f"  \n**Latest change:** {plain(notice.describe())}" if notice else ""

    def queued_note(self) -> str:
        """Why a request just sent will wait before its first token ("" when it will not)."""
        if (measuring := self.measurement) is not None:
            return (f"{QUEUED} queued behind a measurement ({measuring.describe()}): the reply starts when it ends "
                    f"(or press Cancel on its tab)")
        return QUEUED_NOTE if self.service.paused else ""

    # ---- settings ----------------------------------------------------------------------------------------
    def settings(self) -> dict:
        """What the form shows: the configuration the engine runs once pending changes apply (so sending the form
        back never undoes one), with None for a size left automatic and for no quantization."""
        cfg = self.service.config_view().requested
        return {k: cfg[k] for k in (*BUILT_SWITCHES, *SIZE_FIELDS, *KV_DTYPE_FIELDS, *WEIGHT_FIELDS)}

    def weights_note(self) -> str:
        """What the weights are now, and what changing them does."""
        return (f"**Weights: {self.service.snapshot().precision}.** Changing the dtype or the quantization rebuilds "
                f"the model: the new weights are loaded from the same checkpoint (and quantized) while this engine "
                f"keeps serving, then the engine is rebuilt with its KV pool and warmed up. Requests running or "
                f"waiting at that moment are ended with a message (send them again); a chat sent during the "
                f"rebuild waits for the new engine. A change that is refused (a group size that does not divide a "
                f"layer, a scheme without a kernel here) leaves the engine and its requests as they were. The KV "
                f"cache's dtype changes without a rebuild: int8 holds ~4x the blocks of fp32 in the same memory; "
                f"kv_cache_smoothing (int8 only) rescales its keys per channel, calibrated once (about 2 s), which "
                f"halves what the int8 cache costs in quality.")

    def settings_hints(self) -> dict[str, str]:
        """For each size that may be left empty: what empty means, with the number the engine would use."""
        view = self.service.config_view()
        return {k: f"empty = automatic: {view.automatic[k]} {unit}"
                + ("" if view.requested[k] is None else f" (now set to {view.requested[k]})")
                for k, unit in AUTOMATIC_FIELDS.items()}

    def settings_note(self) -> str:
        """Changes still waiting for a step boundary, and a change that could not be applied."""
        view, notes = self.service.config_view(), []
        if view.pending:
            notes.append(f"⏳ waiting for the next step boundary: {_fields(view.pending)}")
        last = self.service.snapshot().last_reconfig
        if last and last.get("error"):
            notes.append(f"⚠️ step {last['step']}: {_fields(last['changes'])} could not be applied, the previous "
                         f"configuration kept serving: {last['error']}")
        return "\n\n".join(notes)

    def apply_settings(self, loaded: dict | None = None, progress: ProgressFn | None = None, **values) -> str:
        """Send only the fields the user changed: those that differ from the values the form was loaded with
        (`loaded`), so a stale field never undoes another change. Without `loaded` (an API call), every field
        that differs from what the engine will run is sent. `progress`: a rebuild's stages (weights changed)."""
        current = self.settings()
        base = {**current, **{k: self._config_value(k, v) for k, v in (loaded or {}).items() if k in current}}
        wanted = {k: self._config_value(k, v) for k, v in values.items() if k in current}
        changes = {k: v for k, v in wanted.items() if v != base[k] and v != current[k]}
        if not changes:
            return "Nothing changed."
        return self.local_only("Engine settings") or self._update(changes, progress)

    def reset_settings(self, progress: ProgressFn | None = None) -> str:
        """Every switch and size back to EngineConfig's defaults (sizes automatic), and so the weights."""
        defaults, current = EngineConfig(), self.settings()
        changes = {k: d for k, v in current.items() if (d := self._config_value(k, getattr(defaults, k))) != v}
        if note := self.local_only("Engine settings"):
            return note
        return self._update(changes, progress) if changes else "Already at the defaults."

    def _config_value(self, name: str, value):
        """_coerce, and dtype 'auto' as this device resolves it (so 'auto' for what runs now changes nothing)."""
        value = _coerce(name, value)
        return resolve_dtype(value, self.llm.engine.model.device) if name == "dtype" and value == "auto" else value

    def _update(self, changes: dict, progress: ProgressFn | None = None) -> str:
        if any(k in WEIGHT_FIELDS for k in changes):
            return self._change_weights(changes, progress)
        if not self.service.alive:  # the thread died: the change comes with a fresh engine
            return self.restart(changes)
        try:
            record = self.service.update_config(**changes)
        except ValueError as exc:
            return f"⚠️ Not applied, the engine keeps its previous configuration: {exc}"
        except RuntimeError:  # the thread died meanwhile
            return self.restart(changes)
        if record is None:
            self.room.note(describe_changes(changes) + " (at the next step)")
            return f"Applied at the next step boundary (requests are in flight): {_fields(changes)}."
        if record.get("error"):
            return f"⚠️ Not applied, the engine keeps its previous configuration: {record['error']}"
        self.room.note(describe_changes(changes))
        moved = record["requests_re_prefilled"]
        return f"Applied: {_fields(changes)}." + (f" Re-prefilled: {', '.join(moved)}." if moved else "")

    def _change_weights(self, changes: dict, progress: ProgressFn | None) -> str:
        """A change of the weights (WEIGHT_FIELDS) cannot apply while serving: the new weights are loaded first,
        the old engine serving meanwhile, then restart() replaces the engine. Anything refused before the old
        engine stops (a bad value, a group size that does not divide a layer, no kernel) leaves it untouched."""
        view, before = self.service.config_view(), self.service.snapshot().precision
        changes = {**view.pending, **changes}  # a change still waiting for a step is not lost with the engine
        weights = {k: v for k, v in changes.items() if k in WEIGHT_FIELDS}
        kept = f"⚠️ Not applied: the engine keeps its weights ({before}) and its requests"
        try:
            now, new = (bench.engine_config(self.llm, fields) for fields in (view.requested,
                                                                             {**view.requested, **changes}))
        except ValueError as exc:
            return f"{kept}: {exc}"
        if (now.dtype, WeightFormat.of(now)) == (new.dtype, WeightFormat.of(new)):
            rest = {k: v for k, v in changes.items() if k not in WEIGHT_FIELDS}
            why = (f"Not applied: {_fields(weights)} leaves the weights as they are ({before}; the group size "
                   f"applies to int4 only, quantize_lm_head to quantized weights only), so nothing is rebuilt.")
            return why + (f" {self._update(rest)}" if rest else "")
        if not self._exclusive.acquire(blocking=False):
            return f"{kept}: {self._busy()}; wait for it (or cancel it), then apply again."
        what = f"rebuilding the engine for {new.precision}"
        self._engine_up.clear()  # a chat sent from now on waits for the new engine rather than being ended
        try:
            self._stage(progress, 0, what)
            start = time.perf_counter()
            try:
                self.llm.weights_for(new)  # kept by the LLM: restart's build_engine takes these
            except (ValueError, MemoryError, RuntimeError) as exc:  # torch's out-of-memory is a RuntimeError
                return f"{kept}: {exc}"
            loaded = time.perf_counter() - start
            message, built, ended = self._restart(changes, progress, ENDED_BY_REBUILD.format(what=new.precision),
                                                  what)
        finally:
            self.rebuilding = None
            self._engine_up.set()
            self._exclusive.release()
        now_running = self.service.snapshot().precision
        self.room.note(f"rebuilt the engine for {now_running}")
        if not built:
            return f"⚠️ {new.precision} could not run here; the engine runs {now_running}. {message}"
        return (f"Rebuilt the engine for {now_running}: weights loaded in {loaded:.1f} s, engine built and warmed "
                f"up in {time.perf_counter() - start - loaded:.1f} s. " + (ended or "No request was open."))

    def restart(self, changes: dict | None = None) -> str:
        """A new engine thread over the same weights (after a crash, or to start clean). It comes back with the
        last configuration that ran (plus `changes`, for a change applied to a stopped engine); if that cannot
        be built, with the defaults. Never raises: the page must always get an engine back."""
        if note := self.local_only("Restarting the engine"):
            return note
        if self.rebuilding:
            return f"⚠️ Not restarted: {self._busy()}; it brings a new engine anyway."
        message = self._restart(changes)[0]
        self.room.note("restarted the engine" + (f" with {describe_changes(changes)}" if changes else ""))
        return message

    def _restart(self, changes: dict | None = None, progress: ProgressFn | None = None,
                 reason: str = "the engine was restarted: this request was ended; send it again",
                 what: str = "restarting the engine") -> tuple[str, bool, str]:
        """restart(), saying each stage to `progress` and the status line; requests still open end with `reason`.
        Returns the message, whether the engine came back with `changes` (the first attempt), and how many
        requests were ended, in words ("" for none)."""
        old = self.service
        self.rebuilding = what
        self._engine_up.clear()
        try:
            snap = old.snapshot()
            ended = snap.num_running + snap.num_waiting if old.alive else 0
            old.shutdown(reason)
            last = old.engine.requested_config.to_dict()
            attempts = [(f"with {_fields(changes)}", {**last, **changes})] if changes else []
            attempts += [("with the last configuration that ran", last), ("with the defaults", {})]
            failures = []
            for label, fields in attempts:
                try:
                    self._stage(progress, 1, what)
                    engine = bench.build_engine(self.llm, fields)
                    self._stage(progress, 2, what)
                    bench.warm_up(engine)  # a configuration that builds but cannot run a step is not back
                except Exception as exc:  # whatever went wrong, the next attempt may still work
                    failures.append(f"{label}: {exc}")
                    continue
                self.llm.engine = engine
                self.service = self._new_service(engine)
                lost = (f"{plural(ended, 'request')} running or waiting {'was' if ended == 1 else 'were'} ended "
                        f"(their chats say so: send them again)." if ended else "")
                return (f"Engine restarted {label}." + (f" ⚠️ Not possible {'; '.join(failures)}." if failures else "")
                        + (f" {lost}" if lost else ""), not failures and bool(changes), lost)
            return f"⛔ The engine could not be restarted: {'; '.join(failures)}", False, ""
        finally:
            self.rebuilding = None
            self._engine_up.set()

    def _stage(self, progress: ProgressFn | None, index: int, what: str) -> None:
        """A rebuild's stage, on the caller's progress bar and every tab's status line."""
        stage = f"{what}: {index + 1}/{len(REBUILD_STAGES)} {REBUILD_STAGES[index]}"
        self.rebuilding = stage
        if progress:
            progress(index / len(REBUILD_STAGES), stage)

    def _busy(self) -> str:
        running = self.measurement
        return (f"a measurement is running ({running.describe()})" if running else
                f"the engine is being rebuilt ({self.rebuilding})" if self.rebuilding else "a measurement is starting")

    def _new_service(self, engine) -> EngineService:
        return EngineService(engine, max_waiting_requests=self.max_waiting_requests,
                             stat_listeners=self.stat_listeners)

    # ---- traffic generator -----------------------------------------------------------------------------
    def start_traffic(self, workload_name: str, num_users: int, duration_s: float = 0.0) -> str:
        """N simulated users sending the workload's requests for duration_s (0: each once), in the background.
        Returns "" when started, or why not."""
        if note := self.local_only("The traffic generator (it loads this process's engine)"):
            return note
        try:
            workload = load_workload(workload_name).tokenized(self.llm.tokenizer)
            self.traffic.start(workload.name, workload.requests, int(num_users), float(duration_s or 0))
        except ValueError as exc:
            return f"⚠️ {exc}"
        self.room.note(f"started {plural(int(num_users), 'simulated user')} ({workload.name})")
        return ""

    def stop_traffic(self) -> str:
        if not self.traffic.stop():
            return "No traffic is running."
        self.room.note("stopped the simulated users")
        status = self.traffic.wait(timeout=10)
        return status.describe() if status else ""

    def watch_traffic(self, every_s: float = 1.0) -> Iterator[TrafficStatus]:
        """The run's status now, then every `every_s` until it ends (the last one says "done")."""
        while True:
            status = self.traffic.status()
            if status is None:
                return
            yield status
            if not status.running:
                return
            time.sleep(every_s)

    # ---- ablation and comparison ---------------------------------------------------------------------------
    def ablate(self, workload_name: str, quick: bool = True,
               progress: ProgressFn | None = None) -> list[bench.AblationRow]:
        """Raises bench.Cancelled if cancelled, ValueError if another measurement is running."""
        workload = load_workload(workload_name, quick)
        with self.measuring("ablation", len(bench.ABLATIONS) + 1, progress) as m:
            rows = bench.ablate(self.llm, workload, progress=m.report, should_stop=m.cancel.is_set)
        self.store.parent.mkdir(parents=True, exist_ok=True)
        self.store.write_text(json.dumps(bench.to_jsonable({"workload": workload.name, "quick": quick, "rows": rows})))
        return rows

    def last_ablation(self) -> list[bench.AblationRow]:
        try:
            return [bench.AblationRow(**r) for r in json.loads(self.store.read_text())["rows"]]
        except (OSError, ValueError, KeyError, TypeError):  # none yet, or written by an older version
            return []

    def compare(self, workload_name: str, spec_a: str, spec_b: str, quick: bool = True,
                progress: ProgressFn | None = None) -> bench.CompareResult:
        """Raises bench.Cancelled if cancelled, ValueError for a bad spec or if another measurement is running."""
        workload = load_workload(workload_name, quick)
        with self.measuring("comparison", 2, progress) as m:
            return bench.compare(self.llm, workload, spec_a, spec_b, progress=m.report, should_stop=m.cancel.is_set)

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

    # ---- step mode ---------------------------------------------------------------------------------------
    def pause(self) -> str:
        if note := self.local_only("Step mode"):
            return note
        self.service.pause()
        self.room.note("paused the engine (step mode)")
        return "Paused: the engine waits. Press Step to run exactly one step."

    def resume(self) -> str:
        if note := self.local_only("Step mode"):
            return note
        self.service.resume()
        self.room.note("resumed the engine")
        return "Running."

    def step(self) -> str:
        if note := self.local_only("Step mode"):
            return note
        if not self.service.paused:
            self.service.pause()
        snap = self.service.step_once()
        return describe_step(snap, self.llm.tokenizer)


def reply_stats(out) -> str:
    m = out.metrics
    parts = []
    if m.ttft is not None:
        parts.append(f"TTFT {m.ttft * 1e3:.0f} ms")
    if m.first_token_time is not None and m.num_generation_tokens > 1:
        elapsed = (m.finished_time or time.perf_counter()) - m.first_token_time
        if elapsed > 0:
            parts.append(f"{(m.num_generation_tokens - 1) / elapsed:.1f} tokens/s")
    parts.append(f"prefix cache: {m.num_cached_tokens} of {m.num_prompt_tokens} prompt tokens reused")
    if m.num_preemptions:
        parts.append(f"preempted {m.num_preemptions}x")
    if out.finished:
        parts.append(f"finished: {out.finish_reason}")
    return " · ".join(parts)


def feature_presets() -> list[str]:
    return bench.list_feature_presets()


def workloads() -> list[str]:
    return list_workloads()


def _coerce(name: str, value):
    """A form value as the config field wants it: gradio hands numbers back as floats (or strings from a
    dropdown), and an emptied number field as None, which means automatic for the sizes that allow it."""
    if name in BUILT_SWITCHES or isinstance(getattr(EngineConfig, name, None), bool):  # a switch: a checkbox's
        return bool(value)
    if name == "quantization" and value in (NO_QUANTIZATION, ""):
        return None
    if isinstance(value, str) and value.strip().isdigit():
        return int(value)
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value  # None, or something EngineConfig will refuse with a message


def form_value(name: str, value):
    """A setting as the form shows it (no quantization as NO_QUANTIZATION); _coerce turns it back."""
    return NO_QUANTIZATION if name == "quantization" and value is None else value


def _fields(changes: dict) -> str:
    return ", ".join(f"{k}={v}" for k, v in changes.items())
