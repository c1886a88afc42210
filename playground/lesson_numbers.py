"""A lesson's numbers, from the engine's own time series (its history samples): each METRIC over a window of wall
time, and the same bin by bin for the record's chart, so chart and table never disagree."""
from __future__ import annotations

from collections.abc import Iterable, Sequence


def _increase(values: Sequence[float]) -> float:
    """How much a counter grew over consecutive readings, across a restart (where it starts again from 0)."""
    total = 0.0
    for a, b in zip(values, values[1:]):
        total += b - a if b >= a else b
    return total


def window_metrics(history: Iterable, t0: float, t1: float) -> dict[str, float | None]:
    """Every METRIC over the engine's history samples in [t0, t1] (wall times). The sample just before t0 is the
    counters' baseline; a number with nothing to say in the window (no request got its first token) is None."""
    samples = sorted(history, key=lambda s: s.time)
    inside = [s for s in samples if t0 <= s.time <= t1]
    before = [s for s in samples if s.time < t0][-1:]
    span = max(t1 - t0, 1e-9)
    counted = before + inside

    def grew(name: str) -> float:
        return _increase([getattr(s, name) for s in counted])

    def mean(values):
        values = [v for v in values if v is not None]
        return sum(values) / len(values) if values else None

    queries, generated = grew("prefix_cache_queries"), grew("generation_tokens_total")
    # with prefix caching off nothing is looked up: an engine that served requests then hit nothing (0), and
    # one that served none has no rate to give (None)
    hit_rate = grew("prefix_cache_hits") / queries if queries else 0.0 if generated else None
    return {
        "tokens_per_s": generated / span if counted else None,
        "ttft_s": mean(s.ttft_s for s in inside),
        # a request decoding gets one token a step, so its time per output token is the step's time: the mean of
        # the steps that produced tokens (finished requests' TPOT alone says nothing while none finishes)
        "tpot_s": mean(b.step_ms / 1e3 for a, b in zip(counted, counted[1:])
                       if b.time >= t0 and (b.generation_tokens_total > a.generation_tokens_total
                                            or 0 < b.generation_tokens_total < a.generation_tokens_total)),
        # what a token costs the engine: its steps' time over the tokens they made (a step of a speculating
        # request makes several; a naive one recomputes the whole text for one)
        "time_per_token_ms": sum(s.step_ms for s in inside) / generated if generated and inside else None,
        "max_step_ms": max((s.step_ms for s in inside), default=None),
        "prefix_hit_rate": hit_rate,
        "kv_blocks_used": mean(s.kv_blocks_used for s in inside),
        "peak_kv_blocks": max((s.kv_blocks_used for s in inside), default=None),
        "preemptions": grew("num_preemptions") if counted else None,
        "running": mean(s.num_running for s in inside),
    }


def series(history: Iterable, metric: str, t0: float, t1: float, bin_s: float = 2.0) -> list[tuple[float, float]]:
    """(seconds since t0, the metric over that bin): what the record's chart draws. The same numbers as the
    table's, bin by bin (window_metrics), so chart and table never disagree."""
    samples = list(history)
    out, t = [], t0
    while t < t1:
        value = window_metrics(samples, t, min(t + bin_s, t1))[metric]
        if value is not None:
            out.append((t - t0 + bin_s / 2, value))
        t += bin_s
    return out
