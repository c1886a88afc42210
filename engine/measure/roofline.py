"""The roofline: batch-1 decode against the bytes it reads over the read bandwidth, a batch of B rows against
2 x params x B flops over the matmul peak. Both limits are measured in the engine's process and on its threads, the
bytes counted from the loaded model's buffers (docs/measurements.md, "Against the machine's limits (the roofline)").
"""
from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..config import WEIGHT_FIELDS
from ..llm import LLM, engine_for, warm_up
from ..memory import available_bytes
from ..quant.kernels import cpu_features, cpu_name, isa
from ..quant.linear import Linear
from ..threads import usable_cores
from ..utils import cdiv
from .precision import load_each
from .report import Report, rounds_text
from .runs import GIB, Progress, decode_ms, tell
from .specs import resolve_spec

# each precision the engine runs on a CPU, every projection in it (the LM head too)
SPECS = ("dtype=float32", "dtype=bfloat16", "quantization=int8", "quantization=int4")
MIN_READ_BYTES = GIB  # the read buffer: at least this, and at least READ_OVER_LLC x the last-level cache
READ_OVER_LLC = 4


@dataclass
class Sizes:
    read_bytes: int | None = None  # None: max(MIN_READ_BYTES, READ_OVER_LLC x LLC), at most a quarter of free memory
    gemm_n: int = 2048  # the square GEMMs' side
    repeats: int = 5  # of each machine measurement (the best is kept)
    batch: int = 32
    prompt_len: int = 64
    tokens: int = 32  # decode steps timed per round
    rounds: int = 3


QUICK = Sizes(read_bytes=128 * 2**20, gemm_n=512, repeats=3, prompt_len=16, tokens=4, rounds=1)


@dataclass
class Machine:
    cpu: str  # /proc/cpuinfo's model name and its widest vector instructions
    threads: int  # torch's threads for every measurement here (the engine's at its start)
    cores: int
    llc_bytes: int | None  # the last-level cache as the system reports it (a VM's may not be what it has)
    read_bytes: int  # the buffer read
    read_gb_s: dict[str, list[float]]  # each read (Reads) -> GB/s, one per repeat
    gemm_n: int
    gemm_gflops: dict[str, list[float]]  # "fp32 GEMM by torch.mm", "fp32 GEMM by the engine's ...", ... -> per repeat

    @property
    def bandwidth(self) -> float:
        """Bytes per second: the best repeat of the best read (the others met other work, or read less well)."""
        return max(max(runs) for runs in self.read_gb_s.values()) * 1e9

    def peak_flops(self, precision: str) -> float:
        return max(max(runs) for name, runs in self.gemm_gflops.items() if name.startswith(precision)) * 1e9


@dataclass
class RooflineRow:
    spec: str
    precision: str
    kernel: str  # what runs the projections here
    weight_bytes: int  # every projection's stored weights and scales, and the norms: read once a step
    row_bytes: int  # per row a step: its embedding row and its K and V at the timed steps' mean context
    matmul_params: int  # multiply-adds per row: in x out features over every projection, the LM head included
    peak: str  # the GEMM rate the compute floor uses: the activations' dtype ("fp32" or "bf16")
    batch1_ms: list[float]  # ms per decode step, one request, per round
    batch_ms: list[float]  # ms per decode step, `batch` requests, per round
    threads: str  # the engine's compute threads at the end (engine/threads.py)
    batch1_read_gb_s: list[float] = field(default_factory=list)  # the best read just before each round's batch 1
    bandwidth_floor_ms: float = 0.0  # batch 1: (weight_bytes + row_bytes) / read bandwidth
    batch1_ratio: float = 0.0  # measured (median) / bandwidth floor
    batch1_beside_ratios: list[float] = field(default_factory=list)  # each round against the read just before it
    compute_floor_ms: float = 0.0  # batch B: 2 x matmul_params x B / peak
    batch_bandwidth_floor_ms: float = 0.0  # batch B: (weight_bytes + B x row_bytes) / read bandwidth
    batch_ratio: float = 0.0  # measured (median) / compute floor

    @property
    def bytes_per_step(self) -> int:
        return self.weight_bytes + self.row_bytes


@dataclass
class Roofline:
    machine: Machine
    sizes: Sizes
    rows: list[RooflineRow] = field(default_factory=list)


# ---- the machine -----------------------------------------------------------------------------------------
def llc_bytes() -> int | None:
    best: tuple[int, int] | None = None
    for index in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*"):
        try:
            level = int((index / "level").read_text())
            text = (index / "size").read_text().strip()
        except (OSError, ValueError):
            continue
        scale = {"K": 2**10, "M": 2**20, "G": 2**30}.get(text[-1:].upper(), 1)
        try:
            size = int(text.rstrip("KMGkmg")) * scale
        except ValueError:
            continue
        if best is None or level > best[0]:
            best = (level, size)
    return None if best is None else best[1]


def default_read_bytes(llc: int | None, available: int | None = None) -> int:
    """At most a quarter of `available` (default: the free memory now)."""
    want = max(MIN_READ_BYTES, READ_OVER_LLC * (llc or 0))
    available = available or available_bytes()
    return min(want, available // 4) if available else want


GEMV_COLS = 4096  # the read buffer as a [rows, 4096] fp32 matrix for the matrix-vector read


class Reads:
    """Four reads of one buffer of about nbytes, each touching every byte once: no one of them is fastest on every
    machine (or every minute of a shared one), so the bandwidth is the best of all. Kept to read again beside each
    round of decode steps: a VM's memory can change speed from one minute to the next."""

    def __init__(self, nbytes: int) -> None:
        self.nbytes = nbytes
        self.buffer = buffer = torch.empty(max(1, nbytes // (4 * GEMV_COLS)) * GEMV_COLS, dtype=torch.float32)
        buffer.fill_(1.0)  # as bf16: pairs of 0 and 1, finite
        ones = torch.ones(GEMV_COLS)
        own = Linear(buffer.view(-1, GEMV_COLS))
        self.reads = {"fp32 sum": buffer.sum, "bf16 sum": buffer.view(torch.bfloat16).sum,
                      "fp32 matrix-vector": lambda: torch.mv(buffer.view(-1, GEMV_COLS), ones),
                      f"fp32 matrix-vector by the engine's {own.choice.kernel}": lambda: own(ones[None])}
        for read in self.reads.values():  # untimed: each call's first-time costs
            read()

    def measure(self, repeats: int) -> dict[str, list[float]]:
        """GB/s of each read, one per repeat, the reads alternating so that a busy moment hits each alike."""
        out: dict[str, list[float]] = {name: [] for name in self.reads}
        for _ in range(repeats):
            for name, read in self.reads.items():
                start = time.perf_counter()
                read()
                out[name].append(self.buffer.numel() * 4 / (time.perf_counter() - start) / 1e9)
        return out

    def best(self) -> float:
        """GB/s: the best of one pass of the four reads."""
        return max(runs[0] for runs in self.measure(1).values())


def gemm_rate(n: int, dtype: torch.dtype, repeats: int = 3) -> dict[str, list[float]]:
    """GFLOP/s of an n x n x n matmul, one per repeat, by torch.mm and by the engine's kernel (torch's may lose)."""
    g = torch.Generator().manual_seed(0)
    a, b = (torch.randn(n, n, generator=g).to(dtype) for _ in range(2))
    own = Linear(b)
    name = "fp32" if dtype == torch.float32 else "bf16"
    out: dict[str, list[float]] = {}
    for label, mm in ((f"{name} GEMM by torch.mm", lambda: torch.mm(a, b)),
                      (f"{name} GEMM by the engine's {own.choice.kernel}", lambda: own(a))):
        mm()  # untimed: oneDNN's first call picks and builds its kernel
        for _ in range(repeats):
            start = time.perf_counter()
            mm()
            out.setdefault(label, []).append(2 * n**3 / (time.perf_counter() - start) / 1e9)
    return out


def measure_machine(reads: Reads, llc: int | None, gemm_n: int = 2048, repeats: int = 5) -> Machine:
    flags = cpu_features()
    extras = [name for flag, name in (("avx512_bf16", "AVX-512 BF16"), ("amx_bf16", "AMX BF16")) if flag in flags]
    return Machine(cpu=f"{cpu_name()} ({', '.join([isa(flags), *extras])})", threads=torch.get_num_threads(),
                   cores=usable_cores(), llc_bytes=llc, read_bytes=reads.nbytes,
                   read_gb_s=reads.measure(repeats), gemm_n=gemm_n,
                   gemm_gflops={**gemm_rate(gemm_n, torch.float32, repeats),
                                **gemm_rate(gemm_n, torch.bfloat16, repeats)})


# ---- what a decode step reads and computes -----------------------------------------------------------------
def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def weight_bytes_per_step(model: Any) -> int:
    """Bytes every decode step reads whatever its batch: each projection's buffers as its kernel streams them (by
    its own count where Python cannot see them: fbgemm's w8a8), and the norms and biases."""
    total = 0
    for p in model.projections():
        tensors = p.weight_tensors()
        total += sum(_nbytes(t) for t in tensors) if tensors else p.nbytes
    for layer in model.layers:
        total += sum(_nbytes(v) for f in dataclasses.fields(layer)
                     if isinstance(v := getattr(layer, f.name), torch.Tensor))
    return total + _nbytes(model.norm)


def row_bytes_per_step(model: Any, context: int, kv_cache_dtype: str = "auto") -> int:
    return model.embed.shape[1] * model.embed.element_size() + context * model.kv_bytes_per_token(kv_cache_dtype)


def matmul_params(model: Any) -> int:
    """Multiply-adds a row costs in the projections (attention's left out: a few percent at these lengths)."""
    return sum(p.in_features * p.out_features for p in model.projections())


# ---- the engine against the floors -------------------------------------------------------------------------
def _engine(llm: LLM, spec: str, config, model, settings: dict[str, Any], sizes: Sizes):
    """An engine over `model` with the spec's other fields (a preset's int8 KV cache), a pool with room for the
    batch, no prefix cache (fresh prompts), no speculation (a step a token)."""
    longest = sizes.prompt_len + sizes.tokens + sizes.batch + 9
    fields = {**settings, **resolve_spec(spec), **{name: getattr(config, name) for name in WEIGHT_FIELDS}}
    fields.update(speculative_decoding=False, prefix_caching=False, max_num_seqs=sizes.batch,
                  num_kv_blocks=sizes.batch * cdiv(longest, fields.get("block_size", config.block_size)) + 1)
    return engine_for(llm.config_for(fields), model, llm.tokenizer, llm.engine.hf_config)


def roofline(llm: LLM, specs: Sequence[str] = SPECS, sizes: Sizes | None = None,
             settings: dict[str, Any] | None = None, progress: Progress = None) -> Roofline:
    """The machine's limits, then each precision's decode against them, the rounds going round every precision."""
    sizes = sizes or Sizes()
    if llm.engine.model.device.type != "cpu":
        raise ValueError("roofline measures a CPU's bandwidth and matmul peak: load the model on the CPU")
    settings = {k: v for k, v in (settings or {}).items() if k != "model"}
    total = len(specs) + 1 + sizes.rounds
    tell(progress, 0, total, "the machine: read bandwidth, GEMM peaks")
    llc = llc_bytes()
    reads = Reads(sizes.read_bytes or default_read_bytes(llc))  # read again beside each round below
    machine = measure_machine(reads, llc, sizes.gemm_n, sizes.repeats)
    configs, models = load_each(llm, specs, sizes.rounds, None)
    engines = [_engine(llm, spec, c, m, settings, sizes) for spec, c, m in zip(specs, configs, models, strict=True)]
    times = [([], [], []) for _ in specs]
    try:
        for engine in engines:
            warm_up(engine)
        for r in range(sizes.rounds):
            tell(progress, len(specs) + 1 + r, total, f"round {r + 1} of {sizes.rounds}")
            for engine, (one, many, beside) in zip(engines, times, strict=True):
                beside.append(reads.best())
                one.append(decode_ms(engine, 1, sizes.prompt_len, sizes.tokens, seed=2 * r))
                many.append(decode_ms(engine, sizes.batch, sizes.prompt_len, sizes.tokens, seed=2 * r + 1))
    finally:
        torch.set_num_threads(machine.threads)  # as found: each engine's count follows the machine's other work
    tell(progress, total, total, "done")
    result = Roofline(machine, sizes)
    context = sizes.prompt_len + sizes.tokens // 2  # the timed steps' mean context, near enough
    for spec, config, engine, (one, many, beside) in zip(specs, configs, engines, times, strict=True):
        model = engine.model
        peak = "bf16" if model.projections()[0].input_dtype == torch.bfloat16 else "fp32"
        row = RooflineRow(spec, config.precision, engine.kernels()["weights"], weight_bytes_per_step(model),
                          row_bytes_per_step(model, context, engine.config.kv_cache_dtype), matmul_params(model),
                          peak, one, many, engine.cores.describe(), beside)
        fill_floors(row, machine, sizes.batch)
        result.rows.append(row)
    return result


def fill_floors(row: RooflineRow, machine: Machine, batch: int) -> None:
    row.bandwidth_floor_ms = row.bytes_per_step / machine.bandwidth * 1e3
    row.batch1_ratio = statistics.median(row.batch1_ms) / row.bandwidth_floor_ms
    row.batch1_beside_ratios = [ms / (row.bytes_per_step / (gb_s * 1e6))
                                for ms, gb_s in zip(row.batch1_ms, row.batch1_read_gb_s, strict=True)]
    row.compute_floor_ms = 2 * row.matmul_params * batch / machine.peak_flops(row.peak) * 1e3
    row.batch_bandwidth_floor_ms = (row.weight_bytes + batch * row.row_bytes) / machine.bandwidth * 1e3
    row.batch_ratio = statistics.median(row.batch_ms) / row.compute_floor_ms


def roofline_report(result: Roofline) -> Report:
    m, s = result.machine, result.sizes
    report = Report(f"the roofline: decode against this machine's read bandwidth and matmul peak ({m.cpu}, "
                    f"{m.threads} threads on {m.cores} cores)")
    llc = f"{m.llc_bytes / 2**20:.0f} MiB" if m.llc_bytes else "unknown"
    report.tables["this machine (best of each)"] = [
        *({"measure": f"read bandwidth: {name} over {m.read_bytes / 2**20:.0f} MiB (last-level cache {llc})",
           "best": f"{max(runs):.1f} GB/s", "runs": rounds_text(runs, 1)} for name, runs in m.read_gb_s.items()),
        *({"measure": f"{name}, {m.gemm_n} x {m.gemm_n} x {m.gemm_n}",
           "best": f"{max(runs):.0f} GFLOP/s", "runs": rounds_text(runs, 0)} for name, runs in m.gemm_gflops.items())]
    report.tables["batch 1: ms a token against the bandwidth floor"] = [
        {"spec": r.spec, "precision": r.precision, "weights MB a step": r.weight_bytes / 1e6,
         "K, V and embedding MB": r.row_bytes / 1e6, "floor ms": r.bandwidth_floor_ms,
         "measured ms (median)": statistics.median(r.batch1_ms), "measured ms (runs)": rounds_text(r.batch1_ms),
         "measured / floor": r.batch1_ratio,
         "each round / the read just before it": rounds_text(r.batch1_beside_ratios),
         "threads": r.threads} for r in result.rows]
    report.tables[f"batch {s.batch}: ms a step against the compute floor"] = [
        {"spec": r.spec, "kernel": r.kernel, "matmul params (M)": r.matmul_params / 1e6,
         "GFLOP a step": 2 * r.matmul_params * s.batch / 1e9, "peak": r.peak,
         "compute floor ms": r.compute_floor_ms, "bandwidth floor ms": r.batch_bandwidth_floor_ms,
         "measured ms (median)": statistics.median(r.batch_ms), "measured ms (runs)": rounds_text(r.batch_ms),
         "measured / compute floor": r.batch_ratio} for r in result.rows]
    report.notes.append(f"decode steps: prompts of {s.prompt_len} random tokens, {s.tokens} steps timed a round "
                        f"after untimed prefills, {s.rounds} rounds going round every precision; the floors use the "
                        "best machine measurement (the bandwidth: the best of the four reads), the ratios the median "
                        "step; beside them, each round's step against the best of the four reads taken just before it "
                        "(a VM's memory can change speed from one minute to the next)")
    report.notes.append("bytes: each projection's stored weights and scales as its kernel reads them, the norms, and "
                        f"per row its embedding row and K and V at the timed steps' mean context "
                        f"({s.prompt_len + s.tokens // 2} tokens); compute: 2 x the projections' multiply-adds x "
                        "rows (attention's left out), at the GEMM peak of the activations' dtype")
    report.notes.append("measured / floor: 1 is the machine's limit; below 1, the steps read faster than the reads "
                        "here did (a cache holding part of the weights, or reads that met other work); on a machine "
                        "shared with other work both sides move, so compare within one run")
    if m.llc_bytes and m.read_bytes < 2 * m.llc_bytes:
        report.notes.append(f"the read buffer ({m.read_bytes / 2**20:.0f} MiB) is not much larger than the last-level "
                            "cache: the bandwidth may be the cache's, not memory's (--read-mb)")
    report.rows = [result]
    return report
