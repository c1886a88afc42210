"""The reverse-proxy harness itself (tests/proxy.py): Debian's nginx in front of a tiny app that shows what reached
it, and clients from distinct loopback addresses.

The app runs under uvicorn with proxy_headers off, so it shows the raw peer and the raw headers: through nginx the
peer is the proxy (127.0.0.1) and the real client is the address nginx appended, the right-most one."""
from __future__ import annotations

import asyncio
import os
import pwd
import shutil
import subprocess
import threading
import time

import pytest

from tests.proxy import Nginx, NginxMissing, async_client, client, free_port, raw_request, sources

pytestmark = pytest.mark.served  # servers on local ports, mostly waiting: `make test` runs it in the second lane

ACKS = [threading.Event() for _ in range(3)]  # the SSE test's client says it has event i before i+1 is made


def echo_app():
    from starlette.applications import Starlette
    from starlette.responses import JSONResponse, StreamingResponse
    from starlette.routing import Route, WebSocketRoute

    async def echo(request):
        h = request.headers
        return JSONResponse({"peer": request.client.host, "xff": h.getlist("x-forwarded-for"),
                             "forwarded": h.getlist("forwarded"), "host": h.get("host"),
                             "x_forwarded_host": h.get("x-forwarded-host"),
                             "x_forwarded_proto": h.get("x-forwarded-proto"),
                             "connection": h.get("connection"), "upgrade": h.get("upgrade")})

    async def sse(request):
        """3 events 0.3 s apart; with ?ack=1 each next one waits (up to 5 s) for the client to have this one."""
        ack = request.query_params.get("ack") == "1"

        async def events():
            for i in range(3):
                yield f"data: {i} {time.monotonic():.6f}\n\n"
                if i == 2:
                    break
                deadline = time.monotonic() + 5
                while ack and not ACKS[i].is_set():
                    if time.monotonic() > deadline:
                        yield "data: timeout\n\n"  # the client never got event i: something held it back
                        return
                    await asyncio.sleep(0.01)
                await asyncio.sleep(0.3)
        return StreamingResponse(events(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})

    async def ws(websocket):  # only where uvicorn has a websocket library (none is a requirement here)
        await websocket.accept()
        await websocket.close()

    return Starlette(routes=[Route("/sse", sse), WebSocketRoute("/ws", ws),
                             Route("/{path:path}", echo, methods=["GET", "POST"])])


@pytest.fixture(scope="module")
def upstream():
    """The echo app on 127.0.0.1, showing the raw peer (proxy_headers off, no address trusted)."""
    uvicorn = pytest.importorskip("uvicorn")
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(echo_app(), host="127.0.0.1", port=port, proxy_headers=False,
                                           forwarded_allow_ips="", log_level="error", lifespan="off"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the echo app did not start"
        time.sleep(0.02)
    yield f"http://127.0.0.1:{port}/"
    server.should_exit = True
    thread.join(timeout=10)


def nginx(upstream_url: str, **kwargs) -> Nginx:
    try:
        return Nginx(upstream_url, **kwargs)
    except NginxMissing as exc:
        pytest.skip(str(exc))


@pytest.fixture(scope="module")
def proxy(upstream):
    with nginx(upstream) as running:
        yield running


def test_a_client_bound_to_its_own_loopback_address_is_seen_from_it(upstream):
    """The premise: 127.0.0.0/8 is all loopback, so a client bound to 127.0.0.2 reaches a server on 127.0.0.1 and
    the server's peer is 127.0.0.2 (no proxy here)."""
    with client("127.0.0.2", timeout=10) as c:
        assert c.get(upstream).json()["peer"] == "127.0.0.2"
    assert raw_request(upstream, source="127.0.0.7").json()["peer"] == "127.0.0.7"


def test_through_nginx_the_peer_is_the_proxy_and_the_client_is_appended(proxy):
    with client("127.0.0.3", timeout=10) as c:
        seen = c.get(proxy.url).json()
    host = f"127.0.0.1:{proxy.port}"
    assert seen["peer"] == "127.0.0.1"
    assert seen["xff"] == ["127.0.0.3"]
    assert seen["forwarded"] == []  # only with forwarded=True
    assert (seen["host"], seen["x_forwarded_host"], seen["x_forwarded_proto"]) == (host, host, "http")
    assert (seen["connection"], seen["upgrade"]) == ("close", None)  # no upgrade asked: none passed on
    assert proxy.logged('127.0.0.3 "-" '), proxy.access_log()[-3:]  # nginx's $remote_addr: the bound source


def test_a_spoofed_x_forwarded_for_is_kept_and_the_real_client_comes_last(proxy):
    """nginx appends the peer it saw to whatever the client sent: the real client is the right-most entry, the one
    the trusted hop added; anything left of it is the client's word."""
    with client("127.0.0.3", timeout=10) as c:
        assert c.get(proxy.url, headers={"X-Forwarded-For": "6.6.6.6"}).json()["xff"] == ["6.6.6.6, 127.0.0.3"]
    # two X-Forwarded-For lines, written by hand: nginx joins them, then appends
    two = [("X-Forwarded-For", "1.1.1.1"), ("X-Forwarded-For", "2.2.2.2")]
    seen = raw_request(proxy.url, "GET", "/", two, source="127.0.0.4").json()
    assert (seen["peer"], seen["xff"]) == ("127.0.0.1", ["1.1.1.1, 2.2.2.2, 127.0.0.4"])
    assert proxy.logged('127.0.0.4 "1.1.1.1, 2.2.2.2" '), proxy.access_log()[-3:]


def test_distinct_clients_behind_the_proxy_are_told_apart(proxy):
    """Concurrent clients from 127.0.0.2-6 through one nginx: each one's own address arrives as the last hop."""
    addresses = sources(5)

    async def one(source):
        async with async_client(source, timeout=10) as c:
            return (await c.get(proxy.url)).json()

    async def all_at_once():
        return await asyncio.gather(*(one(s) for s in addresses))

    seen = asyncio.run(all_at_once())
    assert [s["xff"] for s in seen] == [[a] for a in addresses]
    assert {s["peer"] for s in seen} == {"127.0.0.1"}


def test_forwarded_carries_the_client_too(upstream):
    with nginx(upstream, forwarded=True) as proxy, client("127.0.0.3", timeout=10) as c:
        seen = c.get(proxy.url).json()
        assert (seen["forwarded"], seen["xff"]) == (["for=127.0.0.3"], ["127.0.0.3"])
        spoofed = c.get(proxy.url, headers={"Forwarded": "for=6.6.6.6", "X-Forwarded-For": "6.6.6.6"}).json()
        assert spoofed["forwarded"] == ["for=6.6.6.6, for=127.0.0.3"]
        assert spoofed["xff"] == ["6.6.6.6, 127.0.0.3"]


def test_an_upgrade_request_is_passed_on(proxy):
    """The websocket headers (Gradio's nginx guide) reach the app: with a websocket library uvicorn switches
    (101); without one (as here: none is a requirement) it answers as plain HTTP, showing what it got."""
    ask = [("Upgrade", "websocket"), ("Connection", "Upgrade"), ("Sec-WebSocket-Version", "13"),
           ("Sec-WebSocket-Key", "dGhlIHNhbXBsZSBub25jZQ==")]
    response = raw_request(proxy.url, "GET", "/ws", ask, source="127.0.0.3")
    if response.status == 101:
        assert (response.header("upgrade") or "").lower() == "websocket"
    else:
        seen = response.json()
        assert (seen["upgrade"], seen["connection"], seen["xff"]) == ("websocket", "upgrade", ["127.0.0.3"])


def test_a_server_sent_event_stream_arrives_event_by_event(proxy):
    """The app makes event i+1 only once the client holds event i (ACKS), then waits 0.3 s: a proxy that held
    events back would leave the app waiting (it then says "timeout"); one that passes them on shows arrival
    times 0.3 s or more apart, each event before the app made the next (the times are one process's clock)."""
    for ack in ACKS:
        ack.clear()
    arrivals, made = [], []
    with client("127.0.0.5", timeout=10) as c, c.stream("GET", proxy.url + "sse?ack=1") as stream:
        assert stream.headers["content-type"].startswith("text/event-stream")
        for line in stream.iter_lines():
            if not line.startswith("data: "):
                continue
            arrivals.append(time.monotonic())
            assert line != "data: timeout", f"event {len(made) - 1} was held back by the proxy"
            i, when = line.removeprefix("data: ").split()
            assert int(i) == len(made)
            made.append(float(when))
            ACKS[int(i)].set()
    assert len(arrivals) == 3
    assert all(later - earlier >= 0.29 for earlier, later in zip(arrivals, arrivals[1:])), arrivals
    assert all(arrived < made_next for arrived, made_next in zip(arrivals, made[1:])), (arrivals, made)


def nginx_processes(prefix: str) -> list[int]:
    """The pids whose command line names the prefix (`pgrep -f`; /proc where procps is missing)."""
    if shutil.which("pgrep"):
        out = subprocess.run(["pgrep", "-f", prefix], capture_output=True, text=True, timeout=10).stdout
        return [int(pid) for pid in out.split()]
    pids = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if prefix.encode() in f.read():
                    pids.append(int(pid))
        except OSError:
            pass
    return pids


def test_nginx_runs_unprivileged_and_leaves_nothing_behind(upstream):
    proxy = nginx(upstream)
    with proxy:
        prefix, pid = proxy.prefix, proxy.process.pid
        assert nginx_processes(prefix) == [pid]  # one process: no master, no workers, no daemon
        if os.geteuid() == 0:  # root (a container): nginx runs as nobody
            assert os.stat(f"/proc/{pid}").st_uid == pwd.getpwnam("nobody").pw_uid
        assert "daemon off;" in proxy.config and f"listen 127.0.0.1:{proxy.port};" in proxy.config
    assert nginx_processes(prefix) == []
    assert not os.path.exists(prefix)
    proxy.stop()  # again: nothing to do


def test_proxy_source_and_a_second_hop_that_trusts_the_first(upstream):
    """proxy_source: the upstream's peer is the proxy's own address. real_ip_from: a second nginx behind the first
    believes the first's X-Forwarded-For, so its $remote_addr is the client, not the first proxy."""
    with nginx(upstream, real_ip_from="127.0.0.9") as second, \
            nginx(second.url, proxy_source="127.0.0.9") as first, client("127.0.0.3", timeout=10) as c:
        assert c.get(first.url).json()["peer"] == "127.0.0.1"  # the second's own connection
        assert second.logged('127.0.0.3 "127.0.0.3" '), second.access_log()[-3:]  # found in the first's header
        assert first.logged('127.0.0.3 "-" '), first.access_log()[-3:]
    with nginx(upstream, proxy_source="127.0.0.254") as proxy, client("127.0.0.3", timeout=10) as c:
        seen = c.get(proxy.url).json()
        assert (seen["peer"], seen["xff"]) == ("127.0.0.254", ["127.0.0.3"])


def test_no_nginx_is_a_clear_error_to_skip_on(upstream):
    with pytest.raises(NginxMissing, match="nginx is not installed"):
        Nginx(upstream, binary="/nonexistent/nginx")
    with pytest.raises(ValueError):
        nginx("https://127.0.0.1:1/")
