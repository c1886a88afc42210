"""The room under abuse: one client that lies about who it is floods the page and the API, and another guesses the
presenter token, while a real visitor chats and the presenter unlocks. server/hostile.py is the API's suite of bad
bodies; this is the page's: fairness, identity and the token.

    python -m playground.hostile_room [--model PATH] [--seconds 30]      # launches app.py (token mode) itself
    python -m playground.hostile_room --url http://127.0.0.1:7860/ --token SECRET

Loopback only. Each actor connects from its own loopback address, which is what the server sees as who it is: the
real visitor from 127.0.0.1, the flooder from 127.0.0.7, the guesser and the presenter from 127.0.0.9 (one network:
the presenter shares an address with the stranger guessing). Prints one table: the real visitor's time to first
token quiet and under the flood, what the flooder got (replies streaming at once, at most; refused calls), how many
wrong tokens were compared a second, how soon the presenter's Unlock answered, the 5xx count, the slowest refusal,
and, when it launched the app, the tracebacks in its log.
"""
from __future__ import annotations

import argparse
import json
import re
import statistics
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from .page_client import Session, fn_ids, launch, page_config, reply_text

VISITOR, FLOODER, GUESSER = "127.0.0.1", "127.0.0.7", "127.0.0.9"
REFUSED_WORDS = ("replies on their way", "replies are already on their way", "at most")


@dataclass
class Tally:
    statuses: dict[int, int] = field(default_factory=dict)
    refusal_s: list[float] = field(default_factory=list)  # how long each refused call took to be refused
    streaming: list[tuple[float, float]] = field(default_factory=list)  # the flooder's replies: (first token, end)
    refused_replies: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)

    def status(self, code: int, seconds: float) -> None:
        with self.lock:
            self.statuses[code] = self.statuses.get(code, 0) + 1
            if code in (400, 408, 413, 415, 429, 503):
                self.refusal_s.append(seconds)

    def most_at_once(self) -> int:
        edges = sorted([(a, 1) for a, _ in self.streaming] + [(b, -1) for _, b in self.streaming])
        now = most = 0
        for _, d in edges:
            now += d
            most = max(most, now)
        return most


def chat_ttft(session: Session, message: str, max_tokens: int = 16,
              temperature: float = 0.0) -> tuple[float | None, str, float | None]:
    """Send one chat from a page; (seconds to its first reply text or None, the reply, the engine's own TTFT from
    the reply's stats line: the rest of the page's wait is the server's delivery)."""
    start, first, text, stats = time.perf_counter(), None, "", ""
    for outputs in session.stream("chat", [message, [], temperature, max_tokens, None]):
        text = reply_text(outputs[0]) if outputs and outputs[0] else ""
        stats = outputs[1] if outputs and len(outputs) > 1 and isinstance(outputs[1], str) else stats
        if text and first is None:
            first = time.perf_counter() - start
    engine = re.search(r"TTFT (\d+) ms", stats)
    return first, text, int(engine.group(1)) / 1e3 if engine else None


def visitor_ttfts(url: str, ids: dict[str, int], n: int) -> tuple[list[float], list[float]]:
    """The real visitor's n chats: (the page's times to first token, the engine's)."""
    session = Session(url, ids, source=VISITOR)
    session.load()
    page, engine = [], []
    for i in range(n):
        ttft, text, engine_ttft = chat_ttft(session, f"Say something short about the number {i}.")
        if ttft is not None and not text.startswith("⚠️"):
            page.append(ttft)
            if engine_ttft is not None:
                engine.append(engine_ttft)
    return page, engine


def flood(url: str, ids: dict[str, int], tally: Tally, stop: threading.Event, max_calls: int = 150) -> None:
    """One client from FLOODER: page chats each under a fresh session hash, page loads for fresh visitor ids and a
    chat on each, API streams claiming other addresses; all at once, until `stop`."""
    import httpx

    def page_chat(load: bool) -> None:
        session = Session(url, ids, source=FLOODER)
        session.hash = uuid.uuid4().hex[:11]
        t0 = time.perf_counter()
        try:
            if load:
                session.load()
            sent = time.perf_counter()
            ttft, text, _ = chat_ttft(session, "Write a long story about the sea.", 256, temperature=1.0)
            if text.startswith("⚠️") and any(w in text for w in REFUSED_WORDS):
                with tally.lock:
                    tally.refused_replies += 1
            elif ttft is not None:
                with tally.lock:
                    tally.streaming.append((sent + ttft, time.perf_counter()))
            tally.status(200, time.perf_counter() - t0)
        except Exception as exc:  # a join refused (the queue's bound), or the stream cut
            code = 429 if "429" in str(exc) else 503 if "503" in str(exc) else 0
            tally.status(code, time.perf_counter() - t0)

    def api_stream(i: int) -> None:
        headers = {"X-Forwarded-For": f"10.{i % 250}.0.1", "Forwarded": f"for=10.{i % 250}.1.1"}
        t0 = time.perf_counter()
        try:
            with httpx.Client(transport=httpx.HTTPTransport(local_address=FLOODER), timeout=120) as http:
                with http.stream("POST", url + "v1/completions", headers=headers,
                                 json={"prompt": "Once upon a time", "max_tokens": 256, "stream": True}) as r:
                    tally.status(r.status_code, time.perf_counter() - t0)
                    if r.status_code != 200:
                        return
                    first = None
                    for line in r.iter_lines():
                        if line.startswith("data:") and first is None:
                            first = time.perf_counter()
                    if first is not None:
                        with tally.lock:
                            tally.streaming.append((first, time.perf_counter()))
        except httpx.HTTPError:
            tally.status(0, time.perf_counter() - t0)

    threads = []
    for i in range(max_calls):
        if stop.is_set():
            break
        kind = i % 3
        target: Callable = page_chat if kind < 2 else api_stream
        t = threading.Thread(target=target, args=(kind == 1,) if kind < 2 else (i,), daemon=True)
        t.start()
        threads.append(t)
        time.sleep(0.05)
    stop.wait()
    for t in threads:
        t.join(timeout=5)


def guess(url: str, ids: dict[str, int], token: str, n: int = 50) -> tuple[int, int, float, float]:
    """n wrong tokens from GUESSER (page events carrying the header), and meanwhile the presenter's Unlock from the
    same address: (guesses compared with the token, guesses held back, seconds they took, seconds the Unlock
    took)."""
    wrong = Session(url, ids, headers={"X-Presenter-Token": "not-the-token"}, source=GUESSER)
    compared = held = 0
    unlocked: list[float] = []

    def presenter() -> None:
        time.sleep(1.0)
        page = Session(url, ids, source=GUESSER)
        page.load()
        t0 = time.perf_counter()
        said = json.dumps(page.predict("unlock", [token]))
        unlocked.append(time.perf_counter() - t0 if "Unlocked" in said else float("nan"))
    helper = threading.Thread(target=presenter, daemon=True)
    helper.start()
    start = time.perf_counter()
    for _ in range(n):
        time.sleep(0.2)  # five a second for ten seconds: long enough to show the steady rate, not just the first
        try:
            wrong.predict("pause", [])
        except RuntimeError as exc:
            if "after a wrong presenter token" in str(exc):
                held += 1
            else:
                compared += 1
    took = time.perf_counter() - start
    helper.join(timeout=60)
    return compared, held, took, unlocked[0] if unlocked else float("nan")


def run(url: str, token: str, seconds: float = 30.0, n: int = 8) -> dict:
    ids = fn_ids(page_config(url))
    quiet, quiet_engine = visitor_ttfts(url, ids, n)
    tally, stop = Tally(), threading.Event()
    flooder = threading.Thread(target=flood, args=(url, ids, tally, stop), daemon=True)
    flooder.start()
    time.sleep(min(5.0, seconds / 3))  # the flood is on before the visitor measures
    flooded, flooded_engine = visitor_ttfts(url, ids, n)
    compared, held, guess_s, unlock_s = guess(url, ids, token)
    time.sleep(max(0.0, seconds - 5.0))
    stop.set()
    flooder.join(timeout=120)
    return {"quiet": quiet, "flooded": flooded, "quiet_engine": quiet_engine, "flooded_engine": flooded_engine,
            "most_at_once": tally.most_at_once(),
            "flooder_replies": len(tally.streaming), "flooder_refused": tally.refused_replies,
            "statuses": tally.statuses, "slowest_refusal_s": max(tally.refusal_s, default=0.0),
            "compared": compared, "held": held, "guess_s": guess_s, "unlock_s": unlock_s}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", default=None, help="a running app (token mode); default: launch app.py here")
    parser.add_argument("--token", default="hostile-room-secret", help="its presenter token")
    parser.add_argument("--model", default=None, help="what the launched app runs (default: the embedded model)")
    parser.add_argument("--seconds", type=float, default=30.0, help="how long the flood lasts")
    args = parser.parse_args()
    proc, log = None, None
    url = args.url
    if url is None:
        log = Path("hostile-room-app.log").resolve()
        proc, url = launch(args.model, presenter_token=args.token, log=log)
    if not url.endswith("/"):
        url += "/"
    try:
        out = run(url, args.token, args.seconds)
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(30)
    quiet, flooded = out["quiet"], out["flooded"]
    median = lambda xs: statistics.median(xs) if xs else float("nan")  # noqa: E731
    print("| what | measured |\n|---|---|")
    print(f"| real visitor's TTFT, quiet (median of {len(quiet)}) | {1e3 * median(quiet):.0f} ms |")
    print(f"| real visitor's TTFT, flooded (median of {len(flooded)}) | {1e3 * median(flooded):.0f} ms "
          f"({median(flooded) / median(quiet):.2f}x) |")
    print(f"| of which the engine's own TTFT, quiet / flooded | {1e3 * median(out['quiet_engine']):.0f} ms / "
          f"{1e3 * median(out['flooded_engine']):.0f} ms |")
    print(f"| flooder's replies streaming at once, at most | {out['most_at_once']} |")
    print(f"| flooder's replies served / refused by its share | {out['flooder_replies']} / {out['flooder_refused']} |")
    print(f"| wrong tokens compared / held back (50 sent in {out['guess_s']:.1f} s) | {out['compared']} / "
          f"{out['held']} ({out['compared'] / max(out['guess_s'], 1e-9):.2f} compared a second) |")
    print(f"| the presenter's Unlock meanwhile, same address | {out['unlock_s']:.2f} s |")
    print(f"| statuses | {', '.join(f'{k}: {v}' for k, v in sorted(out['statuses'].items()))} |")
    print(f"| 5xx | {sum(v for k, v in out['statuses'].items() if k >= 500)} |")
    print(f"| slowest refusal | {out['slowest_refusal_s']:.2f} s |")
    if log is not None:
        text = log.read_text(errors="replace")
        print(f"| tracebacks in the app's log | {text.count('Traceback')} ({log}) |")


if __name__ == "__main__":
    main()
