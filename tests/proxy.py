"""A real reverse proxy for the tests: Debian's nginx on loopback, and clients that come from distinct addresses.

Who a client is, behind a proxy, is only proven against a real one: `Nginx(upstream)` runs /usr/sbin/nginx in a
temporary prefix (its own config, pid file, logs and temp dirs), listening on a free port of 127.0.0.1 and
proxying everything to `upstream` as a deployment proxies a Gradio app (Gradio's nginx guide: HTTP/1.1, no
buffering, the upgrade headers; plus X-Forwarded-For/-Proto/-Host). Distinct real clients on one machine: loopback
holds the whole 127.0.0.0/8, so `client("127.0.0.2")`, `client("127.0.0.3")`, ... connect to 127.0.0.1 from their
own address, and nginx's $remote_addr (what it appends to X-Forwarded-For) is that address.

    from tests.proxy import Nginx, NginxMissing, client, raw_request

    try:
        proxy = Nginx(app_url)                     # app_url: "http://127.0.0.1:PORT/" (not "localhost")
    except NginxMissing as exc:
        pytest.skip(str(exc))
    with proxy:                                    # started: proxy.url == "http://127.0.0.1:PROXYPORT/"
        with client("127.0.0.2") as alice, client("127.0.0.3") as bob:
            alice.get(proxy.url)                   # the app's peer: 127.0.0.1; X-Forwarded-For: 127.0.0.2
            bob.get(proxy.url, headers={"X-Forwarded-For": "6.6.6.6"})   # X-Forwarded-For: 6.6.6.6, 127.0.0.3
        raw_request(proxy.url, "GET", "/", [("X-Forwarded-For", "1.1.1.1"), ("X-Forwarded-For", "2.2.2.2")],
                    source="127.0.0.4")            # hand-made (here: repeated) headers

Mind: uvicorn's defaults (and so Gradio's launch) trust X-Forwarded-For from 127.0.0.1 and ::1
(FORWARDED_ALLOW_IPS): a client that connects straight to the app from 127.0.0.1 is believed. Clients that play
someone other than the proxy come from 127.0.0.2 on (`sources`), or nginx connects from its own address
(`proxy_source`) and only that is trusted.
"""
from __future__ import annotations

import atexit
import json
import os
import pwd
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from urllib.parse import urlsplit

import httpx

NGINX = "/usr/sbin/nginx"  # Debian's (apt-get install -y nginx); WATCHLLM_NGINX or PATH's nginx where it is not


class NginxMissing(RuntimeError):
    """No nginx binary here: the proxy tests skip (`pytest.skip(str(exc))`)."""


def find_nginx(binary: str | None = None) -> str:
    """The nginx to run: `binary`, else $WATCHLLM_NGINX, else /usr/sbin/nginx, else `nginx` on PATH."""
    for candidate in ([binary] if binary else [os.environ.get("WATCHLLM_NGINX"), NGINX, shutil.which("nginx")]):
        if candidate and os.path.isfile(candidate) and os.access(candidate, os.X_OK):
            return candidate
    raise NginxMissing(f"nginx is not installed ({binary or NGINX} not found; Debian: apt-get install -y nginx): "
                       "the reverse-proxy tests are skipped")


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def sources(n: int, first: int = 2) -> list[str]:
    """n distinct loopback client addresses, 127.0.0.2 on (127.0.0.1 is left to the proxy and the servers)."""
    if first < 1 or n < 0 or first + n - 1 > 254:
        raise ValueError("127.0.0.1-254 only")
    return [f"127.0.0.{i}" for i in range(first, first + n)]


def _unprivileged_user() -> pwd.struct_passwd | None:
    """Whom nginx runs as when the tests run as root (a container): `nobody`, where it exists."""
    if os.geteuid() != 0:
        return None
    try:
        return pwd.getpwnam("nobody")
    except KeyError:
        return None


_RUNNING: set[Nginx] = set()  # stopped at exit where a test left one running (its prefix is removed too)


@atexit.register
def _stop_all() -> None:
    for proxy in list(_RUNNING):
        proxy.stop()


class Nginx:
    """Debian's nginx as a reverse proxy on 127.0.0.1:<free port> in front of `upstream`; a context manager.

    upstream: "http://127.0.0.1:PORT/" (a path proxies "/" to it; give an IP: nginx resolves a name such as
      localhost once, at start, to every address it has, ::1 included, and tries them in turn).
    forwarded: also send RFC 7239 `Forwarded: for=<client>`, appended to the client's own Forwarded header as
      X-Forwarded-For is appended to (`for=6.6.6.6, for=127.0.0.3`).
    real_ip_from: None (default, unused), or CIDRs (a string or several) whose X-Forwarded-For this nginx believes
      (ngx_http_realip: `set_real_ip_from`, `real_ip_header X-Forwarded-For`, `real_ip_recursive on`): a second
      hop behind another proxy. Its $remote_addr, logged and appended, is then the address it found there.
    proxy_source: the address nginx connects to the upstream from (`proxy_bind`), e.g. "127.0.0.254", so that a
      server can trust exactly the proxy, not every client that comes from 127.0.0.1; default: the kernel's
      choice, 127.0.0.1.
    read_timeout_s: how long a response (an SSE stream) may stay silent before nginx drops it.
    binary: the nginx to run (see `find_nginx`); missing: NginxMissing, raised here.

    Entering starts nginx and waits (up to start_timeout_s) until its port answers; leaving stops it and removes
    the prefix. `.url` ("http://127.0.0.1:PORT/"), `.port`, `.prefix`, `.config` (the nginx.conf text),
    `.access_log()` (lines: `$remote_addr "$http_x_forwarded_for" "$http_forwarded" "$request" $status`),
    `.error_log()`. Run as root, nginx runs as `nobody` (the prefix is theirs); a single process, no daemon.
    """

    def __init__(self, upstream: str, *, forwarded: bool = False, real_ip_from: str | Iterable[str] | None = None,
                 proxy_source: str | None = None, read_timeout_s: int = 3600, start_timeout_s: float = 10.0,
                 binary: str | None = None):
        parts = urlsplit(upstream)
        if parts.scheme != "http" or not parts.hostname or parts.port is None:
            raise ValueError(f"upstream must be http://HOST:PORT[/path], not {upstream!r}")
        self.binary = find_nginx(binary)
        host = f"[{parts.hostname}]" if ":" in parts.hostname else parts.hostname
        # no path: the client's request URI goes through untouched; a path replaces the location's "/"
        self.proxy_pass = f"http://{host}:{parts.port}" + (parts.path if parts.path not in ("", "/") else "")
        self.forwarded = forwarded
        self.real_ip_from = [real_ip_from] if isinstance(real_ip_from, str) else list(real_ip_from or [])
        self.proxy_source = proxy_source
        self.read_timeout_s = int(read_timeout_s)
        self.start_timeout_s = start_timeout_s
        self.port: int | None = None
        self.prefix: str | None = None
        self.config = ""
        self.process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/"

    # ---- the config --------------------------------------------------------------------------------------------

    def render_config(self, prefix: str, port: int) -> str:
        realip = "".join(f"        set_real_ip_from {cidr};\n" for cidr in self.real_ip_from)
        if realip:
            realip += "        real_ip_header X-Forwarded-For;\n        real_ip_recursive on;\n"
        forwarded = "            proxy_set_header Forwarded $proxy_add_forwarded;\n" if self.forwarded else ""
        bind = f"            proxy_bind {self.proxy_source};\n" if self.proxy_source else ""
        return f"""# written by tests/proxy.py
daemon off;
master_process off;
worker_processes 1;
pid {prefix}/nginx.pid;
error_log {prefix}/logs/error.log info;
events {{ worker_connections 512; }}
http {{
    client_body_temp_path {prefix}/tmp/client_body;
    proxy_temp_path {prefix}/tmp/proxy;
    fastcgi_temp_path {prefix}/tmp/fastcgi;
    uwsgi_temp_path {prefix}/tmp/uwsgi;
    scgi_temp_path {prefix}/tmp/scgi;
    log_format proxied '$remote_addr "$http_x_forwarded_for" "$http_forwarded" "$request" $status';
    access_log {prefix}/logs/access.log proxied;
    # websockets: nginx's own recipe (Gradio's guide sends "upgrade" always; this closes plain requests instead)
    map $http_upgrade $connection_upgrade {{
        default upgrade;
        ''      close;
    }}
    # RFC 7239: the client's own Forwarded elements, then this hop's, as $proxy_add_x_forwarded_for does
    map $http_forwarded $proxy_add_forwarded {{
        ''      "for=$remote_addr";
        default "$http_forwarded, for=$remote_addr";
    }}
    server {{
        listen 127.0.0.1:{port};
        server_name _;
        client_max_body_size 0;
{realip}        location / {{
            proxy_pass {self.proxy_pass};
            proxy_http_version 1.1;
            proxy_buffering off;
            proxy_cache off;
            proxy_redirect off;
            proxy_read_timeout {self.read_timeout_s}s;
            proxy_send_timeout {self.read_timeout_s}s;
            proxy_set_header Upgrade $http_upgrade;
            proxy_set_header Connection $connection_upgrade;
            # the client's Host, port included: Gradio builds its root URL from X-Forwarded-Host (else Host), and
            # $host, the usual choice, drops a port that is not 80: the page would then call http://127.0.0.1/
            proxy_set_header Host $http_host;
            proxy_set_header X-Forwarded-Host $http_host;
            proxy_set_header X-Forwarded-For $proxy_add_x_forwarded_for;
            proxy_set_header X-Forwarded-Proto $scheme;
{forwarded}{bind}        }}
    }}
}}
"""

    # ---- start and stop ----------------------------------------------------------------------------------------

    def start(self) -> Nginx:
        if self.process is not None:
            raise RuntimeError("this Nginx is already running")
        last_error = ""
        for _ in range(3):  # a free port may be taken between choosing it and nginx's bind: choose again
            try:
                self._start_once()
                return self
            except _PortTaken as exc:
                last_error = str(exc)
        raise RuntimeError(f"nginx could not bind a free port three times: {last_error}")

    def _start_once(self) -> None:
        prefix = tempfile.mkdtemp(prefix="watchllm-nginx-")  # /tmp: `nobody` must reach it, pytest's tmp is 0700
        port = free_port()
        for sub in ("logs", "tmp"):
            os.makedirs(os.path.join(prefix, sub))
        conf = os.path.join(prefix, "nginx.conf")
        self.config = self.render_config(prefix, port)
        with open(conf, "w") as f:
            f.write(self.config)
        user = _unprivileged_user()
        if user is not None:
            for root, dirs, files in os.walk(prefix):
                for name in [root, *(os.path.join(root, n) for n in dirs + files)]:
                    os.chown(name, user.pw_uid, user.pw_gid)
        stderr = open(os.path.join(prefix, "logs", "stderr.log"), "wb")
        # -e: the error log from the first line on (other builds than Debian's default to /var/log/nginx)
        cmd = [self.binary, "-p", prefix + "/", "-c", conf, "-e", os.path.join(prefix, "logs", "error.log")]
        try:
            process = subprocess.Popen(
                cmd, stdin=subprocess.DEVNULL, stdout=stderr, stderr=subprocess.STDOUT, cwd=prefix,
                start_new_session=True,  # a ^C in the test run is pytest's; the fixture stops nginx
                **({"user": user.pw_uid, "group": user.pw_gid, "extra_groups": []} if user is not None else {}))
        finally:
            stderr.close()
        self.process, self.prefix, self.port = process, prefix, port
        _RUNNING.add(self)
        deadline = time.monotonic() + self.start_timeout_s
        while True:
            if process.poll() is not None:
                log = self.error_log()
                self.stop()
                if "Address already in use" in log:
                    raise _PortTaken(log.strip().splitlines()[-1])
                raise RuntimeError(f"nginx exited at start ({process.returncode}):\n{log}\n--- config:\n{self.config}")
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                    pass
                if process.poll() is None:
                    return
            except OSError:
                pass
            if time.monotonic() > deadline:
                log = self.error_log()
                self.stop()
                raise RuntimeError(f"nginx did not answer on 127.0.0.1:{port} in {self.start_timeout_s} s:\n{log}")
            time.sleep(0.05)

    def stop(self) -> None:
        """Stop nginx (SIGTERM: its fast shutdown; SIGKILL after 5 s) and remove the prefix. Idempotent."""
        process, self.process = self.process, None
        if process is not None:
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
                try:
                    process.wait(timeout=5)
                except subprocess.TimeoutExpired:
                    process.kill()
                    process.wait(timeout=5)
        _RUNNING.discard(self)
        if self.prefix is not None:
            shutil.rmtree(self.prefix, ignore_errors=True)
            self.prefix = None

    def __enter__(self) -> Nginx:
        return self.start()

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None and self.prefix is not None:  # the failing test's output shows what nginx saw
            sys.stderr.write(f"--- nginx error log:\n{self.error_log()[-4000:]}\n--- nginx access log:\n"
                             + "\n".join(self.access_log()[-50:]) + "\n")
        self.stop()

    # ---- what it logged ----------------------------------------------------------------------------------------

    def _read(self, *path: str) -> str:
        if self.prefix is None:
            return ""
        try:
            with open(os.path.join(self.prefix, *path), errors="replace") as f:
                return f.read()
        except FileNotFoundError:
            return ""

    def error_log(self) -> str:
        return self._read("logs", "error.log") + self._read("logs", "stderr.log")

    def access_log(self) -> list[str]:
        """One line a finished request (written unbuffered, at its end):
        `$remote_addr "$http_x_forwarded_for" "$http_forwarded" "$request" $status`."""
        return self._read("logs", "access.log").splitlines()

    def logged(self, expected_start: str, wait_s: float = 5.0) -> bool:
        """Whether the access log's last line starts with `expected_start`, waiting up to `wait_s` for it: nginx
        writes a request's line after its response has gone, so a client may read the log before it is there."""
        deadline = time.monotonic() + wait_s
        while True:
            lines = self.access_log()
            if lines and lines[-1].startswith(expected_start):
                return True
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.02)


class _PortTaken(RuntimeError):
    pass


# ---- clients from distinct loopback addresses -----------------------------------------------------------------------

_TRANSPORT_KWARGS = ("verify", "cert", "http1", "http2", "limits", "retries", "socket_options")


def client(source: str, **kwargs) -> httpx.Client:
    """An httpx.Client whose connections come from `source` (e.g. "127.0.0.2"); kwargs go to the Client, except
    the transport's own (verify, cert, http1, http2, limits, retries, socket_options)."""
    transport = httpx.HTTPTransport(local_address=source, **{k: kwargs.pop(k) for k in _TRANSPORT_KWARGS
                                                             if k in kwargs})
    return httpx.Client(transport=transport, **kwargs)


def async_client(source: str, **kwargs) -> httpx.AsyncClient:
    """The asyncio twin of `client`."""
    transport = httpx.AsyncHTTPTransport(local_address=source, **{k: kwargs.pop(k) for k in _TRANSPORT_KWARGS
                                                                  if k in kwargs})
    return httpx.AsyncClient(transport=transport, **kwargs)


@dataclass
class RawResponse:
    status: int
    reason: str
    headers: list[tuple[str, str]] = field(default_factory=list)
    body: bytes = b""

    def header(self, name: str) -> str | None:
        """The first header of that name (any case), or None."""
        return next((v for k, v in self.headers if k.lower() == name.lower()), None)

    def json(self):
        return json.loads(self.body)

    @property
    def text(self) -> str:
        return self.body.decode("utf-8", errors="replace")


def raw_request(url: str, method: str = "GET", path: str = "/",
                headers: Mapping[str, str] | Iterable[tuple[str, str]] = (), body: bytes | str = b"",
                source: str | None = None, timeout: float = 10.0) -> RawResponse:
    """One HTTP/1.1 request written by hand on a socket from `source` to `url`'s host and port: `headers` go out
    as given, in order, repeats included (a list of pairs), with Host, Content-Length (for a body) and
    `Connection: close` added only where absent. The whole response is read (to the server's close) and parsed,
    a chunked body decoded. `path` is sent as it is (no quoting)."""
    parts = urlsplit(url)
    host, port = parts.hostname, parts.port or 80
    pairs = list(headers.items()) if isinstance(headers, Mapping) else list(headers)
    body = body.encode() if isinstance(body, str) else body
    names = {k.lower() for k, _ in pairs}
    if "host" not in names:
        pairs.insert(0, ("Host", f"{host}:{port}"))
    if body and "content-length" not in names and "transfer-encoding" not in names:
        pairs.append(("Content-Length", str(len(body))))
    if "connection" not in names:
        pairs.append(("Connection", "close"))
    head = f"{method} {path} HTTP/1.1\r\n" + "".join(f"{k}: {v}\r\n" for k, v in pairs) + "\r\n"
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as sock:
        sock.settimeout(timeout)
        if source is not None:
            sock.bind((source, 0))
        sock.connect((host, port))
        sock.sendall(head.encode("latin-1") + body)
        return _read_response(sock, f"{url}{path}", time.monotonic() + timeout, head_only=method == "HEAD")


def _read_response(sock: socket.socket, what: str, deadline: float, head_only: bool = False) -> RawResponse:
    """Read one response, and no more: to its Content-Length, its last chunk, or (neither) the server's close; a
    1xx (101 Switching Protocols) or a HEAD's ends at its head. Bounded by `deadline`."""
    data = b""

    def more() -> bool:
        nonlocal data
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: the response did not end in time (so far: {data[:300]!r})")
        chunk = sock.recv(65536)
        data += chunk
        return bool(chunk)

    while b"\r\n\r\n" not in data:
        if not more():
            break
    response = _parse_response(data)
    if head_only or response.status < 200 or response.status in (204, 304):
        return response
    length = response.header("content-length")
    chunked = (response.header("transfer-encoding") or "").lower() == "chunked"
    while True:
        body = data.partition(b"\r\n\r\n")[2]
        if length is not None and len(body) >= int(length):
            break
        if chunked and _chunked_end(body) is not None:
            break
        if not more():
            break
    return _parse_response(data)


def _chunked_end(body: bytes) -> int | None:
    """Where a chunked body ends (after its last chunk and trailers), or None while it is incomplete."""
    at = 0
    while True:
        line_end = body.find(b"\r\n", at)
        if line_end < 0:
            return None
        size = int(body[at:line_end].split(b";")[0] or b"0", 16)
        if size == 0:
            trailers_end = body.find(b"\r\n\r\n", line_end)
            if body[line_end:line_end + 4] == b"\r\n\r\n":
                return line_end + 4
            return None if trailers_end < 0 else trailers_end + 4
        at = line_end + 2 + size + 2
        if at > len(body):
            return None


def _parse_response(data: bytes) -> RawResponse:
    head, sep, body = data.partition(b"\r\n\r\n")
    if not sep:
        raise ValueError(f"no complete HTTP response head in {data[:200]!r}")
    status_line, *header_lines = head.decode("latin-1").split("\r\n")
    _, status, *reason = status_line.split(" ", 2)
    headers = [(k.strip(), v.strip()) for k, _, v in (line.partition(":") for line in header_lines)]
    response = RawResponse(int(status), reason[0] if reason else "", headers, body)
    if (response.header("transfer-encoding") or "").lower() == "chunked":
        out, rest = [], body
        while rest:
            size_line, _, rest = rest.partition(b"\r\n")
            try:
                size = int(size_line.split(b";")[0], 16)
            except ValueError:  # cut short (the server closed mid-chunk)
                break
            if size == 0:
                break
            out.append(rest[:size])
            rest = rest[size + 2:]
        response.body = b"".join(out)
    return response
