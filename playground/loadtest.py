"""Does the page stay responsive? Open sessions polling the page while some of them chat, over HTTP.

    python -m playground.loadtest [--sessions 30] [--chats 8] [--max-tokens 64] [--model PATH]
    python -m playground.loadtest --chats 4 --dashboards 8     # 4 chatting sessions + 8 that only watch
    python -m playground.loadtest --workshop --sessions 38 --chats 8 --duration 60 --toggle-s 20

Starts the app on a free local port, then runs the same chats twice: alone, and while every open session polls
the page as a browser tab does (dashboard once a second, a chatting tab's live view while its reply streams).
Prints TTFT, the gaps between streamed tokens as the clients saw them (p95 is the workshop's number), how long
polls took, the CPU the app and the clients used (100% = one core), and every error. A benchmark, not a test.

--workshop: the app starts with a presenter token, every session is audience (its chats under the audience's
caps), the chatting sessions chat again and again for --duration seconds, and one more session, the presenter
(sending the token as X-Presenter-Token), turns prefix caching off and on through the page's own apply_settings
every --toggle-s seconds, as a presenter in front of a room would.
"""
from __future__ import annotations

import argparse
import os
import statistics
import threading
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field

from .page_client import Session, fn_ids, launch, open_sessions, page_config, reply_text

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
        """An update of the chat, `elapsed_s` after the message was sent, `text` the reply so far. Only new text is
        a streamed token: the first update echoes the user's message, and the last may carry the stats line alone."""
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
    toggles: int = 0  # settings changes the presenter applied meanwhile (--workshop)

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
                "presenter toggles": self.toggles, "errors": sum(self.tally.errors.values())}


def percentile(ordered: list[float], q: float) -> float | None:
    return ordered[int(q * (len(ordered) - 1))] if ordered else None


def _share(cpu_s: float | None, wall_s: float) -> float | None:
    return 100 * cpu_s / wall_s if cpu_s is not None and wall_s else None


def _mean(values):
    return statistics.fmean(values) if values else None


def chat_once(session: Session, prompt: str, max_tokens: int, tally: Tally | None = None) -> ChatTiming:
    """One chat through the /chat endpoint, as a tab sends it (its session state is the server's)."""
    timing = ChatTiming()
    start = time.perf_counter()
    for history, _stats in session.stream("/chat", [prompt, [], 0.0, max_tokens, None]):
        timing.saw(time.perf_counter() - start, reply_text(history))
    reply = timing.reply
    if tally is not None and (not reply or reply.startswith("⚠️") or "[engine error" in reply):
        tally.error("chat", f"the reply was {reply[:80]!r}")
    return timing


# what a browser tab sends with each poll: one value per input, a state's as None (the server keeps its own);
# /dashboard's last is the page's clock (its period)
POLL_INPUTS = {"/chat_view": [None], "/dashboard": [None, None, None, 1.0]}


def poll(session, api_name: str, kind: str, stop: threading.Event, tally: Tally) -> None:
    while not stop.is_set():
        t = time.perf_counter()
        try:
            session.predict(api_name, POLL_INPUTS[api_name])
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


class Presenter:
    """A presenter's session: flips prefix caching through the page's apply_settings, as the form sends it (every
    field as the engine has it, read from the page's own settings endpoint; one changed)."""

    def __init__(self, url: str, token: str) -> None:
        config = page_config(url)
        self.session = Session(url, fn_ids(config), headers={"X-Presenter-Token": token})
        self.session.load()
        fields = {c["id"]: (c.get("props") or {}).get("elem_id") or "" for c in config["components"]}
        deps = {d.get("api_name"): d for d in config["dependencies"]}
        self.inputs = [fields.get(i, "").removeprefix("setting-") for i in deps["apply_settings"]["inputs"]]
        self.form = [fields.get(i, "").removeprefix("setting-") for i in deps["settings"]["outputs"]]
        self.on = True

    def toggle(self) -> str:
        loaded = dict(zip(self.form, self.session.predict("/settings")))
        values = {k: v.get("value") if isinstance(v, dict) and "__type__" in v else v for k, v in loaded.items()}
        self.on = not values.get("prefix_caching", self.on)
        values["prefix_caching"] = self.on
        out = self.session.predict("/apply_settings", [None if not f else values.get(f) for f in self.inputs])
        return out[0] if out else ""


def run_phase(sessions: list, phase: str, num_chats: int, watch: bool, max_tokens: int,
              server_pid: int | None = None, duration_s: float = 0.0, presenter: Presenter | None = None,
              toggle_s: float = 20.0) -> PhaseResult:
    """The first num_chats sessions chat at once (again until `duration_s`; 0: once). With `watch`, every session
    polls the dashboard meanwhile. `server_pid`: the app's process, whose CPU use the phase reports."""
    tally, stop = Tally(), threading.Event()
    pollers = [threading.Thread(target=poll, args=(s, "/dashboard", "dashboard_polls", stop, tally), daemon=True)
               for s in (sessions if watch else [])]
    polling_from = time.perf_counter()
    for p in pollers:
        p.start()
    if pollers:
        time.sleep(2.0)  # let the sessions settle into their rhythm first
    cpu_from, clients_from = cpu_seconds(server_pid), time.process_time()
    start = time.perf_counter()

    results: list[ChatTiming | None] = []
    results_lock = threading.Lock()
    toggles = [0]

    def run(i: int) -> None:
        view_stop = threading.Event()
        viewer = threading.Thread(target=poll, args=(sessions[i], "/chat_view", "view_polls", view_stop, tally),
                                  daemon=True) if watch else None
        if viewer:
            viewer.start()
        try:
            n = 0
            while True:
                try:
                    timing = chat_once(sessions[i], PROMPTS[(i + n) % len(PROMPTS)], max_tokens, tally)
                    with results_lock:
                        results.append(timing)
                except Exception as exc:
                    tally.error("chat", f"{type(exc).__name__}: {exc}")
                n += 1
                if time.perf_counter() - start >= duration_s:
                    break
        finally:
            view_stop.set()
            if viewer:
                viewer.join(timeout=10)

    def steer() -> None:
        while not stop.wait(toggle_s):
            try:
                note = presenter.toggle()
                if note.startswith("Applied"):
                    toggles[0] += 1
                else:
                    tally.error("presenter", note)
            except Exception as exc:
                tally.error("presenter", f"{type(exc).__name__}: {exc}")
    steering = threading.Thread(target=steer, daemon=True) if presenter else None
    if steering:
        steering.start()
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
    if steering:
        steering.join(timeout=30)
    return PhaseResult(phase, len(sessions) if watch else num_chats, results, tally, wall, polling,
                       cpu_to - cpu_from if cpu_from is not None and cpu_to is not None else None, clients_cpu,
                       toggles[0])


def loadtest(num_sessions: int = 12, num_chats: int = 4, max_tokens: int = 64, model: str | None = None,
             workshop: bool = False, duration_s: float = 0.0, toggle_s: float = 20.0) -> list[PhaseResult]:
    num_sessions = max(num_sessions, num_chats)
    token = uuid.uuid4().hex if workshop else None
    proc, url = launch(model, presenter_token=token)
    try:
        sessions = open_sessions(url, num_sessions)
        chat_once(sessions[0], "Hi", 8)  # warm-up
        presenter = Presenter(url, token) if workshop else None
        watched = (f"{num_chats} audience chats + {num_sessions} audience sessions + the presenter toggling "
                   f"prefix caching every {toggle_s:.0f} s" if workshop else
                   f"{num_chats} chats + {num_sessions} open sessions")
        return [run_phase(sessions, "chats only", num_chats, False, max_tokens, proc.pid, duration_s),
                run_phase(sessions, watched, num_chats, True, max_tokens, proc.pid, duration_s, presenter, toggle_s)]
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
    parser.add_argument("--workshop", action="store_true",
                        help="a presenter token, every session audience, the presenter flipping a switch meanwhile")
    parser.add_argument("--duration", type=float, default=0.0, help="each chatting session chats again until then")
    parser.add_argument("--toggle-s", type=float, default=20.0, help="--workshop: seconds between the flips")
    args = parser.parse_args()
    sessions = args.sessions if args.sessions is not None else args.chats + args.dashboards
    from engine.measure import markdown_table
    phases = loadtest(sessions, args.chats, args.max_tokens, args.model, args.workshop, args.duration, args.toggle_s)
    print(markdown_table([p.row() for p in phases]))
    errors = Counter()
    for p in phases:
        errors.update({f"[{p.phase}] {what}": n for what, n in p.tally.errors.items()})
    print(f"\nsession errors: {sum(errors.values())}")
    for what, n in errors.most_common():
        print(f"  {n} x {what}")


if __name__ == "__main__":
    main()
