"""A lesson's numbers, from the engine's own time series (its history samples): each METRIC over a window of wall
time, what that number rests on (requests, tokens, steps: `evidence`), how much it varies inside a phase
(`spread`, over equal parts of it), and the same bin by bin for the charts, so chart and table never disagree."""
from __future__ import annotations

import bisect
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

PARTS = 3  # a phase's number is also measured over this many equal parts of it: its spread is the noise


def _increase(values: Sequence[float]) -> float:
    """How much a counter grew over consecutive readings, across a restart (where it starts again from 0)."""
    total = 0.0
    for a, b in zip(values, values[1:]):
        total += b - a if b >= a else b
    return total


def _ordered(history: Iterable) -> list:
    """The samples in time order (the service appends them in order: this is a copy, and sorting it is linear)."""
    return sorted(history, key=lambda s: s.time)


def _window(samples: list, t0: float, t1: float) -> tuple[list, list]:
    """(the sample just before t0, if any; the samples in [t0, t1]) of time-ordered samples."""
    times = [s.time for s in samples] if not isinstance(samples, _Timed) else samples.times
    lo, hi = bisect.bisect_left(times, t0), bisect.bisect_right(times, t1)
    return samples[max(0, lo - 1):lo], samples[lo:hi]


class _Timed(list):
    """Time-ordered samples with their times alongside, for repeated windows over one history."""

    def __init__(self, samples: Iterable) -> None:
        super().__init__(_ordered(samples))
        self.times = [s.time for s in self]


def timed(history: Iterable) -> list:
    """The history made ready for many windows (each then costs a bisection, not a pass over every sample)."""
    return history if isinstance(history, _Timed) else _Timed(history)


def window_metrics(history: Iterable, t0: float, t1: float, phase: bool = True) -> dict[str, float | None]:
    """Every METRIC over the engine's history samples in [t0, t1] (wall times). The sample just before t0 is the
    counters' baseline; a number with nothing to say in the window (no request got its first token) is None."""
    before, inside = _window(timed(history), t0, t1)
    span = max(t1 - t0, 1e-9)
    counted = before + inside

    def grew(name: str) -> float:
        return _increase([getattr(s, name) for s in counted])

    def mean(values):
        values = [v for v in values if v is not None]
        return sum(values) / len(values) if values else None

    queries, generated = grew("prefix_cache_queries"), grew("generation_tokens_total")
    # nothing looked up: a whole phase (`phase`) that served requests had caching off and reused nothing (0); a
    # part of one (a chart's bin, a part of the spread) may just have had no request arrive (None)
    hit_rate = grew("prefix_cache_hits") / queries if queries else 0.0 if generated and phase else None
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


@dataclass(frozen=True)
class Evidence:
    """What a window's numbers rest on."""
    requests: int = 0  # requests that got their first token in it
    finished: int = 0
    tokens: int = 0  # generated
    prompt_tokens: int = 0  # of the requests that started in it
    steps: int = 0

    def covers(self, need: Evidence) -> bool:
        return all(getattr(self, k) >= getattr(need, k) for k in ("requests", "finished", "tokens", "prompt_tokens",
                                                                  "steps"))

    def missing(self, need: Evidence) -> str:
        """What is still short, in words ("" when nothing is)."""
        words = {"requests": "requests started", "finished": "requests finished", "tokens": "tokens",
                 "prompt_tokens": "prompt tokens read", "steps": "steps"}
        return ", ".join(f"{getattr(self, k)} of {getattr(need, k)} {w}" for k, w in words.items()
                         if getattr(self, k) < getattr(need, k))


def evidence(history: Iterable, t0: float, t1: float) -> Evidence:
    before, inside = _window(timed(history), t0, t1)
    return Evidence(requests=sum(s.num_started for s in inside), finished=sum(s.num_finished for s in inside),
                    tokens=int(_increase([s.generation_tokens_total for s in before + inside])),
                    prompt_tokens=sum(s.prompt_tokens for s in inside), steps=len(inside))


def spread(history: Iterable, metric: str, t0: float, t1: float, parts: int = PARTS) -> tuple[float, float] | None:
    """The lowest and highest value of `metric` over `parts` equal parts of [t0, t1] (the parts with nothing to say
    left out): how much the number moves by itself inside one phase. None with fewer than two parts to compare."""
    samples, width = timed(history), (t1 - t0) / parts
    values = [v for i in range(parts)
              if (v := window_metrics(samples, t0 + i * width, t0 + (i + 1) * width, phase=False)[metric]) is not None]
    return (min(values), max(values)) if len(values) >= 2 else None


def moved_beyond_noise(before: float | None, after: float | None, noise_before: tuple[float, float] | None,
                       noise_after: tuple[float, float] | None) -> str | None:
    """"up" or "down" when the number moved beyond the noise: every part of one phase lies above every part of the
    other (their ranges do not overlap), or it moved by more than half the wider range; None when it did not (or
    there is nothing to compare)."""
    if before is None or after is None or before == after:
        return None
    way = "up" if after > before else "down"
    if noise_before is not None and noise_after is not None:
        low, high = (noise_before, noise_after) if way == "up" else (noise_after, noise_before)
        if low[1] < high[0]:  # a slow start inside a phase widens its range, but not past the other phase's
            return way
    noise = max(((r[1] - r[0]) / 2 for r in (noise_before, noise_after) if r is not None), default=0.0)
    return None if abs(after - before) <= noise else way


def series(history: Iterable, metric: str, t0: float, t1: float, bin_s: float = 2.0) -> list[tuple[float, float]]:
    """(seconds since t0, the metric over that bin): what the lesson's charts draw."""
    samples = timed(history)
    out, t = [], t0
    while t < t1:
        value = window_metrics(samples, t, min(t + bin_s, t1), phase=False)[metric]
        if value is not None:
            out.append((t - t0 + bin_s / 2, value))
        t += bin_s
    return out
