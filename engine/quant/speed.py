"""Whether a quantization scheme is faster than fp32 on the CPU at hand: measured once per machine and kernel build
(one decoder layer's projections, random weights), and cached. What pays on one CPU costs on another
(docs/measurements.md, "Which kernel runs, and what each C++ kernel is worth"), so nothing assumes it.
"""
from __future__ import annotations

import hashlib
import json
import os
import time
from dataclasses import asdict, dataclass

import torch

from .. import cpu_kernels
from ..cache import cache_dir
from .format import QUANTIZATION_SCHEMES, WeightFormat
from .kernels import choose_kernel, cpu_features, cpu_name, isa
from .linear import make_projection

ROWS = (1, 16)  # a lone chat's decode step, and a busy one
REPEATS = 7  # best of
CALLS = 8  # per timing, at least
TIMING_S = 0.01  # and at least this long
CACHE_FILE = "kernel-speed.json"
SLOWER = 0.95  # a scheme under this ratio at every row count measured is "slower than fp32 here"


@dataclass(frozen=True)
class SchemeSpeed:
    """One scheme's projections against fp32's on this machine: speedup[i] = fp32's time / its time at rows[i]."""
    scheme: str
    kernel: str  # its kernel, in a few words (KernelChoice.short)
    rows: tuple[int, ...]
    speedup: tuple[float, ...]
    cpu: str

    @property
    def slower(self) -> bool:
        """Slower than fp32 at every row count measured: quantizing buys memory here, not speed."""
        return all(x < SLOWER for x in self.speedup)

    def describe(self) -> str:
        """"1.92x fp32 at 1 row, 0.61x at 16 (slower than fp32 here)"."""
        parts = [f"{x:.2f}x fp32 at {n} row{'s' if n > 1 else ''}" if i == 0 else f"{x:.2f}x at {n}"
                 for i, (n, x) in enumerate(zip(self.rows, self.speedup))]
        return ", ".join(parts) + (" (slower than fp32 here)" if self.slower else "")


def layer_shapes(model) -> list[tuple[int, int]]:
    layer = model.layers[0]
    return [(p.out_features, p.in_features) for p in (layer.qkv, layer.o, layer.gate_up, layer.down)]


def _time(projections, x: torch.Tensor, calls: int = CALLS) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        for p in projections:
            p(x[:, :p.in_features])
    return (time.perf_counter() - start) / calls


def measure(shapes: list[tuple[int, int]]) -> dict[str, SchemeSpeed]:
    """Each scheme's speed against fp32 over projections of these shapes, on this CPU now (no cache)."""
    gen = torch.Generator().manual_seed(0)
    weights = [torch.randn(n, k, generator=gen) * 0.02 for n, k in shapes]
    fp32 = [make_projection(WeightFormat(), w, "speed") for w in weights]
    out = {}
    for scheme in QUANTIZATION_SCHEMES:
        fmt = WeightFormat(scheme)
        try:
            quantized = [make_projection(fmt, w, "speed") for w in weights]
        except ValueError:  # no kernel here for this scheme or these shapes: nothing to time
            continue
        ratios = []
        for n in ROWS:
            x = torch.randn(n, max(k for _, k in shapes), generator=gen)
            _time(fp32, x), _time(quantized, x)  # warm both (oneDNN's first call plans)
            calls = max(CALLS, int(TIMING_S / max(_time(fp32, x), 1e-6)))  # each timing long enough to trust
            base, mine = [], []
            for _ in range(REPEATS):  # interleaved: a busy moment slows both sides
                base.append(_time(fp32, x, calls))
                mine.append(_time(quantized, x, calls))
            ratios.append(round(min(base) / min(mine), 3))
        out[scheme] = SchemeSpeed(scheme, choose_kernel(scheme, "cpu").short, ROWS, tuple(ratios),
                                  f"{cpu_name()} ({isa(cpu_features())})")
    return out


def _key(shapes) -> str:
    kernels = [choose_kernel(None, "cpu").kernel]  # the fp32 projections' own, which each is timed against
    for scheme in QUANTIZATION_SCHEMES:
        try:
            kernels.append(choose_kernel(scheme, "cpu").kernel)
        except ValueError as exc:
            kernels.append(str(exc))
    build = cpu_kernels.module_name() if cpu_kernels.compiled() is not None else None  # its source, flags, CPU
    text = json.dumps([sorted(cpu_features()), torch.__version__, kernels, build, shapes, QUANTIZATION_SCHEMES, ROWS,
                       os.cpu_count()])
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def scheme_speeds(shapes: list[tuple[int, int]], refresh: bool = False) -> dict[str, SchemeSpeed]:
    """measure()'s result, from the cache when this machine measured the same thing before."""
    shapes = [tuple(s) for s in shapes]
    key = _key(shapes)
    path = cache_dir() / CACHE_FILE
    try:
        known = json.loads(path.read_text())
    except (OSError, ValueError):
        known = {}
    if not isinstance(known, dict):
        known = {}
    if not refresh and isinstance(known.get(key), dict):
        try:
            return {s: SchemeSpeed(**{**v, "rows": tuple(v["rows"]), "speedup": tuple(v["speedup"])})
                    for s, v in known[key].items()}
        except (TypeError, KeyError):
            pass  # an older layout: measure again
    speeds = measure(shapes)
    known[key] = {s: asdict(v) for s, v in speeds.items()}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(known, indent=1))
        os.replace(tmp, path)
    except OSError:
        pass
    return speeds


def model_speeds(model) -> dict[str, SchemeSpeed]:
    """scheme_speeds over a loaded model's layer shapes; empty off the CPU (measured only where the CPU runs it)."""
    if model.device.type != "cpu":
        return {}
    return scheme_speeds(layer_shapes(model))
