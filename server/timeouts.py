"""Slow clients time out: a request's line and headers must arrive within HEADERS_S, its body within BODY_S.

uvicorn times only the idle gap between keep-alive requests, so sockets that sent a header byte now and then were
held as long as they liked. This is its httptools protocol with nginx's and Apache's two deadlines on the request;
what the server writes back (a long SSE stream) is never timed. `install()` makes gradio's uvicorn use it.
"""
from __future__ import annotations

import asyncio
import logging

import uvicorn.config

HEADERS_S = 10.0  # the request line and headers, from the connection's opening (or the next request's first byte)
BODY_S = 30.0  # the whole body, from the end of the headers: 4 MB (the API's cap) at 140 KB/s
log = logging.getLogger(__name__)
_TIMEOUT_TEXT = b"the request came too slowly"
_TIMEOUT_RESPONSE = (b"HTTP/1.1 408 Request Timeout\r\ncontent-type: text/plain; charset=utf-8\r\n"
                     b"content-length: %d\r\nconnection: close\r\n\r\n%s" % (len(_TIMEOUT_TEXT), _TIMEOUT_TEXT))

try:
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
except ImportError:  # no httptools: uvicorn serves with h11, and install() leaves it be
    HttpToolsProtocol = None  # type: ignore[assignment,misc]


if HttpToolsProtocol is not None:
    class TimedHTTPProtocol(HttpToolsProtocol):
        """HttpToolsProtocol with a deadline on each request's headers and on its body. A deadline that passes
        while the server itself holds the client up (a response still being written on this connection, reading
        paused by flow control, a 100-continue not yet sent) is moved on, not enforced: only the client's
        slowness closes a connection."""
        headers_s: float = HEADERS_S
        body_s: float = BODY_S

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            self._deadline: asyncio.TimerHandle | None = None
            super().connection_made(transport)
            self._arm(self.headers_s, self._headers_late)  # a socket that never sends a byte is held no longer

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

        def on_message_begin(self) -> None:
            super().on_message_begin()
            if self._deadline is None:  # a keep-alive connection's next request: its own HEADERS_S
                self._arm(self.headers_s, self._headers_late)

        def on_headers_complete(self) -> None:
            self._disarm()
            super().on_headers_complete()
            if not (self.parser.should_upgrade() and self._should_upgrade()):
                self._arm(self.body_s, self._body_late)

        def on_message_complete(self) -> None:
            self._disarm()
            super().on_message_complete()

        def handle_websocket_upgrade(self) -> None:
            self._disarm()  # the transport is the websocket protocol's from here on
            super().handle_websocket_upgrade()

        def _arm(self, seconds: float, late) -> None:
            self._disarm()
            self._deadline = self.loop.call_later(seconds, late)

        def _disarm(self) -> None:
            if self._deadline is not None:
                self._deadline.cancel()
                self._deadline = None

        def _headers_late(self) -> None:
            self._deadline = None
            if self.cycle is not None and not self.cycle.response_complete:
                # a pipelined request behind one still being answered: the answer is not timed
                self._arm(self.headers_s, self._headers_late)
                return
            self._close_slow("headers", self.headers_s)

        def _body_late(self) -> None:
            self._deadline = None
            cycle = self.cycle
            waiting_on_server = (self.flow.read_paused or cycle.waiting_for_100_continue
                                 or (cycle.response_started and not cycle.response_complete))
            if waiting_on_server:
                self._arm(self.body_s, self._body_late)
                return
            self._close_slow("body", self.body_s)

        def _close_slow(self, part: str, seconds: float) -> None:
            if self.transport.is_closing():
                return
            client = f"{self.client[0]}:{self.client[1]}" if self.client else "a client"
            log.info("closed %s: its request's %s took longer than %g s", client, part, seconds)
            if self.cycle is None or not self.cycle.response_started:  # nothing written yet: say why
                self.transport.write(_TIMEOUT_RESPONSE)
            self.transport.close()


_warned = False


def install() -> bool:
    """Make every uvicorn server started from now on with http="auto" (gradio's) use TimedHTTPProtocol. Safe to
    call more than once; without httptools it leaves uvicorn's h11 protocol in place, says so once and returns
    False."""
    global _warned
    if HttpToolsProtocol is None:
        if not _warned:
            log.warning("httptools is not installed: slow-client timeouts are off (uvicorn's h11 has none)")
            _warned = True
        return False
    # Config.load() imports HTTP_PROTOCOLS[http] by name when the server starts: the one seam uvicorn reads
    uvicorn.config.HTTP_PROTOCOLS["auto"] = f"{__name__}:TimedHTTPProtocol"
    return True
