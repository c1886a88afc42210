"""The C++ kernels' own threads (engine/csrc/cpu_kernels.cpp, namespace pool): every chunk of a parallel region runs
exactly once, the kernels give the same floats on any number of threads, and a call never waits for a worker that
has not claimed a chunk: with every worker stopped between reading a job and claiming (the pool's test hook, the
stand-in for a thread the OS keeps off its core) calls still return, exact, and the stopped worker, let go, claims
nothing of a job that has ended.
"""
from __future__ import annotations

import pytest
import torch

from engine import cpu_kernels
from engine import threads as engine_threads
from engine.quant.linear import Int4Linear, Int8Linear, Linear
from engine.threads import usable_cores
from tests.conftest import wait_until

ext = cpu_kernels.compiled()
pytestmark = pytest.mark.skipif(ext is None or not hasattr(ext, "pool_count"), reason="the C++ kernels are not built")
needs_two_cores = pytest.mark.skipif(usable_cores() < 2, reason="the pool's workers need a second usable core")


@pytest.fixture
def kernel_threads():
    """Sets the kernels' thread count for one test; puts back the default (torch's count) after."""
    yield ext.kernel_threads
    ext.pool_hold(False)
    ext.kernel_threads(0)


def test_every_chunk_runs_exactly_once_on_any_thread_count(kernel_threads):
    for threads in range(1, usable_cores() + 2):
        kernel_threads(threads)
        for items, grain in [(1, 1), (2, 1), (7, 3), (64, 1), (1000, 7), (4096, 64), (333, 1000)]:
            for _ in range(20):
                counts = ext.pool_count(items, grain, 0)
                assert counts.shape == (items,) and bool((counts == 1).all()), (threads, items, grain)


@needs_two_cores
def test_workers_take_chunks(kernel_threads):
    assert kernel_threads(2) == 2
    before = ext.pool_stats()["worker_chunks"]
    # a loaded machine can keep a worker waiting
    assert wait_until(lambda: bool((ext.pool_count(200, 1, 200) == 1).all())
                      and ext.pool_stats()["worker_chunks"] > before, timeout_s=30.0, poll_s=0.01)


@needs_two_cores
def test_the_caller_takes_chunks_from_the_front_and_the_workers_from_the_back(kernel_threads):
    """Each thread walks its own end of a region: the caller's chunks are a prefix, started in order, and the
    workers' the rest, each worker's started from the back. A kernel's threads then read contiguous runs of a weight
    (and fetch ahead where they go next), not chunks dealt out in turn."""
    seen = {}

    def worker_took_part():
        seen["runs"] = ext.pool_runs(64, 100)
        return bool((seen["runs"][:, 0] > 0).any())

    for threads in sorted({2, min(3, usable_cores())}):
        kernel_threads(threads)
        assert wait_until(worker_took_part, timeout_s=30.0, poll_s=0.01)  # a loaded machine can keep it waiting
        who, order = seen["runs"][:, 0].tolist(), seen["runs"][:, 1].tolist()
        assert sorted(order) == list(range(64))
        front = who.index(next(w for w in who if w > 0))
        assert all(w == 0 for w in who[:front]) and all(w > 0 for w in who[front:]), who
        assert order[:front] == sorted(order[:front])
        for worker in set(who[front:]):
            mine = [i for i in range(64) if who[i] == worker]
            assert [order[i] for i in mine] == sorted((order[i] for i in mine), reverse=True), (worker, who, order)


def test_idle_workers_that_yield_before_sleeping_still_run_every_chunk_once(kernel_threads):
    """kernel_yield_us (off by default): an idle worker checks for work between sched_yield calls before it sleeps;
    the regions' chunks still run exactly once, and the pool counts its regions."""
    assert ext.kernel_yield_us() == 0
    kernel_threads(min(2, usable_cores()))
    before = ext.pool_stats()
    try:
        assert ext.kernel_yield_us(2000) == 2000
        for items, grain in [(2, 1), (64, 1), (1000, 7)]:
            for _ in range(20):
                assert bool((ext.pool_count(items, grain, 0) == 1).all()), (items, grain)
    finally:
        ext.kernel_yield_us(0)
    after = ext.pool_stats()
    assert after["regions"] + after["alone"] >= before["regions"] + before["alone"] + 60
    assert after["wait_ns"] >= before["wait_ns"] and after["region_ns"] + after["alone_ns"] > 0


def test_idle_workers_yield_only_while_a_few_others_want_a_core(kernel_threads, monkeypatch):
    """KernelThreads turns the workers' yield on while 0 < other running threads < usable cores (beside one busy
    process on two cores), after DROP_AFTER readings in a row, and off again when quiet or crowded; settle() takes
    the readings at once."""
    seen = {"others": 0}
    monkeypatch.setattr(engine_threads, "others_running", lambda: seen["others"])
    monkeypatch.setattr(engine_threads, "usable_cores", lambda: 2)
    clock = iter(range(1, 1000))
    try:
        cores = engine_threads.KernelThreads(ext, most=2)

        def tick(others: int, times: int = 1) -> int:
            seen["others"] = others
            for _ in range(times):
                cores.adjust(now=next(clock) * engine_threads.EVERY_S)
            assert cores.yield_us == ext.kernel_yield_us()
            return ext.kernel_yield_us()
        assert tick(0, 3) == 0  # quiet: as without it
        assert tick(1) == 0  # one reading is a passing process
        assert tick(1) == engine_threads.YIELD_US and "yield" in cores.describe()
        assert tick(0) == engine_threads.YIELD_US and tick(1) == engine_threads.YIELD_US  # not two readings in a row
        assert tick(2) == engine_threads.YIELD_US and tick(2) == 0  # as many others as cores: it sleeps again
        assert tick(6, 3) == 0 and "yield" not in cores.describe()
        seen["others"] = 1
        cores.settle(gap_s=0)
        assert ext.kernel_yield_us() == engine_threads.YIELD_US
        seen["others"] = 0
        cores.settle(gap_s=0)
        assert ext.kernel_yield_us() == 0
    finally:
        ext.kernel_yield_us(0)


@needs_two_cores
def test_a_call_returns_while_its_worker_is_stopped_before_claiming(kernel_threads):
    kernel_threads(2)
    ext.pool_count(64, 1, 50)  # the worker started
    ext.pool_hold(True)
    before = ext.pool_stats()
    calls = 0
    while ext.pool_stats()["holds"] == before["holds"] and calls < 200:  # until the worker has read a job and stopped
        assert bool((ext.pool_count(100, 1, 1000) == 1).all())
        calls += 1
    held = ext.pool_stats()
    assert held["holds"] > before["holds"], "the worker never read a job"
    for _ in range(5):  # more calls, the worker still stopped: each returns, every chunk run once, all by the caller
        assert bool((ext.pool_count(100, 1, 100) == 1).all())
    assert ext.pool_stats()["worker_chunks"] == held["worker_chunks"]
    ext.pool_hold(False)
    # let go, the worker finds the job it read has ended: its claim is refused, it runs nothing of it
    assert wait_until(lambda: ext.pool_stats()["refused_claims"] > held["refused_claims"], timeout_s=30.0, poll_s=0.01)
    assert ext.pool_stats()["worker_chunks"] == held["worker_chunks"]
    for _ in range(20):
        assert bool((ext.pool_count(500, 3, 20) == 1).all())


def _projections() -> list:
    g = torch.Generator().manual_seed(48)
    made = []
    for n, k in [(576, 576), (3072, 576), (576, 1536), (961, 96)]:
        w = torch.randn(n, k, generator=g) * 0.05
        made += [Linear(w), Linear(w.to(torch.bfloat16)), Int8Linear(w)]
        try:
            made.append(Int4Linear(w, 32))
        except ValueError as e:  # torch's int4 kernel (a CPU without AVX-512) packs outputs 16 at a time only
            assert n % 16 and "multiples of 16" in str(e)
    return made


def test_the_kernels_give_the_same_floats_on_one_thread_and_more(kernel_threads):
    g = torch.Generator().manual_seed(7)
    cases = []
    for proj in _projections():
        for m in (1, 3, 8, 17):
            cases.append((proj, torch.randn(m, proj.in_features, generator=g).to(proj.input_dtype)))
    kernel_threads(1)
    alone = [proj(x) for proj, x in cases]
    for threads in range(2, usable_cores() + 2):
        kernel_threads(threads)
        for _ in range(5):
            for (proj, x), expected in zip(cases, alone, strict=True):
                assert torch.equal(proj(x), expected), (repr(proj), tuple(x.shape), threads)


def test_the_default_models_greedy_tokens_are_the_same_on_one_kernel_thread_and_more(default_llm, kernel_threads):
    from engine import SamplingParams
    from tests.test_parity import TEXT_PROMPTS, random_prompts
    prompts = [default_llm.tokenizer(p).input_ids for p in TEXT_PROMPTS] + random_prompts(4, seed=48)
    greedy = SamplingParams(temperature=0, max_tokens=24)
    kernel_threads(1)
    alone = [o.token_ids for o in default_llm.generate(prompts, greedy)]
    kernel_threads(max(2, usable_cores()))
    assert [o.token_ids for o in default_llm.generate(prompts, greedy)] == alone
