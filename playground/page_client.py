"""A visitor's tab over plain HTTP, and the app started as a user starts it: what playground/loadtest.py and the
tests drive the page with. A Session talks to gradio as the page's own script does (rather than through
gradio_client, whose 1 ms sleep loop per job, not the server, decided when tokens were seen under load)."""
from __future__ import annotations

import json
import os
import queue
import socket
import subprocess
import sys
import threading
import time
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path

from engine import sse

from .conversation import text_of


class Session:
    """One browser tab: an event joins the queue (POST queue/join with the tab's session hash, so gr.State is the
    tab's own) and its updates come back over the session's one event stream (GET queue/data), which a reader
    thread routes to the event by its id (docs/measurements.md, "Does the page stay responsive?")."""

    def __init__(self, url: str, fn_ids: dict[str, int], headers: dict | None = None, source: str | None = None
                 ) -> None:
        """`source`: the local address to connect from (127.0.0.7: another client, as far as the server can tell)."""
        import httpx
        self.api = url + "gradio_api/"
        self.fn_ids = fn_ids
        self.hash = uuid.uuid4().hex[:11]
        transport = httpx.HTTPTransport(local_address=source) if source else None
        self.http = httpx.Client(timeout=httpx.Timeout(120.0, read=None), headers=headers, transport=transport)
        self._lock = threading.Lock()
        self._events: dict[str, queue.Queue] = {}
        self._reader: threading.Thread | None = None

    def load(self) -> str | None:
        """Take the visitor id the server issues as the page loads (a session without one counts as its address).
        The signed id, or None (a desk's page, or this address was issued too many lately)."""
        if "visitor" not in self.fn_ids:
            return None
        out = self.predict("visitor", [None])
        return out[0] if out and isinstance(out[0], str) else None

    def stream(self, api_name: str, data: list) -> Iterator[list]:
        """The event's outputs as they come (a generator's diffs applied): one list of output values each."""
        from gradio_client.utils import apply_diff
        with self._lock:  # the reader cannot route this event's first messages before it is registered
            r = self.http.post(self.api + "queue/join", json={
                "data": data, "fn_index": self.fn_ids[api_name.strip("/")], "session_hash": self.hash,
                "event_data": None, "trigger_id": None})
            r.raise_for_status()
            messages = self._events[r.json()["event_id"]] = queue.Queue()
            if self._reader is None:
                self._reader = threading.Thread(target=self._read, daemon=True)
                self._reader.start()
        outputs = None
        while True:
            m = messages.get(timeout=300)
            if m.get("msg") == "process_generating":
                data = m["output"]["data"]
                outputs = list(data) if outputs is None else [apply_diff(o, d) for o, d in zip(outputs, data)]
                yield outputs
            elif m.get("msg") == "process_completed":
                if not m.get("success", False):
                    raise RuntimeError(f"{api_name} failed: {m.get('output') or m.get('title')}")
                if outputs is None:  # not a generator: the outputs come whole, once
                    yield m["output"]["data"]
                return

    def predict(self, api_name: str, data: list | None = None) -> list:
        last: list = []
        for outputs in self.stream(api_name, data or []):
            last = outputs
        return last

    def _read(self) -> None:
        while True:
            with self._lock:
                if not self._events:
                    self._reader = None
                    return
            try:
                with self.http.stream("GET", self.api + "queue/data", params={"session_hash": self.hash}) as s:
                    for line in sse.lines(s.iter_text()):
                        if not line.startswith("data:"):
                            continue
                        m = json.loads(line[5:])
                        with self._lock:
                            target = self._events.get(m.get("event_id"))
                            if m.get("msg") == "process_completed":
                                self._events.pop(m.get("event_id"), None)
                        if target is not None:
                            target.put(m)
            except Exception as exc:  # the stream broke: every pending event ends with the reason
                with self._lock:
                    pending, self._events = list(self._events.values()), {}
                for q in pending:
                    q.put({"msg": "process_completed", "success": False, "output": f"{type(exc).__name__}: {exc}"})


def reply_text(history: list[dict]) -> str:
    """The assistant's reply so far: "" while the history ends with the user's message."""
    if not history or history[-1].get("role") != "assistant":
        return ""
    return text_of(history[-1].get("content") or "")  # it comes back as [{"type": "text", "text": ...}]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(model: str | None, timeout_s: float = 180.0, presenter_token: str | None = None,
           log: Path | None = None, args: list[str] | None = None) -> tuple[subprocess.Popen, str]:
    """`python app.py` in its own process, as a user runs it. The token goes in through the environment (a command
    line shows in `ps`); `log`: where its output goes (default: nowhere)."""
    port = free_port()
    env = {**os.environ, "GRADIO_SERVER_NAME": "127.0.0.1", "GRADIO_SERVER_PORT": str(port)}
    if presenter_token:
        env["WATCH_LLM_PRESENTER_TOKEN"] = presenter_token
    cmd = [sys.executable, str(Path(__file__).resolve().parent.parent / "app.py"), "--device", "cpu", *(args or [])]
    if model:
        cmd += ["--model", model]
    out = open(log, "w") if log is not None else subprocess.DEVNULL  # noqa: SIM115 - the child's, for its life
    proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}/"
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"app.py exited with code {proc.returncode}")
        try:
            urllib.request.urlopen(url, timeout=2)
            return proc, url
        except OSError:
            time.sleep(0.5)
    proc.kill()
    raise RuntimeError(f"app.py did not serve {url} within {timeout_s:.0f} s")


def page_config(url: str) -> dict:
    """The page's components and events, as the page's own script reads them."""
    with urllib.request.urlopen(url + "config", timeout=30) as r:
        return json.load(r)


def fn_ids(config: dict) -> dict[str, int]:
    """Each named event's id, which a Session joins the queue with."""
    return {d["api_name"]: d["id"] for d in config["dependencies"] if d.get("api_name")}


def open_sessions(url: str, n: int) -> list[Session]:
    """n sessions, each its own tab."""
    ids = fn_ids(page_config(url))
    sessions = [Session(url, ids) for _ in range(n)]
    for session in sessions:
        session.load()
    return sessions
