"""`python -m engine.bench versus`: two OpenAI-compatible servers driven alternately. Each cell and round draws
fresh random prompts for both, the order swapped every round, so neither always runs on a warmer or quieter machine
and no prefix cache serves an earlier run's prompts.
"""
from __future__ import annotations

import random
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..measure.runs import random_prompts
from .serve import ServeRequest, ServeResult, run_serve

# Quiet before each run: vLLM's CPU server keeps working for a moment after its last request ends, where the
# engine's threads sleep at once (measured: docs/measurements.md, "Quiet between runs, and the table once more")
SETTLE_S = 2.0

METRICS: dict[str, Callable[[dict[str, Any]], float | None]] = {
    "output tok/s": lambda s: s["output_throughput"],
    "TTFT mean": lambda s: s["ttft_ms"]["mean"],
    "TTFT p99": lambda s: s["ttft_ms"]["p99"],
    "TPOT mean": lambda s: s["tpot_ms"]["mean"],
    "ITL mean": lambda s: s["itl_ms"]["mean"],
}


@dataclass
class Server:
    label: str
    url: str

    @classmethod
    def parse(cls, text: str) -> Server:
        label, sep, url = text.partition("=")
        if not sep or not label or not url.startswith(("http://", "https://")):
            raise ValueError(f"--server wants LABEL=URL (e.g. vllm=http://127.0.0.1:8011), got {text!r}")
        return cls(label, url)


@dataclass
class Cell:
    concurrency: int
    temperature: float
    rounds: list[dict[str, dict[str, Any]]] = field(default_factory=list)  # per round: label -> summary

    def values(self, label: str, metric: str) -> list[float | None]:
        return [METRICS[metric](r[label]) for r in self.rounds]

    def ratios(self, a: str, b: str, metric: str) -> list[float]:
        return [x / y for x, y in zip(self.values(a, metric), self.values(b, metric), strict=True)
                if x is not None and y]


@dataclass
class VersusResult:
    servers: list[Server]
    tag: str
    prompt_len: int
    output_len: int
    num_requests: int
    cells: list[Cell]
    seed: int = 0  # the first round's prompts are seed + 1: give it back (--seed) to replay them

    def to_json(self) -> dict[str, Any]:
        return {"servers": [s.__dict__ for s in self.servers], "tag": self.tag, "prompt_len": self.prompt_len,
                "output_len": self.output_len, "num_requests": self.num_requests, "seed": self.seed,
                "cells": [{"concurrency": c.concurrency, "temperature": c.temperature, "rounds": c.rounds}
                          for c in self.cells]}


def versus(servers: Sequence[Server], tokenizer: Any, concurrencies: Sequence[int], temperatures: Sequence[float],
           rounds: int = 2, num_requests: int = 32, prompt_len: int = 128, output_len: int = 64,
           api: str = "completions", tag: str = "", seed: int | None = None, timeout_s: float = 600.0,
           progress: Callable[[str], None] | None = None, settle_s: float = SETTLE_S) -> VersusResult:
    if len(servers) != 2:
        raise ValueError(f"versus compares two servers, got {len(servers)}")
    if len({s.label for s in servers}) != 2:
        raise ValueError("the two servers need two different labels")
    if rounds < 1:
        raise ValueError(f"--rounds must be >= 1, got {rounds}")
    if not 0 <= settle_s <= 60:
        raise ValueError(f"--settle must be 0-60 seconds, got {settle_s:g}")
    for s in servers:  # a warm-up each, not counted: first requests pay for lazy initialisation
        _check(run_serve(s.url, [ServeRequest("Hello", 4, True)], 1, api=api, timeout_s=timeout_s), s, "warm-up")
    # None: a seed of its own, so that a second run against the same servers is not served from their prefix caches
    seed = random.SystemRandom().randrange(2**31) if seed is None else seed
    cells, draw = [], seed
    for c in concurrencies:
        for t in temperatures:
            cell = Cell(c, t)
            for r in range(rounds):
                draw += 1
                # as text: each server tokenizes it again, as vLLM's random dataset does
                texts = [tokenizer.decode(p) for p in random_prompts(num_requests, prompt_len, seed=draw)]
                requests = [ServeRequest(text, output_len, True) for text in texts]
                order = servers if r % 2 == 0 else list(reversed(servers))
                summaries = {}
                for s in order:
                    if progress:
                        progress(f"c={c} temperature={t:g} round {r + 1}/{rounds}: {s.label}")
                    time.sleep(settle_s)
                    result = run_serve(s.url, requests, c, api=api, temperature=t, timeout_s=timeout_s)
                    summaries[s.label] = _check(result, s, f"c={c} temperature={t:g}").summary()
                cell.rounds.append(summaries)
            cells.append(cell)
    return VersusResult(list(servers), tag, prompt_len, output_len, num_requests, cells, seed)


def _check(result: ServeResult, server: Server, what: str) -> ServeResult:
    if result.failures:
        first = next(iter(result.failures))
        raise ValueError(f"{server.label} ({server.url}) failed {sum(result.failures.values())} request(s) in "
                         f"{what}: {first}")
    return result


def _spread(xs: list[float], fmt: str) -> str:
    if not xs:
        return "-"
    lo, hi = min(xs), max(xs)
    return fmt.format(lo) if f"{fmt.format(lo)}" == f"{fmt.format(hi)}" else f"{fmt.format(lo)}-{fmt.format(hi)}"


def render(result: VersusResult) -> str:
    a, b = (s.label for s in result.servers)
    head = (f"## {a} / {b}{f' ({result.tag})' if result.tag else ''}: {result.num_requests} requests, "
            f"{result.prompt_len} random prompt tokens, {result.output_len} output tokens, "
            f"{len(result.cells[0].rounds) if result.cells else 0} alternating rounds (--seed {result.seed})\n\n"
            f"Ratios are {a}'s over {b}'s, per round (min-max over rounds); above 1 is better for tok/s, below 1 "
            f"for the latencies.\n\n")
    cols = ["concurrency", "sampling", f"{a} tok/s", f"{b} tok/s", *(f"{m} {a}/{b}" for m in METRICS)]
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * 2 + "---:|" * (len(cols) - 2)]
    for cell in result.cells:
        sampling = "greedy" if cell.temperature == 0 else f"temperature {cell.temperature:g}"
        tok = [_median(cell.values(s.label, "output tok/s")) for s in result.servers]
        ratios = [_spread(cell.ratios(a, b, m), "{:.2f}x") for m in METRICS]
        lines.append(f"| {cell.concurrency} | {sampling} | {tok[0]:.1f} | {tok[1]:.1f} | " + " | ".join(ratios) + " |")
    return head + "\n".join(lines)


def _median(xs: list[float | None]) -> float:
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else float("nan")
