"""The chat tab's side of the playground: a conversation streamed from the engine, the tab's live view of its own
request, and why a reply waits. A mixin of Playground (playground/handlers.py), which holds the shared state."""
from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future
from dataclasses import dataclass, field, replace

from engine import SamplingParams
from viz.dashboard import ChatView

from . import conversation
from .conversation import QUEUED, WARNING
from .identity import Who

QUEUED_NOTE = f"{QUEUED} queued: the engine is paused (step mode). Press Step or Resume on the Step mode tab to run it."
PENDING_S = 120.0  # a message sent this long ago whose chat never started (cancelled in gradio's queue) is given up
# a message submitted as it left the box (ChatHandlers.presubmit) whose chat has not come for it by then is aborted:
# the tab closed, or gradio's queue holds its chat (which then submits it again)
UNCLAIMED_S = 30.0
_PRESUBMITTED = threading.Lock()  # a tab's ChatSession.presubmitted: claimed once, by its chat or by a drop
# a reply's text is sent to the page at most this often (the newest text each time, nothing dropped): each update
# re-renders the whole reply in every browser that shows it, and a fast engine made hundreds a second
FRAME_S = 0.05
# and the room's streaming replies together at most this often a second: each update is the server's work too,
# under the lock the engine's step needs, and a flood of them kept a newcomer waiting. The first is never held.
ROOM_FRAMES_PER_S = 80.0


class FrameRate:
    """How often each streaming reply is sent: FRAME_S, slower while many stream (ROOM_FRAMES_PER_S in all)."""

    def __init__(self, room_per_s: float = ROOM_FRAMES_PER_S, fastest_s: float = FRAME_S) -> None:
        self.room_per_s, self.fastest_s = room_per_s, fastest_s
        self.streaming = 0
        self._lock = threading.Lock()

    def __enter__(self) -> FrameRate:
        with self._lock:
            self.streaming += 1
        return self

    def __exit__(self, *exc) -> None:
        with self._lock:
            self.streaming -= 1

    def interval(self) -> float:
        return max(self.fastest_s, self.streaming / self.room_per_s)


@dataclass
class ChatSession:
    """One browser tab's chat, kept in its gr.State and changed in place: the tab's live view (another event of the
    same session, polling) sees at once which request is this tab's, and whether one is on its way."""
    request_id: str | None = None  # the engine's id of the tab's latest reply
    sent: int = 0  # messages sent (counted as the live view starts polling)
    handled: int = 0  # chats that ended (replied, refused, stopped): while fewer than sent, a reply is on its way
    sent_at: float = 0.0
    refused: str = ""  # why the tab's latest message was refused ("" when it was not): its live view says so
    presubmitted: Presubmitted | None = None  # the message the box gave up, already submitted; its chat claims it

    def expecting(self) -> bool:
        return self.handled < self.sent and time.monotonic() - self.sent_at < PENDING_S


@dataclass
class Submitted:
    """A chat's message in the engine: its request, its stream, and the service that runs it."""
    rid: str
    stream: object
    trimmed: str  # what the stats line says was left out of the conversation ("" when nothing was)
    service: object


@dataclass
class Presubmitted:
    """A page's message submitted by the event that took it out of the box, so that the engine reads the prompt
    while the page's streaming event (the chat) is still on its way through gradio's queue; that chat claims it."""
    message: str
    audience: Who | None  # whose seat it holds (None: the presenter's or a desk's, which take none)
    submitted: Future = field(default_factory=Future)  # -> Submitted, or what the submit raised
    timer: threading.Timer | None = None


class ChatHandlers:
    """chat, chat_sent, presubmit, chat_view, queued_note: what a chat tab's events call."""

    def chat(self, message: str, history: list[dict], temperature: float = 0.7, max_tokens: int = 256,
             session: ChatSession | None = None, audience: Who | None = None) -> Iterator[tuple[list[dict], str]]:
        """Stream the assistant's reply into the history; the second value is the reply's stats line.
        `audience`: the visitor when they are audience on a shared page, whose share of the engine is bounded
        (self.seats: replies in flight, theirs and their address's; max_tokens)."""
        claimed = self._claim(session, message)
        seated, priority, ended = False, 0, False

        def end() -> None:  # the chat is over for its tab: said as its last output goes, once (again in finally)
            nonlocal seated, ended
            if seated:
                seated = False
                self.seats.give_back(audience)
            if session is not None and not ended:
                ended = True
                session.handled += 1
        try:
            if claimed is not None:  # submitted as it left the box: its seat is taken, its max_tokens capped
                seated, audience = claimed.audience is not None, claimed.audience
                yield from self._chat(message, history, temperature, max_tokens, session, claimed=claimed, end=end)
                return
            if message and (why := self.message_refused(message)):
                if session is not None:  # the live view stops showing the last reply as this tab's, and says why
                    session.request_id, session.refused = None, why
                yield list(history or []) + [{"role": "user", "content": message[:200] + "…"},
                                             {"role": "assistant", "content": f"{WARNING} {why}"}], ""
                return
            if audience is not None and message and message.strip():
                max_tokens = min(int(max_tokens), self.seats.max_tokens)
                try:
                    priority = self.seats.take(audience)
                    seated = True
                except ValueError as exc:
                    yield list(history or []) + [{"role": "user", "content": message},
                                                 {"role": "assistant", "content": f"{WARNING} {exc}"}], ""
                    return
            if (remote := self.remote) is not None:
                yield from remote.chat(message, history, temperature, max_tokens)
            else:
                yield from self._chat(message, history, temperature, max_tokens, session, priority, end=end)
        finally:
            end()

    def presubmit(self, message: str, history: list[dict], temperature: float, max_tokens: int,
                  session: ChatSession, audience: Who | None = None) -> None:
        """Submit a page's message as its box empties (outside gradio's queue), for the chat that follows to claim:
        the engine reads the prompt while the chat's own event is still in the queue. Nothing is submitted where
        the chat would first have something to say (refused, no seat free, a watched server, a rebuild)."""
        if (self.remote is not None or self.rebuilding is not None or self.message_refused(message)
                or (turn := conversation.next_turn(message, history)) is None):
            return
        priority = 0
        if audience is not None:
            max_tokens = min(int(max_tokens), self.seats.max_tokens)
            try:
                priority = self.seats.take(audience)
            except ValueError:
                return  # the chat asks again, and says why
        pre = Presubmitted(message, audience)

        def submit() -> None:
            try:
                sub = self._submit(turn[0], temperature, max_tokens, priority)
                session.request_id, session.refused = sub.rid, ""  # the tab's live view shows it from now on
                pre.submitted.set_result(sub)
            except BaseException as exc:  # the chat that claims it shows it, as its own submit's
                pre.submitted.set_exception(exc)
        self.drop_presubmitted(session)  # one never claimed (its chat cancelled in the queue)
        session.presubmitted = pre
        pre.timer = threading.Timer(UNCLAIMED_S, self.drop_presubmitted, (session, pre))
        pre.timer.daemon = True
        pre.timer.start()
        threading.Thread(target=submit, daemon=True, name="presubmit").start()

    def drop_presubmitted(self, session: ChatSession, only: Presubmitted | None = None) -> None:
        """Abort the tab's message submitted as it left the box and not claimed by a chat (Stop, Clear, a closed
        tab), and give its seat back, once its submit has returned."""
        with _PRESUBMITTED:
            pre = session.presubmitted
            if pre is None or (only is not None and pre is not only):
                return
            session.presubmitted = None
        if pre.timer is not None:
            pre.timer.cancel()

        def drop(done: Future) -> None:
            sub = None if done.exception() else done.result()
            if sub is not None and sub.service.is_streaming(sub.rid):
                sub.service.abort(sub.rid)
            if pre.audience is not None:
                self.seats.give_back(pre.audience)
        pre.submitted.add_done_callback(drop)

    @staticmethod
    def _claim(session: ChatSession | None, message: str) -> Presubmitted | None:
        with _PRESUBMITTED:
            pre = session.presubmitted if session is not None else None
            if pre is None or pre.message != message:
                return None
            session.presubmitted = None
        if pre.timer is not None:
            pre.timer.cancel()
        return pre

    def message_refused(self, message: str) -> str:
        """Why a chat message is refused unread ("" when it is not): one longer than the context could hold."""
        if (remote := self.remote) is not None:
            return "" if len(message) <= conversation.MAX_REMOTE_CHARS else (
                f"your message is {len(message):,} characters: at most {conversation.MAX_REMOTE_CHARS:,} are sent "
                f"to {remote.url}")
        return conversation.too_long(message, self.service.config_view().resolved)

    def chat_sent(self, session: ChatSession) -> None:
        """A tab sent a message: its live view keeps polling until the chat for it has ended."""
        session.sent += 1
        session.sent_at = time.monotonic()

    def _chat(self, message: str, history: list[dict], temperature: float, max_tokens: int,
              session: ChatSession | None, priority: int = 0, claimed: Presubmitted | None = None,
              end=lambda: None) -> Iterator[tuple[list[dict], str]]:
        if (turn := conversation.next_turn(message, history)) is None:
            yield list(history or []), ""
            return
        messages, history = turn
        if claimed is None and (rebuilding := self.rebuilding) is not None:  # wait for the new engine
            yield history + [{"role": "assistant", "content": f"{QUEUED} queued: {rebuilding}; the reply starts "
                                                               f"when the new engine is up"}], "queued"
            self._engine_up.wait(PENDING_S)
        try:
            sub = (claimed.submitted.result() if claimed is not None
                   else self._submit(messages, temperature, max_tokens, priority))
            if session is not None:
                session.request_id, session.refused = sub.rid, ""
            service, trimmed = sub.service, sub.trimmed
            try:
                if note := self.queued_note():  # say so now rather than show an empty reply until the engine runs
                    yield history + [{"role": "assistant", "content": note}], trimmed + "queued"
                else:  # the message shows at once, before the first token
                    yield history, trimmed + "sent, waiting for the first token"
                history = history + [{"role": "assistant", "content": ""}]
                with self.frames:
                    yield from self._stream(service, sub.rid, sub.stream, history, trimmed, end)
            finally:  # Stop pressed or tab closed, even while queued: abort the request now, freeing its blocks
                if service.is_streaming(sub.rid):
                    service.abort(sub.rid)
        except (ValueError, RuntimeError) as exc:  # too long, bad settings, engine down: say so in the chat
            if session is not None:  # and beside it: the live view no longer shows the previous reply as current
                session.request_id, session.refused = None, str(exc)
            history = [m for m in history if m.get("content") != ""]
            history.append({"role": "assistant", "content": f"{WARNING} {exc}"})
            yield history, ""

    def _submit(self, messages: list[dict], temperature: float, max_tokens: int, priority: int) -> Submitted:
        """The conversation into the engine, its oldest turns left out where it no longer fits max_model_len."""
        config = self.service.snapshot().config
        prompt, dropped = conversation.fit(messages, self.llm.apply_chat_template,
                                           conversation.prompt_budget(config, int(max_tokens)))
        oldest = "the oldest turn" if dropped == 1 else f"the {dropped} oldest turns"
        trimmed = f"too long for max_model_len {config['max_model_len']}: left out {oldest} · " if dropped else ""
        service = self.service
        rid, q = service.submit(prompt, SamplingParams(temperature=float(temperature), max_tokens=int(max_tokens),
                                                       seed=None), priority=priority)
        return Submitted(rid, q, trimmed, service)

    def _stream(self, service, rid: str, q, history: list[dict], trimmed: str,
                end=lambda: None) -> Iterator[tuple[list[dict], str]]:
        """The reply's updates, the newest text at most once a frame (self.frames: slower while the room streams
        many); the first and the last never wait. `end()` runs before the last is sent: a page that shows the reply
        finished may send its next message at once (gradio closes this generator only after the page has it)."""
        for out in service.follow(rid, q, latest=True):
            if out.error:
                history[-1]["content"] += f"{conversation.ENGINE_ERROR}{out.error}]"
                replaced = self.rebuilding is not None or self.service is not service
                yield history, ("ended by an engine restart: send the message again" if replaced else
                                "the engine stopped; restart it from the Engine settings tab")
                return
            history[-1]["content"] = out.text
            if out.finished:
                self.replies.append(out.text)
                end()
            shown = time.monotonic()
            yield history, trimmed + reply_stats(out)
            if not out.finished:  # what arrives meanwhile is taken as one update, the newest
                time.sleep(max(0.0, self.frames.interval() - (time.monotonic() - shown)))

    def chat_view(self, session: ChatSession | None) -> tuple[ChatView, bool]:
        """A chat tab's live view (the block table with its request highlighted, from the shared figure cache), and
        whether to keep polling: its reply still streams, one is on its way, or the view drawn still shows it."""
        if (remote := self.remote) is not None:
            return remote.chat_view(), False
        service, rid = self.service, session.request_id if session else None
        streaming = rid is not None and service.is_streaming(rid)
        view = self.figures.chat_view(service.snapshot(), service.history, rid, streaming, service.config_changes,
                                      service.replaced_at)
        polling = streaming or view.in_snapshot or bool(session and session.expecting())
        if rid is not None and rid in (waiting := service.snapshot().waiting):
            view = replace(view, summary=f"⏳ your request waits for a seat: place {waiting.index(rid) + 1} of "
                                         f"{len(waiting)} in the queue\n\n{view.summary}")
        if session is not None and session.refused:
            view = replace(view, summary=f"{WARNING} your last message was refused, nothing of it reached the "
                                         f"engine: {session.refused}\n\n{view.summary}")
        return view, polling

    def queued_note(self) -> str:
        """Why a request just sent will wait before its first token ("" when it will not)."""
        if (measuring := self.measurement) is not None:
            return (f"{QUEUED} queued behind a measurement ({measuring.describe()}): the reply starts when it ends "
                    f"(or press Cancel on its tab)")
        return QUEUED_NOTE if self.service.paused else ""


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
