"""Watching another server (the OpenAI API and vLLM's /metrics): `Watching`, a mixin of Playground attached for a
while (the Remote server tab), and `Watcher`, a page that only watches (`python app.py --attach URL`).
What a remote server says is never shown (playground/remote.py); every address and name goes through `plain`."""
from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable

from viz.dashboard import DashboardFigures

from .access import Access, Seats
from .chat import ChatHandlers
from .conversation import WARNING
from .remote import DEADLINE_S, NOT_REMOTE, RemoteServer
from .room import Room, plain

ATTACH_FAILED = "could not reach a metrics endpoint there (the reason is in the server's log)"
ATTACH_FAILS_AFTER_S = DEADLINE_S  # every failed attach answers after the longest a fetch may take
RETRY_S = 5.0  # `--attach` to a server that is not up yet (vllm serve takes minutes to start) asks again this often
log = logging.getLogger("watch_llm.remote")


class Watching:
    """attach, local_only and the room's line: what the playground and a watch-only page share."""
    remote: RemoteServer | None
    attach_error: str
    room: Room

    def attach(self, url: str) -> str:
        """Point the dashboard and the chat at another server. A server that is not there, or has no vLLM
        metrics, is refused with the reason, and the page keeps showing what it did."""
        started = time.monotonic()
        try:
            remote = RemoteServer(url)
        except ValueError as exc:  # not an address at all: nothing was fetched, the reason is the typist's
            self.attach_error = f"could not attach: {plain(exc)}"
            return f"{WARNING} {self.attach_error}"
        try:
            remote.connect()
        except ValueError as exc:
            # One message and one duration for every way of failing, so the page tells a closed port from an open
            # one to nobody; the reason goes to the server's log
            log.warning("attach to %s failed: %s", remote.url, exc)
            time.sleep(max(0.0, ATTACH_FAILS_AFTER_S - (time.monotonic() - started)))
            self.attach_error = f"could not attach to {plain(remote.url, 80)}: {ATTACH_FAILED}"
            return f"{WARNING} {self.attach_error}"
        if (old := self.remote) is not None:
            old.stop()
            self.room.note(f"detached the page from {old.url}")
        remote.start()
        self.remote, self.attach_error = remote, ""
        self.room.note(f"attached the page to {remote.url}")
        return (f"Attached to {plain(remote.url)}" + (f" (model {plain(remote.model)})" if remote.model else "")
                + ": the dashboard's queue, KV, prefix and throughput charts and the chat now show that server.")

    def local_only(self, what: str) -> str | None:
        """Why `what` cannot run now (it needs this process's engine and a remote server is attached), or None."""
        if self.remote is None:
            return None
        return f"{WARNING} {what}: {NOT_REMOTE} ({self.remote.url}); detach on the Remote server tab first."

    def room_line(self) -> str:
        """The latest change to the shared page, for every visitor's status line ("" when none lately)."""
        notice = self.room.latest()
        return f"  \n**Latest change:** {plain(notice.describe())}" if notice else ""


class Watcher(Watching, ChatHandlers):
    """A page that watches one server at a time and loads no model; the presenter may attach it to another."""

    local = False  # no engine in this process: the page leaves out the tabs that need one

    def __init__(self, remote: RemoteServer) -> None:
        self.remote = remote
        self.attach_error = ""
        self.room = Room()
        self.access = Access()  # who may change the engine, and who each visitor is (app.launch sets the page's)
        self.seats = Seats()  # the audience's fair shares of the chat (public and token modes), as a Playground's
        self.replies: deque[str] = deque(maxlen=32)

    @classmethod
    def connect(cls, url: str, say: Callable[[str], None] = print, retry_s: float = RETRY_S,
                give_up_s: float | None = None) -> Watcher:
        """Watch `url` once it answers with vLLM's metrics, asking again every `retry_s` until `give_up_s` (None:
        until interrupted); ValueError for a malformed address or `give_up_s` spent."""
        remote = RemoteServer(url)  # a malformed address raises here, at once
        deadline = None if give_up_s is None else time.monotonic() + give_up_s
        while True:
            try:
                remote.connect()
                break
            except ValueError as exc:
                if deadline is not None and time.monotonic() + retry_s > deadline:
                    raise
                say(f"{exc}: asking again in {retry_s:.0f} s (Ctrl-C to stop)")
                time.sleep(retry_s)
        remote.start()
        return cls(remote)

    def detach(self) -> str:
        return (f"{WARNING} This page only watches {plain(self.remote.url)} (it was started with --attach and loaded "
                f"no model): attach it to another server here, or start `python app.py` without --attach to run the "
                f"engine on this machine.")

    def close(self) -> None:
        self.remote.stop()

    def status(self, presenter: bool = False) -> str:
        return self.remote.status(presenter) + (f" · {WARNING} {self.attach_error}" if self.attach_error else "") \
            + self.room_line()

    def dashboard(self) -> DashboardFigures:
        return self.remote.figures()
