"""Slow clients time out (server/timeouts.py): a tiny Starlette app under uvicorn on 127.0.0.1, with the protocol
installed as gradio's server would get it (http="auto") and deadlines of a fraction of a second, driven over raw
sockets. A slow request is closed with a 408; a slow *response*, a keep-alive pause and a prompt request are not."""
from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections.abc import Iterator

import pytest

uvicorn = pytest.importorskip("uvicorn")
pytest.importorskip("httptools")
from starlette.applications import Starlette  # noqa: E402
from starlette.requests import Request  # noqa: E402
from starlette.responses import PlainTextResponse, StreamingResponse  # noqa: E402
from starlette.routing import Route  # noqa: E402

from server import timeouts  # noqa: E402

HEADERS_S = 0.6
BODY_S = 1.0
STREAM_S = 2.5  # the slow response: longer than both deadlines together
TRICKLE_S = 0.1  # a byte this often: every byte resets uvicorn's own keep-alive timer


async def hello(request: Request) -> PlainTextResponse:
    return PlainTextResponse("hello")


async def echo(request: Request) -> PlainTextResponse:
    return PlainTextResponse(str(len(await request.body())))


async def slow(request: Request) -> StreamingResponse:
    await request.body()

    async def chunks():
        for i in range(10):
            yield f"chunk{i};"
            await asyncio.sleep(STREAM_S / 10)
    return StreamingResponse(chunks(), media_type="text/plain")


@pytest.fixture(scope="module")
def port() -> Iterator[int]:
    """The app served by uvicorn in a thread, with TimedHTTPProtocol installed and its deadlines made short."""
    saved = (uvicorn.config.HTTP_PROTOCOLS["auto"], timeouts.TimedHTTPProtocol.headers_s,
             timeouts.TimedHTTPProtocol.body_s)
    assert timeouts.install() and timeouts.install()  # idempotent
    timeouts.TimedHTTPProtocol.headers_s, timeouts.TimedHTTPProtocol.body_s = HEADERS_S, BODY_S
    app = Starlette(routes=[Route("/hello", hello), Route("/echo", echo, methods=["POST"]),
                            Route("/slow", slow, methods=["GET", "POST"])])
    config = uvicorn.Config(app, host="127.0.0.1", log_level="warning")  # http="auto", as gradio builds it
    server = uvicorn.Server(config)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 10
        while not server.started and time.monotonic() < deadline:
            time.sleep(0.02)
        assert server.started
        assert config.http_protocol_class is timeouts.TimedHTTPProtocol
        yield sock.getsockname()[1]
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        sock.close()
        uvicorn.config.HTTP_PROTOCOLS["auto"] = saved[0]
        timeouts.TimedHTTPProtocol.headers_s, timeouts.TimedHTTPProtocol.body_s = saved[1:]


def connect(port: int) -> socket.socket:
    return socket.create_connection(("127.0.0.1", port), timeout=10)


def read_response(sock: socket.socket) -> tuple[int, bytes]:
    """(status, body) of one response: Content-Length or chunked, as this app sends them."""
    data = b""
    while b"\r\n\r\n" not in data:
        more = sock.recv(65536)
        assert more, f"closed before a whole response: {data!r}"
        data += more
    head, rest = data.split(b"\r\n\r\n", 1)
    status = int(head.split(b" ", 2)[1])
    headers = {k.strip().lower(): v.strip() for k, v in (line.split(b":", 1) for line in head.split(b"\r\n")[1:])}
    if b"content-length" in headers:
        size = int(headers[b"content-length"])
        while len(rest) < size:
            more = sock.recv(65536)
            assert more, "closed mid-body"
            rest += more
        return status, rest[:size]
    while not rest.endswith(b"0\r\n\r\n"):
        more = sock.recv(65536)
        assert more, f"closed mid-stream: {rest!r}"
        rest += more
    return status, rest


def trickle_until_closed(sock: socket.socket, limit_s: float) -> tuple[float, bytes]:
    """Send a byte every TRICKLE_S until the server closes the connection; (seconds it took, what it sent back)."""
    start, answer = time.monotonic(), b""
    sock.settimeout(TRICKLE_S)
    while time.monotonic() - start < limit_s:
        try:
            sock.sendall(b"x")
        except OSError:  # reset: closed
            break
        try:
            more = sock.recv(4096)
        except TimeoutError:
            continue
        except OSError:
            break
        if not more:
            break
        answer += more
    return time.monotonic() - start, answer


def test_install_makes_auto_load_the_timed_protocol(port):
    config = uvicorn.Config(lambda scope, receive, send: None)
    config.load()
    assert config.http_protocol_class is timeouts.TimedHTTPProtocol


def test_headers_sent_half_then_trickled_are_cut_after_the_header_deadline(port):
    with connect(port) as sock:
        sock.sendall(b"GET /hello HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: ")
        seconds, answer = trickle_until_closed(sock, limit_s=HEADERS_S + 5)
    assert answer.startswith(b"HTTP/1.1 408 "), answer
    assert seconds < HEADERS_S + 1.5


def test_a_connection_that_never_sends_is_cut_after_the_header_deadline(port):
    with connect(port) as sock:
        start = time.monotonic()
        answer = sock.recv(4096) + sock.recv(4096)
        seconds = time.monotonic() - start
    assert answer.startswith(b"HTTP/1.1 408 ") and seconds > HEADERS_S * 0.8 and seconds < HEADERS_S + 1.5


def test_a_body_trickled_is_cut_after_the_body_deadline(port):
    with connect(port) as sock:
        sock.sendall(b"POST /echo HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 1000\r\n\r\n")
        seconds, answer = trickle_until_closed(sock, limit_s=BODY_S + 5)
    assert answer.startswith(b"HTTP/1.1 408 "), answer
    assert BODY_S * 0.8 < seconds < BODY_S + 1.5  # the body's own deadline, not the headers' (shorter)


def test_prompt_requests_and_a_slow_streamed_response_are_untouched(port):
    with connect(port) as sock:
        sock.sendall(b"GET /hello HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        assert read_response(sock) == (200, b"hello")
    with connect(port) as sock:  # a body in two pieces, both within its deadline
        sock.sendall(b"POST /echo HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 10\r\n\r\nhello")
        time.sleep(BODY_S / 3)
        sock.sendall(b"world")
        assert read_response(sock) == (200, b"10")
    for request in (b"GET /slow HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n",
                    b"POST /slow HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 2\r\n\r\n{}"):
        with connect(port) as sock:
            start = time.monotonic()
            sock.sendall(request)
            status, body = read_response(sock)
            assert status == 200 and all(f"chunk{i};".encode() in body for i in range(10))
            assert time.monotonic() - start > HEADERS_S + BODY_S  # it outlived both deadlines, and was let be


def test_keep_alive_serves_two_requests_with_a_pause_longer_than_the_header_deadline(port):
    with connect(port) as sock:
        sock.sendall(b"GET /hello HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        assert read_response(sock) == (200, b"hello")
        time.sleep(HEADERS_S * 1.5)  # idle between requests is uvicorn's keep-alive timeout's (5 s), not ours
        sock.sendall(b"POST /echo HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 3\r\n\r\nabc")
        assert read_response(sock) == (200, b"3")
        sock.sendall(b"GET /hello HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        assert read_response(sock) == (200, b"hello")


def test_without_httptools_install_leaves_h11_and_says_so_once(monkeypatch, caplog):
    saved = uvicorn.config.HTTP_PROTOCOLS["auto"]
    monkeypatch.setattr(timeouts, "HttpToolsProtocol", None)
    monkeypatch.setattr(timeouts, "_warned", False)
    monkeypatch.setitem(uvicorn.config.HTTP_PROTOCOLS, "auto", "uvicorn.protocols.http.auto:AutoHTTPProtocol")
    with caplog.at_level("WARNING", logger="server.timeouts"):
        assert not timeouts.install() and not timeouts.install()
    assert uvicorn.config.HTTP_PROTOCOLS["auto"] == "uvicorn.protocols.http.auto:AutoHTTPProtocol"
    assert sum("slow-client timeouts are off" in r.getMessage() for r in caplog.records) == 1
    uvicorn.config.HTTP_PROTOCOLS["auto"] = saved


@pytest.mark.served
def test_the_app_cuts_150_trickling_sockets_and_keeps_serving(tiny_models, tmp_path):
    """gradio's own server with install() called before launch (as app.launch does): 150 sockets that send a header
    byte every 0.2 s are all closed at the header deadline; the page is served while they are held, and an API
    stream after."""
    import httpx

    from engine import LLM
    from tests.conftest import serve_app
    saved = (uvicorn.config.HTTP_PROTOCOLS["auto"], timeouts.TimedHTTPProtocol.headers_s)
    timeouts.install()
    timeouts.TimedHTTPProtocol.headers_s = 1.0
    try:
        with serve_app(LLM(tiny_models["llama"][0], max_model_len=256), tmp_path / "a.json", "tiny") as (url, _):
            port = int(url.rstrip("/").rsplit(":", 1)[1])
            socks = [connect(port) for _ in range(150)]
            for sock in socks:
                sock.sendall(b"GET / HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: ")
                sock.setblocking(False)
            assert httpx.get(url, timeout=30).status_code == 200  # the page, while all 150 are held
            start, open_ = time.monotonic(), set(socks)
            while open_ and time.monotonic() - start < 6:
                for sock in list(open_):
                    try:
                        sock.send(b"x")
                        if sock.recv(4096, socket.MSG_PEEK).startswith(b"HTTP/1.1 408"):
                            open_.discard(sock)
                    except BlockingIOError:
                        pass
                    except OSError:
                        open_.discard(sock)
                time.sleep(0.2)
            seconds = time.monotonic() - start
            assert httpx.get(url, timeout=30).status_code == 200
            with httpx.stream("POST", url.rstrip("/") + "/v1/completions", timeout=60,
                              json={"prompt": "hi", "max_tokens": 16, "stream": True}) as r:
                assert r.status_code == 200 and "[DONE]" in r.read().decode()
            for sock in socks:
                sock.close()
        assert not open_ and seconds < 1.0 + 3.0, (len(open_), seconds)
    finally:
        uvicorn.config.HTTP_PROTOCOLS["auto"], timeouts.TimedHTTPProtocol.headers_s = saved
