"""Experiments: each returns dataclasses a UI can use; only the CLI prints. What each feature is worth (ablate,
memory) is ablation.py's; what each precision costs (kernels, decode, quality) precision.py's."""
from __future__ import annotations

import math
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch

from ..config import EngineConfig
from ..engine import LLMEngine
from ..llm import LLM, warm_up
from ..sampling_params import SamplingParams
from ..threads import usable_cores
from ..utils import cdiv
from ..workloads import Workload
from .hf import hf_generate, hf_pad_id, hf_static_batches, hf_warm_up, load_hf_model
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
    summarize_steps,
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
    hf = load_hf_model(llm)
    pad = hf_pad_id(hf, llm.tokenizer)
    hf_warm_up(hf, pad)
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
    hf = load_hf_model(llm)
    pad = hf_pad_id(hf, llm.tokenizer)
    hf_warm_up(hf, pad)
    seconds, generated, useful = hf_static_batches(hf, workload, batch_size, pad)
    del hf
    hf_tps = useful / seconds if seconds > 0 else 0.0
    return HFStaticResult(workload.name, batch_size, -(-len(workload.requests) // batch_size), seconds, generated,
                          useful, hf_tps, engine_run, engine_run.throughput / hf_tps if hf_tps else float("inf"))


@dataclass
class SchedCostResult:
    running: int
    prompt_len: int
    decode_steps: int
    decode: StepBreakdown  # steps that only decode (all admitted requests running)
    all_steps: StepBreakdown
    wall_s: float


def sched_cost(llm: LLM, running: int = 64, prompt_len: int = 16, decode_steps: int = 32,
               settings: dict[str, Any] | None = None, seed: int = 0) -> SchedCostResult:
    settings = dict(settings or {})
    settings["max_num_seqs"] = max(running, settings.get("max_num_seqs", EngineConfig.max_num_seqs))
    engine = llm.build_engine(settings)
    warm_up(engine)
    params = SamplingParams(temperature=0, max_tokens=decode_steps + 1, ignore_eos=True)
    tracker, wall = _drain(engine, random_prompts(running, prompt_len, seed), params)
    decodes = [r for r in tracker.records if r.decodes and not r.prefills]
    return SchedCostResult(running, prompt_len, decode_steps, summarize_steps(decodes),
                           summarize_steps(tracker.records), wall)


def _drain(engine: LLMEngine, prompts: list[list[int]], params: SamplingParams) -> tuple[StepTracker, float]:
    """Every prompt added with these params, then steps until all have finished: the steps, and the seconds."""
    tracker = StepTracker(engine)
    for prompt in prompts:
        engine.add_request(prompt, params)
    start = time.perf_counter()
    while engine.has_unfinished():
        tracker.step()
    return tracker, time.perf_counter() - start


# (label, SamplingParams fields): greedy first, the reference of every ratio
SAMPLING_MODES = (("greedy", {"temperature": 0.0}), ("temperature 1", {"temperature": 1.0}),
                  ("temperature 0.7, top-p 0.95", {"temperature": 0.7, "top_p": 0.95}),
                  ("temperature 0.8, top-k 50", {"temperature": 0.8, "top_k": 50}),
                  ("temperature 1, min-p 0.05", {"temperature": 1.0, "min_p": 0.05}))


@dataclass
class SamplingCostRow:
    mode: str
    tok_s: list[float]  # one per round
    sample_ms: list[float]  # the sampler's own mean time per step, one per round
    vs_greedy: list[float]  # tok/s over greedy's in the same round


def sampling_cost(llm: LLM, batch: int = 8, prompt_len: int = 128, tokens: int = 64, rounds: int = 3,
                  settings: dict[str, Any] | None = None, seed: int = 0) -> list[SamplingCostRow]:
    """`batch` requests decoding together in each sampling mode, the modes alternating within each round on one
    engine, fresh prompts every run: tokens/s and the sampler's own time per step."""
    engine = llm.build_engine(dict(settings or {}))
    warm_up(engine)
    rows = [SamplingCostRow(label, [], [], []) for label, _ in SAMPLING_MODES]
    draw = seed
    for _ in range(rounds):
        for row, (_, fields) in zip(rows, SAMPLING_MODES, strict=True):
            draw += 1
            params = SamplingParams(max_tokens=tokens, ignore_eos=True, seed=draw, **fields)
            tracker, took = _drain(engine, random_prompts(batch, prompt_len, draw), params)
            row.tok_s.append(batch * tokens / took)
            row.sample_ms.append(summarize_steps(tracker.records).mean_ms["sample_ms"])
        for row in rows:
            row.vs_greedy.append(row.tok_s[-1] / rows[0].tok_s[-1])
    return rows


@dataclass
class PrefillCostRow:
    budget: int  # max_num_batched_tokens
    ms_per_token: list[float]  # the wave's prefill time over its prompt tokens, one per round
    steps: list[int]  # steps the wave took
    forward_share: list[float]  # of the wave's time, the model's forward (the rest: scheduling, preparing, sampling)
    beside_busy: bool = False  # timed beside a busy process (busy_process)


# A process that computes busy_ms, then sleeps idle_ms, until killed: another program sharing the cores (as the
# benchmark client does beside a server: docs/measurements.md, "Why c=32 loses served but not offline"). busy_ms
# "inf" never sleeps: a neighbour that wants a whole core. It says "spinning" once it is, and ends by itself when
# the process that started it has gone (a parent killed without its finally: no spinner is left behind).
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
    """`count` other processes, each taking busy_ms / (busy_ms + idle_ms) of one core (busy_ms inf: all of it) while
    the block runs; every one of them spinning before the block starts, and killed and reaped when it ends, however
    it ends (one that failed to start takes the others down with it)."""
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


@contextmanager
def busy_process(busy_ms: float, idle_ms: float) -> Iterator[subprocess.Popen]:
    """Another process taking busy_ms / (busy_ms + idle_ms) of one core while the block runs."""
    with busy_processes(1, busy_ms, idle_ms) as procs:
        yield procs[0]


def prefill_cost(llm: LLM, budgets: list[int], batch: int = 32, prompt_len: int = 128, rounds: int = 3,
                 settings: dict[str, Any] | None = None, seed: int = 0,
                 busy: tuple[float, float] | None = None) -> list[PrefillCostRow]:
    """A wave of `batch` fresh prompts (one token each: all prefill) into an idle engine at each step budget, the
    budgets alternating within each round: what a burst of requests waits for its first token. Prefix caching is
    off: a cached run would time nothing. `busy` (busy_ms, idle_ms): each round also times every budget beside a
    busy process, so what a shared CPU costs each step size is read side by side."""
    engines = [llm.build_engine({**(settings or {}), "prefix_caching": False, "max_num_batched_tokens": b})
               for b in budgets]
    for engine in engines:
        warm_up(engine)
    conditions = [False, True] if busy is not None else [False]
    rows = {c: [PrefillCostRow(b, [], [], [], c) for b in budgets] for c in conditions}  # one per engine
    draw = seed
    for _ in range(rounds):
        for beside in conditions:
            with busy_process(*busy) if beside else nullcontext():
                for row, engine in zip(rows[beside], engines, strict=True):
                    draw += 1
                    _time_wave(engine, row, random_prompts(batch, prompt_len, draw))
    return [row for c in conditions for row in rows[c]]


def _time_wave(engine: LLMEngine, row: PrefillCostRow, prompts: list[list[int]]) -> None:
    tracker, took = _drain(engine, prompts, SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))
    row.ms_per_token.append(took * 1e3 / sum(len(p) for p in prompts))
    row.steps.append(len(tracker.records))
    row.forward_share.append(sum(r.forward_ms for r in tracker.records) / (took * 1e3))


@dataclass
class AttentionCostRow:
    case: str  # "decode rows" or "one causal chunk"
    rows: int  # query rows per call
    slots_read: int  # context slots read per call, summed over the rows
    ms_per_step: list[float]  # one call per layer, each over its own pool: one per round (the fastest of 3 steps)
    gb_s: list[float]  # K and V bytes of the slots read (per KV head, once per row) over the time, per round


def attention_cost(llm: LLM, rows: int = 32, context: int = 145, chunk: int = 224, rounds: int = 5,
                   seed: int = 0) -> list[AttentionCostRow]:
    """The engine's C++ attention kernel alone, as a step calls it: once per layer, each over a pool of its own (so
    no call reads memory the last one warmed), the rows' blocks scattered over a pool three times what they need
    (a pool after a while of serving). `rows` decode rows of `context` slots; one causal chunk of `chunk` rows."""
    from .. import cpu_kernels
    ext = cpu_kernels.compiled()
    if ext is None:
        raise RuntimeError("the engine's C++ kernels are not built here (make kernels)")
    shape, dtype = llm.engine.model.shape, llm.engine.model.dtype
    bs = llm.engine.config.block_size
    g = torch.Generator().manual_seed(seed)
    cases = {"decode rows": (rows, context), "one causal chunk": (1, chunk)}
    lists = {case: (requests, cdiv(length, bs), length) for case, (requests, length) in cases.items()}
    num_blocks = 3 * max(requests * per for requests, per, _ in lists.values())
    pools = [torch.randn(2, num_blocks * bs, shape.num_kv_heads, shape.head_dim, generator=g).to(dtype)
             for _ in range(shape.num_layers)]
    out = []
    for case, (requests, per, length) in lists.items():
        blocks = torch.randperm(num_blocks, generator=g)[:requests * per].view(requests, per)
        slots = (blocks.unsqueeze(-1) * bs + torch.arange(bs)).view(requests, per * bs)
        if case == "decode rows":
            lens, which = torch.full((requests,), length), None
        else:
            lens, which = torch.arange(1, length + 1), torch.zeros(length, dtype=torch.long)
        q = torch.randn(len(lens), shape.num_heads, shape.head_dim, generator=g).to(dtype)
        read = int(lens.sum())
        row = AttentionCostRow(case, len(lens), read, [], [])
        args = (q, slots, lens, which)
        _attention_step(ext, pools, args)  # untimed: the first call's allocations
        for _ in range(rounds):
            took = min(_attention_step(ext, pools, args) for _ in range(3))
            row.ms_per_step.append(took * 1e3)
            moved = 2 * read * shape.num_kv_heads * shape.head_dim * dtype.itemsize * shape.num_layers
            row.gb_s.append(moved / took / 1e9)
        out.append(row)
    return out


def _attention_step(ext, pools: list[torch.Tensor], args: tuple) -> float:
    """Seconds for one call of the C++ attention per layer, each over its own pool ([2, slots, KV, D])."""
    q, slots, lens, which = args
    start = time.perf_counter()
    for pool in pools:
        ext.decode_attention(q, pool[0], pool[1], slots, lens, None, None, which)
    return time.perf_counter() - start


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
    """What the engine keeps of its quiet speed when every thread that wants a CPU gets an equal slice of the cores
    (max-min fair): its `threads` against `neighbours` one-thread processes that each want `duty` of a core. With a
    thread per core and whole-core neighbours: cores / (cores + neighbours) (docs/measurements.md, "Beside a busy
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
    """What `bench versus` asks of a server, in-process and without HTTP: `concurrency` requests kept in flight until
    `requests` have run (fresh random prompts, ignore_eos, greedy). `neighbours` (counts): each round runs quiet,
    then beside that many busy processes for each count, so what neighbours on the same cores cost is read side by
    side. `busy` (busy_ms, idle_ms): each neighbour's duty cycle (default: always busy); alone, one neighbour.
    `settle`: the thread count settles before each run, so no run starts with the threads the last one left."""
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
