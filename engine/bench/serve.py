"""`python -m engine.bench serve`: a load generator for any OpenAI-compatible server, after `vllm bench serve`.
Each chunk is timed on arrival at the client, so the numbers are what a user of the server sees; tokens are counted
from the server's own `usage`, chunks where it reports none. No engine, no torch unless a tokenizer is needed.
"""
from __future__ import annotations

import asyncio
import json
import math
import sys
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import httpx

from .. import sse
from ..workloads import Workload

APIS = {"chat": "/v1/chat/completions", "completions": "/v1/completions"}


@dataclass
class ServeRequest:
    text: str
    max_tokens: int
    ignore_eos: bool = False

    def body(self, api: str, model: str, temperature: float) -> dict[str, Any]:
        body: dict[str, Any] = {"model": model, "max_tokens": self.max_tokens, "temperature": temperature,
                                "stream": True, "stream_options": {"include_usage": True}}
        if api == "chat":
            body["messages"] = [{"role": "user", "content": self.text}]
        else:
            body["prompt"] = self.text
        if self.ignore_eos:  # vLLM's extra field: only sent when asked, so plain OpenAI servers never see it
            body["ignore_eos"] = True
        return body


@dataclass
class RequestRecord:
    """What the client saw of one request, in seconds from the moment it was sent."""
    ok: bool
    error: str | None = None
    start_s: float = 0.0  # since the run began
    ttft_s: float | None = None  # None on success: every token was one the server shows no text for (special ones)
    latency_s: float | None = None
    itl_s: list[float] = field(default_factory=list)  # between consecutive chunks that carried text
    num_chunks: int = 0  # chunks that carried text
    prompt_tokens: int | None = None  # as the server's usage reports them
    output_tokens: int = 0  # usage's completion_tokens, or num_chunks when the server reports no usage
    usage_reported: bool = False
    text: str = ""
    finish_reason: str | None = None

    @property
    def tpot_s(self) -> float | None:
        """Time per output token after the first, as vLLM defines it."""
        if self.latency_s is None or self.ttft_s is None or self.output_tokens < 2:
            return None
        return (self.latency_s - self.ttft_s) / (self.output_tokens - 1)


@dataclass
class ServeResult:
    url: str
    endpoint: str
    model: str
    workload: str
    concurrency: int
    num_requests: int
    duration_s: float
    records: list[RequestRecord]

    @property
    def completed(self) -> list[RequestRecord]:
        return [r for r in self.records if r.ok]

    @property
    def failures(self) -> dict[str, int]:
        return dict(Counter(r.error or "unknown error" for r in self.records if not r.ok).most_common())

    @property
    def total_input_tokens(self) -> int:
        return sum(r.prompt_tokens or 0 for r in self.completed)

    @property
    def total_output_tokens(self) -> int:
        return sum(r.output_tokens for r in self.completed)

    def throughput(self) -> dict[str, float]:
        d = max(self.duration_s, 1e-9)
        return {"request_throughput": len(self.completed) / d, "output_throughput": self.total_output_tokens / d,
                "total_token_throughput": (self.total_input_tokens + self.total_output_tokens) / d}

    def latencies_ms(self) -> dict[str, dict[str, float | None]]:
        done = self.completed
        return {"ttft": stats_ms([r.ttft_s for r in done]), "tpot": stats_ms([r.tpot_s for r in done]),
                "itl": stats_ms([x for r in done for x in r.itl_s]), "e2el": stats_ms([r.latency_s for r in done])}

    def summary(self) -> dict[str, Any]:
        return {"url": self.url, "endpoint": self.endpoint, "model": self.model, "workload": self.workload,
                "max_concurrency": self.concurrency, "num_requests": self.num_requests,
                "completed": len(self.completed), "failed": self.num_requests - len(self.completed),
                "failures": self.failures, "duration_s": self.duration_s,
                "total_input_tokens": self.total_input_tokens, "total_output_tokens": self.total_output_tokens,
                "usage_reported": all(r.usage_reported for r in self.completed),
                **self.throughput(), **{f"{k}_ms": v for k, v in self.latencies_ms().items()}}

    def to_json(self) -> dict[str, Any]:
        """The summary and every request's own numbers (as vLLM's --save-result keeps ttfts, itls, ...)."""
        keep = ("ok", "error", "start_s", "ttft_s", "latency_s", "itl_s", "num_chunks", "prompt_tokens",
                "output_tokens", "finish_reason")
        return {**self.summary(), "requests": [{k: v for k, v in asdict(r).items() if k in keep}
                                               for r in self.records]}


def percentile(values: Sequence[float], q: float) -> float:
    """Linear interpolation between the closest ranks (numpy's default)."""
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100
    lo, hi = math.floor(pos), math.ceil(pos)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def stats_ms(values: Sequence[float | None]) -> dict[str, float | None]:
    xs = [v * 1e3 for v in values if v is not None]
    if not xs:
        return {"mean": None, "median": None, "p90": None, "p99": None, "std": None}
    mean = sum(xs) / len(xs)
    return {"mean": mean, "median": percentile(xs, 50), "p90": percentile(xs, 90), "p99": percentile(xs, 99),
            "std": math.sqrt(sum((x - mean) ** 2 for x in xs) / len(xs))}


def workload_requests(workload: Workload, tokenizer: Any | None, num_requests: int, max_tokens: int | None = None,
                      ignore_eos: bool | None = None) -> list[ServeRequest]:
    """The workload's requests as texts, cycled to num_requests; a random-token prompt decoded (the server tokenizes
    it again: the length may differ by a token or two, as in vLLM's random dataset)."""
    if not workload.requests:
        raise ValueError(f"workload {workload.name!r} has no requests")
    if tokenizer is None and any(r.text is None for r in workload.requests):
        raise ValueError(f"workload {workload.name!r} has random-token prompts: a tokenizer is needed to send them")
    out = []
    for i in range(num_requests):
        r = workload.requests[i % len(workload.requests)]
        text = r.text if r.text is not None else tokenizer.decode(r.prompt_token_ids)
        out.append(ServeRequest(text, max_tokens or r.params.max_tokens,
                                r.params.ignore_eos if ignore_eos is None else ignore_eos))
    return out


def base_url(url: str) -> str:
    """The server's root: "http://host:8000", "http://host:8000/" and "http://host:8000/v1" are the same server."""
    url = url.strip().rstrip("/")
    if not url.startswith(("http://", "https://")):
        raise ValueError(f"--url must start with http:// or https://, got {url!r}")
    return url[:-3] if url.endswith("/v1") else url


async def served_model(client: httpx.AsyncClient) -> str:
    """The first model GET /v1/models lists (what vLLM's bench does when --model is left out)."""
    try:
        response = await client.get("/v1/models")
    except httpx.HTTPError as exc:
        raise ValueError(f"cannot reach {client.base_url}: {describe(exc)}") from exc
    if response.status_code != 200:
        raise ValueError(f"{client.base_url}/v1/models answered {response.status_code}: {error_message(response)} "
                         f"(is this an OpenAI-compatible server? pass --model to skip this check)")
    try:
        return response.json()["data"][0]["id"]
    except (ValueError, KeyError, IndexError, TypeError) as exc:
        raise ValueError(f"{client.base_url}/v1/models did not list a model: {response.text[:200]!r}") from exc


def describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__


def error_message(response: httpx.Response) -> str:
    """The message of an OpenAI-style error body, else the start of whatever came back."""
    try:
        body = json.loads(response.content)
        message = body["error"]["message"] if isinstance(body.get("error"), dict) else body.get("error")
        if message:
            return f"{response.status_code} {message}"
    except (ValueError, AttributeError, KeyError, TypeError):
        pass
    return f"{response.status_code} {response.reason_phrase or response.text[:120]}"


async def stream_request(client: httpx.AsyncClient, endpoint: str, body: dict, chat: bool,
                         run_start: float) -> RequestRecord:
    rec = RequestRecord(ok=False)
    start = time.perf_counter()
    rec.start_s = start - run_start
    last = start
    done = False
    try:
        async with client.stream("POST", endpoint, json=body) as response:
            if response.status_code != 200:
                await response.aread()
                rec.error = error_message(response)
                return rec
            async for line in sse.alines(response.aiter_text()):
                if not line.startswith("data:"):
                    continue  # blank separators, comments (": ping") and other SSE fields
                data = line[5:].strip()
                if data == "[DONE]":
                    done = True
                    break
                now = time.perf_counter()
                try:
                    chunk = json.loads(data)
                except ValueError:
                    rec.error = f"a chunk that is not JSON: {data[:80]!r}"
                    return rec
                if "error" in chunk:  # a server that fails mid-stream says so in the stream (as vLLM and we do)
                    err = chunk["error"]
                    rec.error = f"error in stream: {err.get('message') if isinstance(err, dict) else err}"
                    return rec
                if chunk.get("usage"):
                    rec.prompt_tokens = chunk["usage"].get("prompt_tokens")
                    rec.output_tokens = chunk["usage"].get("completion_tokens") or 0
                    rec.usage_reported = True
                for choice in chunk.get("choices") or []:
                    piece = (choice.get("delta") or {}).get("content") if chat else choice.get("text")
                    if piece:
                        if rec.ttft_s is None:
                            rec.ttft_s = now - start
                        else:
                            rec.itl_s.append(now - last)
                        last = now
                        rec.num_chunks += 1
                        rec.text += piece
                    rec.finish_reason = choice.get("finish_reason") or rec.finish_reason
    except httpx.HTTPError as exc:
        rec.error = describe(exc)
        return rec
    rec.latency_s = time.perf_counter() - start
    if not done:
        rec.error = "the stream ended without data: [DONE]"
    elif rec.ttft_s is None and not (rec.usage_reported and rec.output_tokens > 0):
        rec.error = "the stream carried no text"
    else:
        rec.ok = True
        if not rec.usage_reported:
            rec.output_tokens = rec.num_chunks
    return rec


async def run_serve_async(url: str, requests: Sequence[ServeRequest], concurrency: int, api: str = "chat",
                          model: str | None = None, temperature: float = 0.0, timeout_s: float = 600.0,
                          workload: str = "", progress: Callable[[int, int, int], None] | None = None) -> ServeResult:
    if concurrency < 1:
        raise ValueError(f"--concurrency must be >= 1, got {concurrency}")
    if not requests:
        raise ValueError("no requests to send (--requests must be >= 1)")
    if api not in APIS:
        raise ValueError(f"api must be one of {', '.join(APIS)}, got {api!r}")
    url = base_url(url)
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(base_url=url, limits=limits,
                                 timeout=httpx.Timeout(timeout_s, connect=min(timeout_s, 10.0))) as client:
        model = model or await served_model(client)
        gate = asyncio.Semaphore(concurrency)
        finished = [0, 0]  # done, failed
        run_start = time.perf_counter()

        async def one(req: ServeRequest) -> RequestRecord:
            async with gate:
                rec = await stream_request(client, APIS[api], req.body(api, model, temperature), api == "chat",
                                           run_start)
            finished[0] += 1
            finished[1] += not rec.ok
            if progress:
                progress(finished[0], len(requests), finished[1])
            return rec

        records = await asyncio.gather(*(one(r) for r in requests))
        duration = time.perf_counter() - run_start
    return ServeResult(url, APIS[api], model, workload, concurrency, len(requests), duration, list(records))


def run_serve(url: str, requests: Sequence[ServeRequest], concurrency: int, **kwargs) -> ServeResult:
    return asyncio.run(run_serve_async(url, requests, concurrency, **kwargs))


class ProgressBar:
    """A one-line bar on stderr (redrawn in place on a terminal; a line per tenth otherwise, for logs)."""

    def __init__(self, stream=None, width: int = 30) -> None:
        self.stream = stream or sys.stderr
        self.width = width
        self.start = time.perf_counter()
        self.tty = getattr(self.stream, "isatty", lambda: False)()
        self._last_tenth = -1

    def __call__(self, done: int, total: int, failed: int) -> None:
        tenth = done * 10 // total
        if not self.tty and tenth == self._last_tenth and done != total:
            return
        self._last_tenth = tenth
        filled = self.width * done // total
        elapsed = time.perf_counter() - self.start
        line = (f"{100 * done // total:3d}%|{'█' * filled}{' ' * (self.width - filled)}| {done}/{total} "
                f"[{elapsed:.1f}s{f', {failed} failed' if failed else ''}]")
        self.stream.write(("\r" + line if self.tty else line + "\n") + ("\n" if self.tty and done == total else ""))
        self.stream.flush()


def render(result: ServeResult) -> str:
    """vLLM's layout ("Serving Benchmark Result"), with P90 beside its P99 and the failures' messages counted."""
    s = result.summary()

    def row(label: str, value: Any) -> str:
        text = "n/a" if value is None else f"{value:.2f}" if isinstance(value, float) else str(value)
        return f"{label:<40} {text:<10}"

    def section(title: str) -> str:
        return f"{title:-^50}"
    lines = [f"{' Serving Benchmark Result ':=^50}",
             row("Endpoint:", f"{result.url}{result.endpoint}"), row("Model:", result.model),
             row("Workload:", result.workload or "-"),
             row("Successful requests:", s["completed"]), row("Failed requests:", s["failed"]),
             row("Maximum request concurrency:", result.concurrency),
             row("Benchmark duration (s):", s["duration_s"]),
             row("Total input tokens:", s["total_input_tokens"]),
             row("Total generated tokens:", s["total_output_tokens"]
                 if s["usage_reported"] else f"{s['total_output_tokens']} (chunks: no usage reported)"),
             row("Request throughput (req/s):", s["request_throughput"]),
             row("Output token throughput (tok/s):", s["output_throughput"]),
             row("Total Token throughput (tok/s):", s["total_token_throughput"])]
    titles = {"ttft": ("Time to First Token", "TTFT"), "tpot": ("Time per Output Token (excl. 1st token)", "TPOT"),
              "itl": ("Inter-token Latency", "ITL"), "e2el": ("End-to-end Latency", "E2EL")}
    for key, (title, short) in titles.items():
        st = s[f"{key}_ms"]
        lines.append(section(title))
        lines += [row(f"Mean {short} (ms):", st["mean"]), row(f"Median {short} (ms):", st["median"]),
                  row(f"P90 {short} (ms):", st["p90"]), row(f"P99 {short} (ms):", st["p99"])]
    if s["failures"]:
        lines.append(section("Failures"))
        lines += [f"{count:>6} x {message}" for message, count in s["failures"].items()]
    lines.append("=" * 50)
    return "\n".join(lines)
