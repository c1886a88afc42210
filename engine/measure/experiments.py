"""The other experiments: the reference table, a comparison, HF's static batches, the closed loop (beside busy
neighbours). What each feature is worth is ablation.py's; what each precision costs, precision.py's."""
from __future__ import annotations

import math
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch

from ..engine import LLMEngine
from ..llm import LLM, warm_up
from ..sampling_params import SamplingParams
from ..threads import usable_cores
from ..workloads import Workload
from .hf import hf_generate, hf_static_batches, load_hf_model
from .runs import (
    GIB,
    Progress,
    RunResult,
    StepBreakdown,
    StepTracker,
    StopCheck,
    config_fields,
    fixed_workload,
    kv_bytes_per_block,
    random_prompts,
    run_config,
    run_workload,
    tell,
    weight_bytes,
)
from .specs import resolve_spec


@dataclass
class TableRow:
    batch: int
    time_s: float
    ttft_s: float | None
    tpot_s: float | None
    memory_gb: float
    tps: float
    generated_tokens: int
    peak_kv_blocks: int
    steps: StepBreakdown
    hf_time_s: float | None = None
    hf_tps: float | None = None
    ratio: float | None = None  # engine TPS / HF TPS


def table_prompts(batch: int, input_len: int, seed: int) -> list[list[int]]:
    """Seeded per batch size, so one batch's prompts never share a prefix with another's."""
    return random_prompts(batch, input_len, seed * 100_003 + batch)


def engine_memory_gb(engine: LLMEngine, peak_blocks: int) -> float:
    """CUDA: allocator peak. CPU: the peak KV blocks in use plus the weights."""
    device = engine.model.device
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / GIB
    return (peak_blocks * kv_bytes_per_block(engine) + weight_bytes(engine.model)) / GIB


def run_table_row(llm: LLM, batch: int, input_len: int, output_len: int, settings: dict[str, Any],
                  seed: int = 0) -> TableRow:
    workload = fixed_workload(table_prompts(batch, input_len, seed), output_len)
    engine = llm.build_engine(settings)
    warm_up(engine)
    if engine.model.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(engine.model.device)
    run = run_workload(engine, workload)
    return TableRow(batch, run.wall_s, run.mean_ttft_s, run.mean_tpot_s, engine_memory_gb(engine, run.peak_kv_blocks),
                    run.throughput, run.generated_tokens, run.peak_kv_blocks, run.steps)


def add_hf_to_rows(llm: LLM, rows: list[TableRow], input_len: int, output_len: int, seed: int = 0) -> None:
    """Time transformers' generate on each row's prompts (loaded after the engine runs, so CUDA peaks stay apart)."""
    hf, pad = load_hf_model(llm)
    for row in rows:
        row.hf_time_s = hf_generate(hf, table_prompts(row.batch, input_len, seed), output_len, pad)
        row.hf_tps = row.batch * output_len / row.hf_time_s
        row.ratio = row.tps / row.hf_tps
    del hf


def run_table(llm: LLM, batch_sizes: Sequence[int], input_len: int = 128, output_len: int = 128,
              settings: dict[str, Any] | None = None, hf: bool = True, seed: int = 0) -> list[TableRow]:
    rows = [run_table_row(llm, b, input_len, output_len, settings or {}, seed) for b in batch_sizes]
    if hf:
        add_hf_to_rows(llm, rows, input_len, output_len, seed)
    return rows


@dataclass
class CompareResult:
    workload: str
    labels: tuple[str, str]
    results: tuple[RunResult, RunResult]  # the first repetition's
    ratio: float  # throughput b / a, the median over repetitions
    same_outputs: bool  # every request's output token ids equal (expected for greedy workloads)
    ratios: list[float] = field(default_factory=list)  # throughput b / a in each repetition
    gap_ratios: list[float] = field(default_factory=list)  # max token gap a / b in each repetition


def compare(llm: LLM, workload: Workload, spec_a: str, spec_b: str, settings: dict[str, Any] | None = None,
            repeat: int = 1, progress: Progress = None, should_stop: StopCheck | None = None) -> CompareResult:
    """The same workload through two configurations, a then b, `repeat` times side by side (the spread of the
    ratios says how much to trust it on a noisy machine)."""
    fields = [config_fields(workload, settings or {}, resolve_spec(s)) for s in (spec_a, spec_b)]
    for f in fields:  # every spec is checked before anything runs
        llm.config_for(f)
    plan = [(spec, f) for _ in range(max(1, repeat)) for spec, f in zip((spec_a, spec_b), fields, strict=True)]
    runs = []
    for i, (spec, f) in enumerate(plan):
        tell(progress, i, len(plan), spec)
        runs.append(run_config(llm, workload, f, should_stop))
    tell(progress, len(plan), len(plan), "done")
    pairs = list(zip(runs[::2], runs[1::2], strict=True))
    ratios = [b.throughput / a.throughput if a.throughput else float("inf") for a, b in pairs]
    gap_ratios = [a.max_token_gap_s / b.max_token_gap_s for a, b in pairs if a.max_token_gap_s and b.max_token_gap_s]
    return CompareResult(workload.name, (spec_a, spec_b), pairs[0], statistics.median(ratios),
                         all(x.output_token_ids == y.output_token_ids for x, y in pairs), ratios, gap_ratios)


@dataclass
class HFStaticResult:
    workload: str
    batch_size: int
    num_batches: int
    hf_wall_s: float
    hf_generated_tokens: int  # every row runs to its batch's longest output
    hf_useful_tokens: int  # each request's own max_tokens
    hf_throughput: float  # useful tokens per second
    engine: RunResult
    ratio: float  # engine throughput / HF throughput


def hf_static(llm: LLM, workload: Workload, batch_size: int = 8,
              settings: dict[str, Any] | None = None) -> HFStaticResult:
    engine_run = run_config(llm, workload, config_fields(workload, settings or {}, {}))
    hf, pad = load_hf_model(llm)
    seconds, generated, useful = hf_static_batches(hf, workload, batch_size, pad)
    del hf
    hf_tps = useful / seconds if seconds > 0 else 0.0
    return HFStaticResult(workload.name, batch_size, -(-len(workload.requests) // batch_size), seconds, generated,
                          useful, hf_tps, engine_run, engine_run.throughput / hf_tps if hf_tps else float("inf"))


# A neighbour sharing the cores (docs/measurements.md, "Why c=32 loses served but not offline"): busy_ms computing,
# idle_ms asleep; it ends by itself once its parent has gone, so a parent killed without its finally leaves no spinner
_BUSY_LOOP = """
import os, sys, time
busy, idle = float(sys.argv[1]) / 1e3, float(sys.argv[2]) / 1e3
parent = os.getppid()
print("spinning", flush=True)
while os.getppid() == parent:
    start = last = time.perf_counter()
    while (now := time.perf_counter()) - start < busy:
        if now - last > 0.1:
            if os.getppid() != parent:
                sys.exit()
            last = now
    if idle > 0:
        time.sleep(idle)
"""
MAX_NEIGHBOURS = 64  # busy processes one measurement may start at once


@contextmanager
def busy_processes(count: int, busy_ms: float = math.inf, idle_ms: float = 0.0) -> Iterator[list[subprocess.Popen]]:
    """`count` processes each taking busy_ms / (busy_ms + idle_ms) of a core, all spinning before the block starts
    and killed and reaped however it ends."""
    if not 0 <= count <= MAX_NEIGHBOURS:
        raise ValueError(f"busy processes: 0 to {MAX_NEIGHBOURS} at once, got {count}")
    procs: list[subprocess.Popen] = []
    try:
        for _ in range(count):
            procs.append(subprocess.Popen([sys.executable, "-c", _BUSY_LOOP, str(busy_ms), str(idle_ms)],
                                          stdout=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True))
        for proc in procs:  # started and spinning before anything is timed
            if proc.stdout.readline().strip() != "spinning":
                raise RuntimeError(f"a busy process ended before it spun (exit code {proc.wait()})")
        yield procs
    finally:
        for proc in procs:
            proc.kill()
        for proc in procs:
            proc.wait()
            proc.stdout.close()


@dataclass
class ClosedLoopRow:
    neighbours: int  # busy processes beside the engine while it ran (0: quiet)
    tok_s: list[float]  # output tokens over the run's time, one per round
    decode_step_ms: list[float]  # the median forward of the steps that only decode, per round
    mixed_step_ms: list[float]  # the median forward of the steps that also prefill, per round
    vs_quiet: list[float] = field(default_factory=list)  # tok/s over the same round's quiet run's
    fair_share: float = 1.0  # of the quiet speed, what an equal slice of the cores per runnable thread leaves it
    threads: list[int] = field(default_factory=list)  # the engine's compute threads at the end of each run

    @property
    def beside_busy(self) -> bool:
        return self.neighbours > 0

    @property
    def of_fair_share(self) -> list[float]:
        """Each round's tok/s over its fair share of the quiet run's: 1 gets what sharing fairly leaves."""
        return [v / self.fair_share for v in self.vs_quiet]


def fair_share(neighbours: int, threads: int, cores: int, duty: float = 1.0) -> float:
    """What the engine keeps of its quiet speed when every thread that wants a CPU gets a max-min fair slice of the
    cores, beside `neighbours` processes wanting `duty` of a core each (docs/measurements.md, "Beside a busy
    neighbour")."""
    demands = sorted([1.0] * threads + [duty] * neighbours)
    left, level = float(cores), 1.0
    for i, demand in enumerate(demands):  # max-min fair: fill the smallest demands first
        even = left / (len(demands) - i)
        if demand > even:
            level = even
            break
        left -= demand
    return min(1.0, level) * threads / min(threads, cores)


def closed_loop(llm: LLM, concurrency: int = 32, requests: int = 64, prompt_len: int = 128, output_len: int = 64,
                rounds: int = 2, settings: dict[str, Any] | None = None, seed: int = 0,
                busy: tuple[float, float] | None = None, neighbours: Sequence[int] | None = None,
                settle: bool = True) -> list[ClosedLoopRow]:
    """`bench versus`'s load in-process: `concurrency` requests in flight until `requests` have run. Each round runs
    quiet, then beside each count in `neighbours` of busy processes (duty cycle `busy`; alone, one neighbour).
    `settle`: no run starts with the thread count the last one left."""
    counts = list(neighbours) if neighbours else ([1] if busy is not None else [])
    if any(k < 1 for k in counts):
        raise ValueError(f"neighbour counts must be at least 1 (the quiet run is always made), got {counts}")
    busy_ms, idle_ms = busy if busy is not None else (math.inf, 0.0)
    duty = busy_ms / (busy_ms + idle_ms) if math.isfinite(busy_ms) else 1.0
    engine = llm.build_engine({"max_num_seqs": concurrency, **(settings or {})})
    warm_up(engine)
    cores = engine.cores
    rows = [ClosedLoopRow(k, [], [], [], fair_share=fair_share(k, cores.most, usable_cores(), duty))
            for k in [0, *counts]]
    draw, threads = seed, torch.get_num_threads()
    try:
        for _ in range(rounds):
            for row in rows:
                draw += 1
                with busy_processes(row.neighbours, busy_ms, idle_ms):
                    if settle:
                        cores.settle()
                    _run_closed_loop(engine, row, random_prompts(requests, prompt_len, draw), concurrency,
                                     output_len)
                row.threads.append(cores.threads)
            for row in rows:
                row.vs_quiet.append(row.tok_s[-1] / rows[0].tok_s[-1])
    finally:
        torch.set_num_threads(threads)  # as found: the engine's count followed the neighbours, now gone
    return rows


def _run_closed_loop(engine: LLMEngine, row: ClosedLoopRow, prompts: list[list[int]], concurrency: int,
                     output_len: int) -> None:
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    tracker, sent, done = StepTracker(engine), 0, 0
    start = time.perf_counter()
    while done < len(prompts):
        while sent < len(prompts) and sent - done < concurrency:
            engine.add_request(prompts[sent], params)
            sent += 1
        done += sum(1 for out in tracker.step() if out.finished)
    took = time.perf_counter() - start
    row.tok_s.append(len(prompts) * output_len / took)
    decode = [r.forward_ms for r in tracker.records if 0 < r.num_batched_tokens == r.num_seqs]
    mixed = [r.forward_ms for r in tracker.records if r.num_batched_tokens > r.num_seqs]
    row.decode_step_ms.append(statistics.median(decode) if decode else 0.0)
    row.mixed_step_ms.append(statistics.median(mixed) if mixed else 0.0)
