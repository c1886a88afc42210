"""Does the page stay responsive? Open sessions polling the page while some of them chat, over HTTP.

    python -m playground.loadtest [--sessions 30] [--chats 8] [--max-tokens 64] [--model PATH]
    python -m playground.loadtest --chats 4 --dashboards 8     # 4 chatting sessions + 8 that only watch

Starts the app on a free local port, then runs the same chats twice: alone, and while every open session polls
the page as a browser tab does: the page's clock asks for the status line and dashboard once a second, and a
chatting tab's live view asks for its own view once a second while its reply streams. Each session is its own
gradio client (its own session). Prints TTFT, the gaps between streamed tokens as the clients saw them (p95 is
the workshop's number; tokens that arrive within one display frame count as one update of the text), how long
polls took, the CPU the app's process and the clients used (100% = one core), and every error a session met.
A benchmark, not a test.
"""
from __future__ import annotations

import argparse
import os
import socket
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")

PROMPTS = ["Tell me about the moon.", "Write a short poem about rain.", "How do bees make honey?",
           "Explain what a compiler does.", "Give me three tips for sleeping well.", "What is a black hole?",
           "Describe a walk in the forest.", "Why is the sky blue?"]
POLL_S = 1.0  # what every tab's timer does
# Tokens that arrive within one display frame of each other show as one step of the reply: a stalled stream
# that then delivers 30 tokens at once is one long gap, not one long gap and 29 of zero (which made a p95 of 0).
FRAME_S = 1 / 60


@dataclass
class ChatTiming:
    ttft_s: float | None = None
    gaps_s: list[float] = field(default_factory=list)  # between steps of the reply's text on screen (FRAME_S)
    updates: int = 0  # updates that brought new text (the first token's included)
    reply: str = ""  # the reply so far
    _last_s: float = 0.0  # when the text last grew, since the message was sent

    def saw(self, elapsed_s: float, text: str) -> None:
        """An update of the chat, `elapsed_s` after the message was sent, showing `text` as the reply so far. Only
        an update that brings new text is a streamed token: the first update echoes the user's message (its reply
        is ""), and one may carry the stats line alone (the last one does)."""
        if not text or text == self.reply:
            return
        self.reply = text
        self.updates += 1
        if self.ttft_s is None:
            self.ttft_s = elapsed_s
        elif elapsed_s - self._last_s >= FRAME_S:  # within a frame: a burst, one step of the text on screen
            self.gaps_s.append(elapsed_s - self._last_s)
        self._last_s = elapsed_s


@dataclass
class Tally:
    """What one phase's sessions saw, shared by their threads."""
    lock: threading.Lock = field(default_factory=threading.Lock)
    dashboard_polls: int = 0
    view_polls: int = 0
    poll_s: list[float] = field(default_factory=list)  # how long each poll took
    errors: Counter = field(default_factory=Counter)  # "where: what" -> count

    def polled(self, kind: str, seconds: float) -> None:
        with self.lock:
            setattr(self, kind, getattr(self, kind) + 1)
            self.poll_s.append(seconds)

    def error(self, where: str, what: str) -> None:
        with self.lock:
            self.errors[f"{where}: {what[:200]}"] += 1


@dataclass
class PhaseResult:
    phase: str
    sessions: int
    chats: list[ChatTiming]
    tally: Tally
    wall_s: float  # from the first chat sent to the last reply ended
    polling_s: float  # how long the sessions polled the dashboard (from before the chats to after them)
    server_cpu_s: float | None = None  # CPU time the app's process used from the first chat to the last reply
    clients_cpu_s: float | None = None  # and this process, the sessions' clients, on the same machine

    def row(self) -> dict:
        ttfts = [c.ttft_s for c in self.chats if c.ttft_s is not None]
        gaps = sorted(g for c in self.chats for g in c.gaps_s)
        return {"phase": self.phase, "sessions": self.sessions, "chats": len(self.chats),
                "updates": sum(c.updates for c in self.chats), "wall (s)": self.wall_s,
                "mean TTFT (s)": _mean(ttfts), "max TTFT (s)": max(ttfts, default=None),
                "mean gap (s)": _mean(gaps), "p95 gap (s)": percentile(gaps, 0.95),
                "max gap (s)": max(gaps, default=None),
                "dashboard polls/s": self.tally.dashboard_polls / self.polling_s if self.polling_s else 0.0,
                "view polls/s": self.tally.view_polls / self.wall_s if self.wall_s else 0.0,
                "p95 poll (s)": percentile(sorted(self.tally.poll_s), 0.95),
                "app CPU (%)": _share(self.server_cpu_s, self.wall_s),
                "clients CPU (%)": _share(self.clients_cpu_s, self.wall_s),
                "errors": sum(self.tally.errors.values())}


def percentile(ordered: list[float], q: float) -> float | None:
    return ordered[int(q * (len(ordered) - 1))] if ordered else None


def _share(cpu_s: float | None, wall_s: float) -> float | None:
    return 100 * cpu_s / wall_s if cpu_s is not None and wall_s else None


def _mean(values):
    return statistics.fmean(values) if values else None


def client(url: str):
    """A session. ssl_verify=False: the app is served over plain HTTP on this machine, and with verification on,
    gradio_client's httpx loads the system's CA bundle for every request it makes (two per poll): ~65 ms of CPU
    per poll on the cores the app runs on, which no browser costs it (measured: 83% of these clients' CPU)."""
    from gradio_client import Client
    return Client(url, verbose=False, ssl_verify=False)


def chat_once(session, prompt: str, max_tokens: int, tally: Tally | None = None,
              view_stop: threading.Event | None = None) -> ChatTiming:
    """One chat through the /chat endpoint. With `view_stop`, the session's live view is polled meanwhile."""
    timing = ChatTiming()
    start = time.perf_counter()
    job = session.submit(prompt, [], 0.0, max_tokens, api_name="/chat")
    for history, _stats in job:
        timing.saw(time.perf_counter() - start, _reply(history))
    job.result()  # raises what the server raised
    reply = timing.reply
    if tally is not None and (not reply or reply.startswith("⚠️") or "[engine error" in reply):
        tally.error("chat", f"the reply was {reply[:80]!r}")
    return timing


def _reply(history: list[dict]) -> str:
    """The assistant's reply so far: "" while the history ends with the user's message."""
    if not history or history[-1].get("role") != "assistant":
        return ""
    return _text(history[-1].get("content"))


def _text(content) -> str:
    """An assistant message's content comes back as [{"type": "text", "text": ...}] from gradio_client."""
    if isinstance(content, list):
        return "".join(part.get("text", "") for part in content if isinstance(part, dict))
    return "" if content is None else str(content)


def poll(session, api_name: str, kind: str, stop: threading.Event, tally: Tally) -> None:
    while not stop.is_set():
        t = time.perf_counter()
        try:
            session.predict(api_name=api_name)
            tally.polled(kind, time.perf_counter() - t)
        except Exception as exc:  # a session that errors keeps going, and the error is counted
            tally.error(api_name, f"{type(exc).__name__}: {exc}")
        stop.wait(max(0.0, POLL_S - (time.perf_counter() - t)))


def cpu_seconds(pid: int | None) -> float | None:
    """CPU time (user + system) the process has used so far, from /proc (None where there is none)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, TypeError):
        return None


def run_phase(sessions: list, phase: str, num_chats: int, watch: bool, max_tokens: int,
              server_pid: int | None = None) -> PhaseResult:
    """The first num_chats sessions chat at once. With `watch`, every session polls the dashboard meanwhile, and
    each chatting one its live view while its reply streams. `server_pid`: the app's process, whose CPU use the
    phase reports (100% is one core)."""
    tally, stop = Tally(), threading.Event()
    pollers = [threading.Thread(target=poll, args=(s, "/dashboard", "dashboard_polls", stop, tally), daemon=True)
               for s in (sessions if watch else [])]
    polling_from = time.perf_counter()
    for p in pollers:
        p.start()
    if pollers:
        time.sleep(2.0)  # let the sessions settle into their rhythm first
    results: list[ChatTiming | None] = [None] * num_chats
    cpu_from, clients_from = cpu_seconds(server_pid), time.process_time()
    start = time.perf_counter()

    def run(i: int) -> None:
        view_stop = threading.Event()
        viewer = threading.Thread(target=poll, args=(sessions[i], "/chat_view", "view_polls", view_stop, tally),
                                  daemon=True) if watch else None
        if viewer:
            viewer.start()
        try:
            results[i] = chat_once(sessions[i], PROMPTS[i % len(PROMPTS)], max_tokens, tally)
        except Exception as exc:
            tally.error("chat", f"{type(exc).__name__}: {exc}")
        finally:
            view_stop.set()
            if viewer:
                viewer.join(timeout=10)
    threads = [threading.Thread(target=run, args=(i,)) for i in range(num_chats)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - start
    cpu_to, clients_cpu = cpu_seconds(server_pid), time.process_time() - clients_from
    stop.set()
    polling = time.perf_counter() - polling_from if pollers else 0.0
    for p in pollers:
        p.join(timeout=10)
    return PhaseResult(phase, len(sessions) if watch else num_chats, [r for r in results if r is not None], tally,
                       wall, polling, cpu_to - cpu_from if cpu_from is not None and cpu_to is not None else None,
                       clients_cpu)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(model: str | None, timeout_s: float = 180.0) -> tuple[subprocess.Popen, str]:
    """`python app.py` in its own process, as a user runs it; the clients here play the browsers."""
    port = free_port()
    env = {**os.environ, "GRADIO_SERVER_NAME": "127.0.0.1", "GRADIO_SERVER_PORT": str(port)}
    cmd = [sys.executable, str(Path(__file__).resolve().parent.parent / "app.py"), "--device", "cpu"]
    if model:
        cmd += ["--model", model]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
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


def open_sessions(url: str, n: int) -> list:
    """n gradio clients, each its own session (as n browser tabs), opened in parallel."""
    sessions: list = [None] * n

    def open_one(i: int) -> None:
        sessions[i] = client(url)
    threads = [threading.Thread(target=open_one, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return sessions


def loadtest(num_sessions: int = 12, num_chats: int = 4, max_tokens: int = 64,
             model: str | None = None) -> list[PhaseResult]:
    num_sessions = max(num_sessions, num_chats)
    proc, url = launch(model)
    try:
        sessions = open_sessions(url, num_sessions)
        chat_once(sessions[0], "Hi", 8)  # warm-up
        return [run_phase(sessions, "chats only", num_chats, False, max_tokens, proc.pid),
                run_phase(sessions, f"{num_chats} chats + {num_sessions} open sessions", num_chats, True,
                          max_tokens, proc.pid)]
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sessions", type=int, default=None,
                        help="open sessions polling the page, the chatting ones included (default: chats + dashboards)")
    parser.add_argument("--chats", type=int, default=4, help="sessions chatting at once")
    parser.add_argument("--dashboards", type=int, default=8,
                        help="sessions that only watch (when --sessions is not given)")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--model", default=None)
    args = parser.parse_args()
    sessions = args.sessions if args.sessions is not None else args.chats + args.dashboards
    from engine.bench import markdown_table
    phases = loadtest(sessions, args.chats, args.max_tokens, args.model)
    print(markdown_table([p.row() for p in phases]))
    errors = Counter()
    for p in phases:
        errors.update({f"[{p.phase}] {what}": n for what, n in p.tally.errors.items()})
    print(f"\nsession errors: {sum(errors.values())}")
    for what, n in errors.most_common():
        print(f"  {n} x {what}")


if __name__ == "__main__":
    main()
