"""The API under abuse: each hostile request a public server meets, sent while a normal stream runs beside it.

    python -m server.hostile http://127.0.0.1:7860 [--api-key KEY] [--rounds 3]

Prints, for each abuse, the status it got and how long the refusal took, and the normal stream's inter-token gaps
(p50 / p95 / max) with and without the abuse, in the same run. Loopback only: it refuses any other address.
tests/test_api_limits.py runs the same suite and checks every status (never the times).
"""
from __future__ import annotations

import argparse
import ipaddress
import json
import statistics
import time
from collections.abc import Iterator
from dataclasses import dataclass
from urllib.parse import urlparse

import httpx

from engine import sse

from .limits import MB

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"


@dataclass
class Abuse:
    name: str
    path: str
    body: bytes | Iterator[bytes]
    headers: dict
    expect: int  # the status it must get (its error body, as every refusal's, a few hundred bytes: nothing echoed)
    headers_only: bool = False  # declare a 200 MB Content-Length, send no body, time the answer at the socket


def abuses(api_key: str | None) -> list[Abuse]:
    """The hostile requests, built fresh each time (a streamed body can be sent once)."""
    json_type = {"content-type": "application/json"}
    auth = {"authorization": f"Bearer {api_key}"} if api_key else {}
    ok = {**json_type, **auth}

    def chunks(total: int, size: int = MB) -> Iterator[bytes]:
        sent = 0
        while sent < total:
            yield b" " * min(size, total - sent)
            sent += size
    prompt_10mb = json.dumps({"prompt": "x " * (5 * MB), "max_tokens": 4}).encode()
    hi = [{"role": "user", "content": "hi"}]

    def chat(**fields) -> bytes:
        return json.dumps({"messages": hi, "max_tokens": 2, **fields}).encode()
    out = [
        Abuse("body 200 MB declared, never sent (the server's own time)", COMPLETIONS, b"", ok, 413, True),
        Abuse("body 200 MB sent whole (includes the client's upload)", COMPLETIONS, b"{" + b" " * (200 * MB) + b"}",
              ok, 413),
        Abuse("body 200 MB (chunked, no length)", COMPLETIONS, chunks(200 * MB), ok, 413),
        Abuse("prompt 10 MB", COMPLETIONS, prompt_10mb, ok, 413),
        Abuse("prompt 3 MB (under the body cap)", COMPLETIONS,
              json.dumps({"prompt": "x " * (3 * MB // 2), "max_tokens": 4}).encode(), ok, 400),
        Abuse("100,000 stop strings", CHAT,
              json.dumps({"messages": hi, "stop": [f"s{i}" for i in range(100_000)]}).encode(), ok, 400),
        Abuse("a 10,000-character stop string", CHAT,
              json.dumps({"messages": hi, "stop": ["s" * 10_000]}).encode(), ok, 400),
        Abuse("100,000 stop_token_ids", CHAT, chat(stop_token_ids=list(range(100_000))), ok, 400),
        Abuse("logit_bias of 100,000 tokens", CHAT, chat(logit_bias={str(i): -100 for i in range(100_000)}), ok, 400),
        Abuse("10,000 messages", CHAT, chat(messages=hi * 10_000), ok, 400),
        Abuse("a message of 10,000 content parts", CHAT,
              chat(messages=[{"role": "user", "content": [{"type": "text", "text": "hi"}] * 10_000}]), ok, 400),
        Abuse("prompt of 1,000,000 token ids", COMPLETIONS, json.dumps({"prompt": [1] * 1_000_000}).encode(), ok, 400),
        Abuse("a 3 MB model name", CHAT, chat(model="m" * (3 * MB)), ok, 404),
        Abuse("a 60,000-character unknown path", "/v1/" + "p" * 60_000, b"{}", ok, 404),
        Abuse("lone surrogate in model", CHAT,
              b'{"model": "\\ud800", "messages": [{"role": "user", "content": "hi"}]}', ok, 400),
        Abuse("lone surrogate in prompt", COMPLETIONS, b'{"prompt": "a\\udfffb", "max_tokens": 2}', ok, 400),
        Abuse("lone surrogate in a message", CHAT, b'{"messages": [{"role": "user", "content": "\\ud83d"}]}', ok, 400),
        Abuse("text/plain body (a web page's simple request)", CHAT, json.dumps({"messages": hi}).encode(),
              {"content-type": "text/plain", **auth}, 415),
        Abuse("form body", COMPLETIONS, b"prompt=hi", {"content-type": "application/x-www-form-urlencoded", **auth},
              415),
        Abuse("no Content-Type", COMPLETIONS, json.dumps({"prompt": "hi"}).encode(), auth, 415),
    ]
    if api_key:
        body = json.dumps({"prompt": "hi", "max_tokens": 2}).encode()
        out += [Abuse("no API key", COMPLETIONS, body, json_type, 401),
                Abuse("wrong API key", COMPLETIONS, body, {**json_type, "authorization": "Bearer wrong"}, 401),
                Abuse("wrong API key on /v1/models", "/v1/models", b"", {"authorization": "Bearer wrong"}, 401)]
    return out


def send(http: httpx.Client, url: str, abuse: Abuse) -> tuple[int | None, float, str, int]:
    """(status or None when the connection was cut, seconds, the error's code or the exception, the answer's bytes)."""
    start = time.perf_counter()
    if abuse.headers_only:
        return headers_only(url, abuse, start)
    try:
        if abuse.path == "/v1/models":
            r = http.get(url + abuse.path, headers=abuse.headers)
        else:
            r = http.post(url + abuse.path, content=abuse.body, headers=abuse.headers)
    except httpx.HTTPError as exc:
        return None, time.perf_counter() - start, type(exc).__name__, 0
    try:
        code = r.json()["error"]["code"]
    except (ValueError, KeyError, TypeError):
        code = f"not JSON: {r.text[:60]!r}"
    return r.status_code, time.perf_counter() - start, str(code), len(r.content)


def headers_only(url: str, abuse: Abuse, start: float) -> tuple[int | None, float, str, int]:
    """A request line and headers declaring 200 MB, then nothing: how soon the server answers without the body."""
    import socket
    parts = urlparse(url)
    head = [f"POST {abuse.path} HTTP/1.1", f"Host: {parts.hostname}", f"Content-Length: {200 * MB}",
            *(f"{k}: {v}" for k, v in abuse.headers.items())]
    with socket.create_connection((parts.hostname, parts.port or 80), timeout=10) as sock:
        sock.sendall(("\r\n".join(head) + "\r\n\r\n{").encode())
        answer = sock.recv(4096).decode("latin-1")
    seconds = time.perf_counter() - start
    status = int(answer.split(" ", 2)[1]) if answer.startswith("HTTP/") else None
    code = answer.split('"code":"', 1)[1].split('"', 1)[0] if '"code":"' in answer else "no error body"
    return status, seconds, code, len(answer.partition("\r\n\r\n")[2])


def stream_gaps(url: str, api_key: str | None, max_tokens: int) -> list[float]:
    """One normal streamed chat; the gaps between its chunks, in seconds."""
    headers = {"authorization": f"Bearer {api_key}"} if api_key else {}
    body = {"messages": [{"role": "user", "content": "Tell me about the sea."}], "max_tokens": max_tokens,
            "temperature": 0, "stream": True, "ignore_eos": True}
    times = []
    with httpx.stream("POST", url + CHAT, json=body, headers=headers, timeout=120) as r:
        r.raise_for_status()
        for line in sse.lines(r.iter_text()):
            if line.startswith("data:") and "[DONE]" not in line:
                times.append(time.perf_counter())
    return [b - a for a, b in zip(times, times[1:])]


def check_loopback(url: str) -> None:
    host = urlparse(url).hostname or ""
    if host != "localhost":
        try:
            if ipaddress.ip_address(host).is_loopback:
                return
        except ValueError:
            pass
        raise SystemExit(f"{url}: this suite sends hostile traffic to this machine's loopback address only")


def _stream_into(queue, url: str, api_key: str | None, max_tokens: int) -> None:
    queue.put(stream_gaps(url, api_key, max_tokens))


def run(url: str, api_key: str | None = None, rounds: int = 1, max_tokens: int = 64) -> dict:
    """Each abuse `rounds` times while a normal stream runs; a baseline stream before. Returns the results.
    The normal stream reads in a process of its own and the hostile bodies are built before it starts, so the
    gaps measured are the server's, not this process's time spent making 200 MB of spaces."""
    import multiprocessing
    check_loopback(url)
    url = url.rstrip("/")
    ctx = multiprocessing.get_context("spawn")
    baseline = stream_gaps(url, api_key, max_tokens)
    results: list[dict] = []
    gaps: list[float] = []
    for _ in range(rounds):
        batch = abuses(api_key)
        queue = ctx.Queue()
        beside = ctx.Process(target=_stream_into, args=(queue, url, api_key, max_tokens), daemon=True)
        beside.start()
        time.sleep(1.0)  # the stream is running before the abuse starts
        with httpx.Client(timeout=httpx.Timeout(30.0)) as http:
            for abuse in batch:
                status, seconds, code, size = send(http, url, abuse)
                results.append({"name": abuse.name, "expect": abuse.expect, "status": status, "seconds": seconds,
                                "code": code, "bytes": size})
        try:
            gaps += queue.get(timeout=120)
        except Exception:  # the stream failed: no gaps, and the caller's check on them says so
            pass
        beside.join(timeout=10)
    return {"results": results, "baseline_gaps": baseline, "gaps": gaps}


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("url")
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=64)
    args = parser.parse_args()
    out = run(args.url, args.api_key, args.rounds, args.max_tokens)
    by_name: dict[str, list[dict]] = {}
    for r in out["results"]:
        by_name.setdefault(r["name"], []).append(r)
    print(f"| abuse | expected | got | code | answer (bytes) | refused in (s, max of {args.rounds}) |\n"
          "|---|---:|---|---|---:|---:|")
    for name, rs in by_name.items():
        got = ", ".join(sorted({str(r["status"]) for r in rs}))
        print(f"| {name} | {rs[0]['expect']} | {got} | {rs[0]['code']} | {max(r['bytes'] for r in rs)} | "
              f"{max(r['seconds'] for r in rs):.3f} |")
    base, under = out["baseline_gaps"], out["gaps"]
    print(f"\nnormal stream's gap between chunks, ms: alone p50 {1e3 * statistics.median(base):.1f} / p95 "
          f"{1e3 * percentile(base, 0.95):.1f}; under the abuse p50 {1e3 * statistics.median(under):.1f} / p95 "
          f"{1e3 * percentile(under, 0.95):.1f} / max {1e3 * max(under):.1f} "
          f"(p95 ratio {percentile(under, 0.95) / percentile(base, 0.95):.2f}x)")
    bad = [r for r in out["results"] if r["status"] != r["expect"]]
    if bad:
        raise SystemExit(f"{len(bad)} abuses got another status than expected: {bad[:3]}")


if __name__ == "__main__":
    main()
