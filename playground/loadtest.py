"""Does the page stay responsive? Concurrent chats with and without refreshing dashboards, over HTTP.

    python -m playground.loadtest [--chats 4] [--dashboards 8] [--max-tokens 64] [--model PATH]

Starts the app on a free local port, then runs the same chats twice: alone, and while N simulated
dashboard tabs each poll the dashboard endpoint once a second (what every open tab's gr.Timer does).
Prints TTFT and inter-token gaps as the clients saw them. A benchmark, not a test: nothing is asserted.
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
from dataclasses import dataclass, field
from pathlib import Path

os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")

PROMPTS = ["Tell me about the moon.", "Write a short poem about rain.", "How do bees make honey?",
           "Explain what a compiler does.", "Give me three tips for sleeping well.", "What is a black hole?",
           "Describe a walk in the forest.", "Why is the sky blue?"]


@dataclass
class ChatTiming:
    ttft_s: float | None = None
    gaps_s: list[float] = field(default_factory=list)
    updates: int = 0


@dataclass
class PhaseResult:
    phase: str
    chats: list[ChatTiming]
    dashboard_refreshes: int
    wall_s: float

    def row(self) -> dict:
        ttfts = [c.ttft_s for c in self.chats if c.ttft_s is not None]
        gaps = sorted(g for c in self.chats for g in c.gaps_s)
        p95 = gaps[int(0.95 * (len(gaps) - 1))] if gaps else None
        return {"phase": self.phase, "chats": len(self.chats), "mean TTFT (s)": _mean(ttfts),
                "max TTFT (s)": max(ttfts, default=None), "mean gap (s)": _mean(gaps), "p95 gap (s)": p95,
                "max gap (s)": max(gaps, default=None),
                "dashboard refreshes/s": self.dashboard_refreshes / self.wall_s if self.wall_s else 0.0}


def _mean(values):
    return statistics.fmean(values) if values else None


def chat_once(url: str, prompt: str, max_tokens: int) -> ChatTiming:
    from gradio_client import Client
    client = Client(url, verbose=False)
    timing = ChatTiming()
    start = last = time.perf_counter()
    job = client.submit(prompt, [], 0.0, max_tokens, api_name="/chat")
    for history, _stats in job:
        now = time.perf_counter()
        if len(history) < 2 or not history[-1].get("content"):
            continue
        if timing.ttft_s is None:
            timing.ttft_s = now - start
        else:
            timing.gaps_s.append(now - last)
        last = now
        timing.updates += 1
    return timing


def poll_dashboard(url: str, stop: threading.Event, counter: list[int]) -> None:
    from gradio_client import Client
    client = Client(url, verbose=False)
    while not stop.is_set():
        t = time.perf_counter()
        client.predict(api_name="/dashboard")
        counter[0] += 1
        stop.wait(max(0.0, 1.0 - (time.perf_counter() - t)))


def run_phase(url: str, phase: str, num_chats: int, num_dashboards: int, max_tokens: int) -> PhaseResult:
    stop, counter = threading.Event(), [0]
    pollers = [threading.Thread(target=poll_dashboard, args=(url, stop, counter), daemon=True)
               for _ in range(num_dashboards)]
    for p in pollers:
        p.start()
    if pollers:
        time.sleep(2.0)  # let the dashboards settle into their rhythm first
    results: list[ChatTiming | None] = [None] * num_chats
    start = time.perf_counter()

    def run(i: int) -> None:
        results[i] = chat_once(url, PROMPTS[i % len(PROMPTS)], max_tokens)
    threads = [threading.Thread(target=run, args=(i,)) for i in range(num_chats)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - start
    stop.set()
    for p in pollers:
        p.join(timeout=5)
    return PhaseResult(phase, [r for r in results if r is not None], counter[0], wall)


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


def loadtest(num_chats: int = 4, num_dashboards: int = 8, max_tokens: int = 64,
             model: str | None = None) -> list[dict]:
    proc, url = launch(model)
    try:
        chat_once(url, "Hi", 8)  # warm-up
        return [run_phase(url, "chats only", num_chats, 0, max_tokens).row(),
                run_phase(url, f"chats + {num_dashboards} dashboards", num_chats, num_dashboards, max_tokens).row()]
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--chats", type=int, default=4)
    parser.add_argument("--dashboards", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--model", default=None)
    args = parser.parse_args()
    from engine.bench import markdown_table
    print(markdown_table(loadtest(args.chats, args.dashboards, args.max_tokens, args.model)))


if __name__ == "__main__":
    main()
