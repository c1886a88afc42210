"""Watching another server: any server with the OpenAI API and vLLM's /metrics (a vLLM deployment, or another
instance of this app) instead of the engine in this process.

A thread scrapes URL/metrics every second into the same HistorySample series the local engine publishes (the
histograms as each interval's mean TTFT / inter-token latency), so the dashboard's own figure functions draw it.

The address is the presenter's to give (a visitor's typing must never become a server-side fetch): every fetch has
a total deadline and a size cap; what a remote answered is never shown (its words go to the server's log), its
model name only to the presenter, and every kind of unreachable reads the same, so the page is no port scanner."""
from __future__ import annotations

import json
import logging
import threading
import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass
from types import SimpleNamespace
from urllib.parse import urlsplit

import httpx
from prometheus_client.parser import text_string_to_metric_families

from engine import sse
from engine.service import HistorySample
from viz import figures
from viz.dashboard import ChatView, DashboardFigures

from . import conversation
from .conversation import WARNING
from .room import plain

log = logging.getLogger("watch_llm.remote")
NOT_REMOTE = "not available when attached to a remote server"
POLL_S = 1.0
MAX_POLL_S = 30.0  # scrapes failing in a row wait twice as long each time, up to this
DEADLINE_S = 5.0  # one fetch, connect to last byte
MAX_METRICS_BYTES = 2 << 20  # vLLM's /metrics is ~100 KB; a bigger body is refused, not parsed every second
MAX_SMALL_BYTES = 256 << 10  # /v1/models, an error body
# vLLM v1's names first, then v0's (older deployments), for each number the dashboard draws
GAUGES = {"num_running": ("vllm:num_requests_running",), "num_waiting": ("vllm:num_requests_waiting",),
          "kv_usage": ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc")}
COUNTERS = {"prefix_cache_queries": ("vllm:prefix_cache_queries", "vllm:gpu_prefix_cache_queries"),
            "prefix_cache_hits": ("vllm:prefix_cache_hits", "vllm:gpu_prefix_cache_hits"),
            "num_preemptions": ("vllm:num_preemptions",), "generation_tokens": ("vllm:generation_tokens",),
            "prompt_tokens": ("vllm:prompt_tokens",), "requests_finished": ("vllm:request_success",)}
HISTOGRAMS = {"ttft": ("vllm:time_to_first_token_seconds",),
              "itl": ("vllm:inter_token_latency_seconds", "vllm:time_per_output_token_seconds")}


@dataclass
class MetricsReading:
    """One scrape, summed over the server's engines (data-parallel vLLM has one label set per engine)."""
    time: float
    num_running: float = 0.0
    num_waiting: float = 0.0
    kv_usage: float | None = None  # 0..1, the mean over engines; None when the server does not say
    prefix_cache_queries: float = 0.0
    prefix_cache_hits: float = 0.0
    num_preemptions: float = 0.0
    generation_tokens: float = 0.0
    prompt_tokens: float = 0.0
    requests_finished: float = 0.0
    ttft_sum: float = 0.0
    ttft_count: float = 0.0
    itl_sum: float = 0.0
    itl_count: float = 0.0
    num_gpu_blocks: int | None = None  # vllm:cache_config_info's label, when the server publishes it


def parse_metrics(text: str, now: float | None = None) -> MetricsReading:
    """Prometheus text -> the numbers the dashboard draws. ValueError when it is not Prometheus text or has none
    of vLLM's metrics."""
    samples: dict[str, list] = {}  # by sample name: the parser groups a family's samples only when it can
    try:
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                samples.setdefault(sample.name, []).append(sample)
    except Exception as exc:  # the parser raises ValueError, and others on some malformed input
        raise ValueError(f"not Prometheus text format ({type(exc).__name__}: {exc})") from exc
    if not any(name.startswith("vllm:") for name in samples):
        raise ValueError("no vLLM metrics in it (vllm:num_requests_running, vllm:generation_tokens, ...)")
    reading = MetricsReading(time.time() if now is None else now)

    def values(names: tuple[str, ...], suffixes: tuple[str, ...]) -> list[float] | None:
        for name in names:
            for suffix in suffixes:
                if name + suffix in samples:
                    return [s.value for s in samples[name + suffix]]
        return None

    for key, names in GAUGES.items():
        found = values(names, ("",))
        if found:
            setattr(reading, key, sum(found) / len(found) if key == "kv_usage" else sum(found))
    for key, names in COUNTERS.items():
        found = values(names, ("_total", ""))
        if found:
            setattr(reading, key, sum(found))
    for key, names in HISTOGRAMS.items():
        for part in ("sum", "count"):
            found = values(names, (f"_{part}",))
            if found:
                setattr(reading, f"{key}_{part}", sum(found))
    blocks = [s.labels.get("num_gpu_blocks") for s in samples.get("vllm:cache_config_info", [])]
    if blocks and all(b is not None and str(b).isdigit() for b in blocks):
        reading.num_gpu_blocks = sum(int(b) for b in blocks)
    return reading


def usable_blocks(reading: MetricsReading, reserved: int = 0) -> int | None:
    """The blocks a request can hold: vLLM counts its null block in num_gpu_blocks and leaves it out of
    kv_cache_usage_perc (a 6-block pool holding 4 of its 5 usable blocks showed "5 / 6"), so `reserved` is 1
    for vLLM, 0 for this app."""
    return None if reading.num_gpu_blocks is None else max(1, reading.num_gpu_blocks - reserved)


def history_sample(step: int, cur: MetricsReading, prev: MetricsReading | None, reserved: int = 0) -> HistorySample:
    """A reading as one point of the dashboard's series: cumulative counters as they are, the interval's mean
    TTFT and inter-token latency (the remote TPOT) from the histograms' sums and counts."""
    def mean(part: str) -> float | None:
        if prev is None:
            return None
        count = getattr(cur, f"{part}_count") - getattr(prev, f"{part}_count")
        return (getattr(cur, f"{part}_sum") - getattr(prev, f"{part}_sum")) / count if count > 0 else None
    total = usable_blocks(cur, reserved) or 100  # without the pool's size, usage is drawn in percent
    return HistorySample(step, int(cur.num_running), int(cur.num_waiting), int(cur.num_preemptions),
                         round((cur.kv_usage or 0.0) * total), int(cur.prefix_cache_queries),
                         int(cur.prefix_cache_hits), int(cur.generation_tokens), time=cur.time, step_ms=0.0,
                         ttft_s=mean("ttft"), tpot_s=mean("itl"))


def counters_went_back(cur: MetricsReading, prev: MetricsReading) -> bool:
    """A counter that fell: the server restarted, and its series starts again."""
    return any(getattr(cur, k) < getattr(prev, k) for k in (*COUNTERS, "ttft_count", "itl_count"))


def base_url(url: str) -> str:
    url = (url or "").strip().rstrip("/")
    if not url:
        raise ValueError("no URL given: type the server's address, e.g. http://127.0.0.1:8000")
    if "://" not in url:
        url = "http://" + url
    if not url.startswith(("http://", "https://")):
        raise ValueError(f"{display_url(url)!r} is not an http:// or https:// address")
    try:
        host = urlsplit(url).hostname
    except ValueError:
        host = None
    if not host:
        raise ValueError("that address has no host name in it, e.g. http://127.0.0.1:8000")
    return url[:-3] if url.endswith("/v1") else url


def display_url(url: str) -> str:
    """An address as the room sees it: scheme://host:port, without credentials, path or query."""
    parts = urlsplit(url)
    host = parts.hostname or ""
    host = f"[{host}]" if ":" in host else host
    try:
        port = parts.port
    except ValueError:
        port = None
    return f"{parts.scheme}://{host}" + (f":{port}" if port else "")


def unreachable(url: str) -> str:
    """One message for every way of not answering (refused, no such host, timed out, cut off): the page must not
    tell a closed port from a missing host."""
    return f"no answer from {url} within {DEADLINE_S:.0f} s"


class TooLarge(ValueError):
    pass


def fetch(url: str, max_bytes: int, deadline_s: float = DEADLINE_S) -> tuple[int, bytes]:
    """GET url: (status, body), given up past `max_bytes` (TooLarge) or the deadline, so a server trickling one
    byte at a time cannot hold a worker longer. Any failure to get an answer: ValueError(unreachable)."""
    end = time.monotonic() + deadline_s
    try:
        with httpx.stream("GET", url, timeout=httpx.Timeout(deadline_s), follow_redirects=False) as response:
            chunks, size = [], 0
            for chunk in response.iter_bytes():
                size += len(chunk)
                if size > max_bytes:
                    raise TooLarge(f"{url} answered more than {max_bytes >> 10} KB")
                if time.monotonic() > end:
                    raise httpx.ReadTimeout("deadline")
                chunks.append(chunk)
            return response.status_code, b"".join(chunks)
    except httpx.HTTPError as exc:
        raise ValueError(unreachable(url)) from exc


def error_text(response: httpx.Response) -> str:
    """A refusal by its status and, when it is OpenAI's error object, its message as text (never the raw body)."""
    body = b""
    try:
        for chunk in response.iter_bytes():  # at most MAX_SMALL_BYTES of it, not the whole body first
            body += chunk
            if len(body) > MAX_SMALL_BYTES:
                break
        error = json.loads(body[:MAX_SMALL_BYTES]).get("error")
        message = error.get("message") if isinstance(error, dict) else error
    except (ValueError, AttributeError, httpx.HTTPError):
        message = None
    return f"{response.status_code}" + (f": {plain(message)}" if isinstance(message, str) and message else "")


class RemoteServer:
    """A server being watched: its metrics polled in the background, its chat API streamed from."""

    def __init__(self, url: str, poll_s: float = POLL_S, history_len: int = 3600) -> None:
        self._target = base_url(url)  # what is fetched (credentials in it go to the server, and nowhere else)
        self.url = display_url(self._target)  # what anyone is shown, and the log: scheme://host:port
        self.poll_s = poll_s
        self.history: deque[HistorySample] = deque(maxlen=history_len)
        self.latest: MetricsReading | None = None
        self.model: str | None = None
        self.error: str | None = None  # the last scrape's problem, until one succeeds
        self.polls = 0
        self.failures = 0  # scrapes failed in a row (next_wait_s backs off from the second)
        self.reserved_blocks = 0  # blocks of num_gpu_blocks no request can hold (vLLM's null block: 1)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._cached: tuple[int, DashboardFigures] | None = None

    # ---- metrics -------------------------------------------------------------------------------------------
    def scrape(self) -> MetricsReading:
        """One GET /metrics, parsed; ValueError saying what went wrong, never what the server sent."""
        status, body = fetch(self._target + "/metrics", MAX_METRICS_BYTES)
        if status != 200:
            raise ValueError(f"{self.url}/metrics answered {status}")
        try:
            return parse_metrics(body.decode("utf-8", "replace"))
        except ValueError as exc:
            why = "has no vLLM metrics" if "no vLLM metrics" in str(exc) else "is not Prometheus text format"
            raise ValueError(f"{self.url}/metrics {why}") from None

    def connect(self) -> None:
        """The first scrape and the served model's name; ValueError for a server not there or without vLLM metrics."""
        first = self.scrape()  # before the models: a server that is not there is refused after one deadline
        try:
            status, body = fetch(self._target + "/v1/models", MAX_SMALL_BYTES)
            entry = json.loads(body)["data"][0] if status == 200 else {}
            model = entry.get("id")
            self.model = model if isinstance(model, str) and len(model) <= 256 else None
            self.reserved_blocks = 1 if entry.get("owned_by") == "vllm" else 0
        except (ValueError, KeyError, IndexError, TypeError, AttributeError):
            self.model = None  # the chat then sends no model name, and the server picks its own
        self._record(first)

    def _record(self, reading: MetricsReading) -> None:
        with self._lock:
            prev = self.latest
            if prev is not None and counters_went_back(reading, prev):
                self.history.clear()
                prev = None
            self.polls += 1
            self.history.append(history_sample(self.polls, reading, prev, self.reserved_blocks))
            self.latest, self.error = reading, None

    def poll_once(self) -> None:
        try:
            self._record(self.scrape())
            self.failures = 0
        except ValueError as exc:
            self.error = str(exc)
            self.failures += 1

    def next_wait_s(self) -> float:
        """One missed scrape is retried at the usual pace, so the charts lose one point rather than seconds of them;
        from the second failure in a row each wait doubles, up to MAX_POLL_S."""
        return min(self.poll_s * 2 ** max(0, self.failures - 1), max(MAX_POLL_S, self.poll_s))

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="remote-metrics", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        # each scrape due a wait after the last one began: a slow answer does not push every later point back
        due = time.monotonic() + self.next_wait_s()
        while not self._stop.wait(max(0.0, due - time.monotonic())):
            began = time.monotonic()
            self.poll_once()
            due = began + self.next_wait_s()

    def stop(self) -> None:
        self._stop.set()

    # ---- what the page shows -------------------------------------------------------------------------------
    def status(self, presenter: bool = False) -> str:
        """The status line; the model name the remote gave is what it says, so only the presenter sees it."""
        r = self.latest
        where = f"**attached to {plain(self.url)}**" + (f" ({plain(self.model)})" if self.model and presenter else "")
        if self.error:
            return f"{where} · ⚠️ {plain(self.error)} (trying again in {self.next_wait_s():.0f} s)"
        if r is None:
            return f"{where} · waiting for the first scrape"
        kv = "n/a" if r.kv_usage is None else f"{100 * r.kv_usage:.1f}%"
        return (f"{where} · running {r.num_running:.0f} · waiting {r.num_waiting:.0f} · preemptions "
                f"{r.num_preemptions:.0f} · KV cache {kv} · prefix hits {r.prefix_cache_hits:.0f}/"
                f"{r.prefix_cache_queries:.0f} tokens · generated {r.generation_tokens:.0f} tokens · finished "
                f"{r.requests_finished:.0f} requests")

    def figures(self, history_s: float = 180.0, points: int = 300) -> DashboardFigures:
        """The dashboard's figures from the remote series, built once per scrape; the block table says it needs
        the engine's insides."""
        with self._lock:
            samples, polls, latest = list(self.history), self.polls, self.latest
            if self._cached is not None and self._cached[0] == polls:
                return self._cached[1]
        recent = figures.recent_samples(samples, history_s, points)
        blocks = usable_blocks(latest, self.reserved_blocks) if latest else None
        kv = SimpleNamespace(kv_blocks_used=recent[-1].kv_blocks_used if recent else 0,
                             kv_blocks_total=blocks or 100)
        built = DashboardFigures(
            polls, figures.placeholder_figure(f"KV block table: {NOT_REMOTE}"), figures.queues_figure(recent),
            figures.prefix_cache_figure(recent), figures.throughput_figure(recent),
            figures.memory_figure(kv, {}, kv_label="KV cache (blocks)" if blocks else "KV cache (%)"))
        with self._lock:
            self._cached = (polls, built)
        return built

    def chat_view(self) -> ChatView:
        return ChatView(None, figures.placeholder_figure(f"Your request in the KV pool: {NOT_REMOTE}"),
                        f"The chat goes to {plain(self.url + '/v1/chat/completions')}.")

    # ---- chat ----------------------------------------------------------------------------------------------
    def chat(self, message: str, history: list[dict], temperature: float = 0.7,
             max_tokens: int = 256) -> Iterator[tuple[list[dict], str]]:
        """Stream the reply from the remote server's /v1/chat/completions into the history; failures as warnings."""
        if (turn := conversation.next_turn(message, history)) is None:
            yield list(history or []), ""
            return
        messages, history = turn
        body = {"messages": messages, "temperature": float(temperature), "max_tokens": int(max_tokens),
                "stream": True, "stream_options": {"include_usage": True}}
        if self.model:
            body["model"] = self.model
        yield history, f"sent to {plain(self.url)}, waiting for the first token"
        start, first, usage, reply = time.perf_counter(), None, None, ""
        try:
            with httpx.stream("POST", self._target + "/v1/chat/completions", json=body,
                              timeout=httpx.Timeout(600.0, connect=DEADLINE_S)) as response:
                if response.status_code != 200:
                    busy = response.status_code == 429
                    note = "the server is busy, retry in a moment" if busy else "the remote server refused it"
                    log.info("remote chat refused: %s", error_text(response))  # its words: the log's, not the room's
                    yield history + [{"role": "assistant", "content": f"{WARNING} {note} (HTTP "
                                                                      f"{response.status_code})"}], ""
                    return
                history = history + [{"role": "assistant", "content": ""}]
                for line in sse.lines(response.iter_text()):
                    if not line.startswith("data:") or line[5:].strip() == "[DONE]":
                        continue
                    chunk = json.loads(line[5:])
                    if "error" in chunk:
                        err = chunk["error"]
                        log.info("remote chat error: %s", plain(err.get("message") if isinstance(err, dict) else err))
                        history[-1]["content"] = reply + f"\n\n{WARNING} the remote server reported an error"
                        yield history, ""
                        return
                    usage = chunk.get("usage") or usage
                    for choice in chunk.get("choices") or []:
                        piece = (choice.get("delta") or {}).get("content")
                        if piece:
                            first = first or time.perf_counter()
                            reply += piece
                            history[-1]["content"] = reply
                            yield history, f"streaming from {plain(self.url)}"
        except (httpx.HTTPError, ValueError):
            history = [m for m in history if m.get("content") != ""]
            yield history + [{"role": "assistant", "content": f"{WARNING} cannot talk to {plain(self.url)}: the "
                                                              f"connection failed or broke off"}], ""
            return
        yield history, self._reply_stats(start, first, usage)

    def _reply_stats(self, start: float, first: float | None, usage: dict | None) -> str:
        parts = [f"from {plain(self.url)}"]
        if first is not None:
            parts.append(f"TTFT {(first - start) * 1e3:.0f} ms")
        if usage:
            tokens = usage.get("completion_tokens", 0)
            parts.append(f"{tokens} tokens")
            if first is not None and tokens > 1:
                parts.append(f"{(tokens - 1) / max(time.perf_counter() - first, 1e-9):.1f} tokens/s")
        return " · ".join(parts)
