"""Property tests of the block pool, the KV cache manager and the engine's scheduling loop.

Two levels:
- the KV manager alone: its typed results name the exact blocks (allocations, prefix hits, frees), and a
  hypothesis state machine drives it (no model) the way the scheduler does: admit with prefix hits, compute,
  decode, preempt, finish, toggle prefix caching;
- random interleavings of add_request / step / abort on a real engine (tiny random model) with small
  pools, so that preemption, prefix-cache sharing and eviction all happen.
After every operation the block accounting must be exact; at the end every block is free, every
request finished exactly once, and greedy outputs equal those of an unconstrained reference run.
"""
from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from engine import EngineConfig, LLMEngine, SamplingParams
from engine.blocks import (
    NO_PREFIX,
    Allocation,
    CachedPrefix,
    ContiguousKVCache,
    Freed,
    KVCache,
    KVCacheManager,
    NoKVCache,
    PagedKVCache,
)
from engine.reconfigure import Reconfiguration
from engine.request import Request, RequestStatus
from tests.conftest import assert_all_blocks_free, build_tiny_model

MAX_MODEL_LEN = 512  # the tiny model's max_position_embeddings


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def chain_keys(token_ids: list[int], block_size: int) -> list[tuple]:
    """The prefix-cache keys of a token sequence's full blocks, computed independently of the engine."""
    keys: list[tuple] = []
    for i in range(len(token_ids) // block_size):
        keys.append((hash(keys[-1]) if keys else None, tuple(token_ids[i * block_size:(i + 1) * block_size])))
    return keys


def check_pool(kv: KVCacheManager, holders: list[Request], idle: list[Request] = (),
               sharing_needs_hash: bool = True) -> None:
    """Exact block accounting. holders: every request that may hold blocks; idle: requests that must hold none."""
    pool = kv.pool
    counts = Counter()
    for req in holders:
        table = kv.block_ids(req)
        assert len(set(table)) == len(table), f"{req} holds a block twice"
        counts.update(table)
    for req in idle:
        assert kv.block_ids(req) == [], f"{req} is not running but holds blocks"
    for block in pool.blocks:
        assert block.ref_count >= 0, f"block {block.block_id} has ref_count {block.ref_count}"
        assert block.ref_count == counts[block.block_id], (
            f"block {block.block_id}: ref_count {block.ref_count} but {counts[block.block_id]} tables hold it")
        in_queue = block.block_id in pool.free_queue
        assert (block.ref_count == 0) == in_queue, (
            f"block {block.block_id}: ref_count {block.ref_count}, {'' if in_queue else 'not '}in the free queue")
        if sharing_needs_hash and block.ref_count > 1:
            assert block.hash_key is not None, f"block {block.block_id} is shared but names no cached prefix"
        if block.hash_key is not None:
            assert pool.cached.get(block.hash_key) == block.block_id, f"block {block.block_id}'s hash is not cached"
    for key, block_id in pool.cached.items():
        assert pool.blocks[block_id].hash_key == key, f"pool.cached maps a key to block {block_id}, which lost it"
    assert len(pool.free_queue) == pool.num_free == sum(1 for b in pool.blocks if b.ref_count == 0)
    assert kv.num_used == sum(1 for b in pool.blocks if b.ref_count > 0)
    # Plain free blocks are reused before any cached-free block is evicted: plain ones sit at the front.
    flags = [pool.blocks[b].hash_key is not None for b in pool.free_queue]
    assert flags == sorted(flags), "a cached-free block sits in front of a plain free block"
    if not kv.prefix_caching:
        assert not pool.cached
    # A registered block's content is the holder's tokens at that position (a prefix hit reads the right K/V).
    for req in holders:
        keys = chain_keys(req.token_ids, kv.block_size)
        for i, block_id in enumerate(kv.block_ids(req)):
            key = pool.blocks[block_id].hash_key
            if key is not None:
                assert i < len(keys) and key == keys[i], f"{req}: block {block_id} at {i} caches other tokens"


# ---------------------------------------------------------------------------------------------------
# KVCacheManager alone
# ---------------------------------------------------------------------------------------------------

MACHINE_MAX_LEN = 20
TOKENS = st.lists(st.integers(3, 6), min_size=1, max_size=10)  # a tiny alphabet so prefixes repeat


class KVCacheMachine(RuleBasedStateMachine):
    """Requests move waiting -> scheduled (slots for all their tokens) -> computed -> scheduled ... -> freed."""

    def __init__(self) -> None:
        super().__init__()
        self.kv: KVCacheManager | None = None
        self.waiting: list[Request] = []
        self.running: list[Request] = []  # each has block slots for all its tokens
        self.done: list[Request] = []
        self.next_id = 0
        self.toggled_off = False

    @initialize(num_blocks=st.integers(4, 16), block_size=st.sampled_from([1, 2, 4]),
                prefix_caching=st.sampled_from([True, True, False]))
    def setup(self, num_blocks, block_size, prefix_caching):
        self.kv = PagedKVCache(num_blocks, block_size, prefix_caching=prefix_caching)

    def _state(self):
        pool = self.kv.pool
        return ([(b.ref_count, b.hash_key) for b in pool.blocks], list(pool.free_queue), dict(pool.cached),
                pool.num_evictions, {rid: (list(t.block_ids), t.num_registered) for rid, t in self.kv.tables.items()})

    @rule(tokens=TOKENS, copy_from=st.integers(0, 100), keep=st.integers(0, 16))
    def new_request(self, tokens, copy_from, keep):
        others = self.running + self.waiting + self.done
        if others and copy_from % 2 == 0:  # share a prefix with a live or finished request
            tokens = others[copy_from % len(others)].token_ids[:keep] + tokens
        req = Request(str(self.next_id), tokens[:MACHINE_MAX_LEN - 1], SamplingParams(max_tokens=8))
        self.next_id += 1
        self.waiting.append(req)

    @rule(index=st.integers(0, 100), tokens=TOKENS)
    def admit(self, index, tokens):
        if not self.waiting:  # rules stay productive whatever subset hypothesis enables (swarm testing)
            self.new_request(tokens, index, index % 16)
        kv, pool = self.kv, self.kv.pool
        req = self.waiting[index % len(self.waiting)]
        prefix = kv.find_cached_prefix(req)
        cached = prefix.block_ids
        assert prefix.num_tokens == len(cached) * kv.block_size
        keys = chain_keys(req.token_ids, kv.block_size)
        assert len(cached) <= (req.num_tokens - 1) // kv.block_size, "the last token must always be recomputed"
        for i, block_id in enumerate(cached):
            assert pool.blocks[block_id].hash_key == keys[i], "a prefix hit on a block holding other tokens"
        before = self._state()
        touched_free = [b for b in cached if pool.blocks[b].ref_count == 0]
        remaining = [b for b in pool.free_queue if b not in touched_free]
        plain_free = sum(1 for b in remaining if pool.blocks[b].hash_key is None)
        need = cdiv(req.num_tokens, kv.block_size) - len(cached)
        alloc = kv.allocate_slots(req, req.num_tokens - prefix.num_tokens, prefix)
        ok = alloc is not None
        assert ok == (need + len(touched_free) <= len(before[1])), "allocate_slots refused though the pool had room"
        event(f"admit ok={ok} hits={len(cached) > 0} evicted={ok and need > plain_free}")
        if not ok:
            assert self._state() == before, "a refused allocate_slots changed state"
            return
        assert kv.block_ids(req)[:len(cached)] == cached
        # new blocks come from the front of the free queue: plain ones first, then the oldest cached-free
        assert alloc.new_block_ids == kv.block_ids(req)[len(cached):] == remaining[:need]
        assert pool.num_evictions - before[3] == max(0, need - plain_free)
        req.num_computed_tokens = prefix.num_tokens
        req.status = RequestStatus.RUNNING
        self.waiting.remove(req)
        self.running.append(req)

    @rule(index=st.integers(0, 100), token=st.integers(3, 6))
    def compute_and_decode(self, index, token):
        """One engine step for this request: its K/V is written, a token is sampled, a slot is found for it."""
        if not self.running:
            if self.waiting:
                self.admit(index, [token])
            return
        kv = self.kv
        req = self.running[index % len(self.running)]
        req.num_computed_tokens = req.num_tokens
        kv.cache_full_blocks(req, req.num_computed_tokens)
        req.token_ids.append(token)
        if req.num_tokens >= MACHINE_MAX_LEN:
            self._finish(req)
            return
        before, held = self._state(), list(kv.block_ids(req))
        alloc = kv.allocate_slots(req, 1)
        if alloc is None:
            assert self._state() == before, "a refused allocate_slots changed state"
            assert kv.pool.num_free == 0 and req.num_tokens % kv.block_size == 1 % kv.block_size
            self._preempt(req)
        else:
            assert held + alloc.new_block_ids == kv.block_ids(req)

    def _free(self, req):
        held = list(self.kv.block_ids(req))
        assert self.kv.free(req) == Freed(held[::-1]), "free must return every block the request held, tail first"
        assert req.request_id not in self.kv.tables

    def _finish(self, req):
        self._free(req)
        self.running.remove(req)
        self.done.append(req)

    def _preempt(self, req):
        self._free(req)
        req.num_computed_tokens = 0
        self.running.remove(req)
        self.waiting.insert(0, req)

    @rule(index=st.integers(0, 100), finish=st.booleans())
    def release(self, index, finish):
        if not self.running:
            return
        req = self.running[index % len(self.running)]
        self._finish(req) if finish else self._preempt(req)

    @rule(switch=st.integers(0, 9))
    def set_prefix_caching(self, switch):
        if switch >= 2:  # mostly a no-op: switching off clears the cache, and hits are what we want to test
            return
        if switch == 0:
            self.toggled_off = True
        self.kv.set_prefix_caching(switch == 1)

    @invariant()
    def accounting(self):
        if self.kv is None:
            return
        check_pool(self.kv, self.running, self.waiting, sharing_needs_hash=not self.toggled_off)
        for req in self.running:
            assert len(self.kv.block_ids(req)) == cdiv(req.num_tokens, self.kv.block_size)
        assert set(self.kv.tables) <= {r.request_id for r in self.running + self.waiting}, "a table outlived its req"

    def teardown(self):
        if self.kv is None:
            return
        for req in list(self.running):
            self._finish(req)
        for req in self.waiting:  # a lookup may have left their hash keys: free forgets them too
            self._free(req)
        check_pool(self.kv, [], self.waiting, sharing_needs_hash=not self.toggled_off)
        assert self.kv.pool.num_free == self.kv.num_blocks and self.kv.tables == {}
        assert all(b.ref_count == 0 for b in self.kv.pool.blocks)


TestKVCacheMachine = KVCacheMachine.TestCase
TestKVCacheMachine.settings = settings(max_examples=40, stateful_step_count=100, deadline=None)


def test_release_below_zero_is_an_error():
    kv = PagedKVCache(4, 2, prefix_caching=True)
    with pytest.raises(RuntimeError, match="ref_count"):
        kv.pool.release(0)
    assert kv.pool.blocks[0].ref_count == 0 and kv.pool.num_free == 4


def request(rid: str, tokens: list[int]) -> Request:
    return Request(rid, tokens, SamplingParams(max_tokens=8))


def admit(kv: KVCache, req: Request):
    """What the scheduler does for a new request: look up its prefix, allocate the rest, register its full blocks."""
    prefix = kv.find_cached_prefix(req)
    alloc = kv.allocate_slots(req, req.num_tokens - prefix.num_tokens, prefix)
    if alloc is not None:
        kv.mark_computed(req, req.num_tokens)
        kv.cache_full_blocks(req, req.num_tokens)
    return prefix, alloc


def test_allocations_name_the_blocks_they_took_and_the_manager_holds_them():
    kv = PagedKVCache(8, 2, prefix_caching=False)
    a, b, c = request("a", [3] * 5), request("b", [4] * 5), request("c", [5] * 5)
    assert admit(kv, a) == (NO_PREFIX, Allocation([0, 1, 2])) and kv.block_ids(a) == [0, 1, 2]
    assert admit(kv, b)[1] == Allocation([3, 4, 5]) and kv.block_ids(b) == [3, 4, 5]
    assert admit(kv, c)[1] is None and kv.block_ids(c) == [] and kv.pool.num_free == 2  # short: nothing changed
    a.token_ids.append(6)  # a sixth token fits its last block; a seventh needs a new one
    assert kv.allocate_slots(a, 1) == Allocation([]) and kv.block_ids(a) == [0, 1, 2]
    a.token_ids.append(7)
    kv.mark_computed(a, 6)
    assert kv.allocate_slots(a, 1) == Allocation([6]) and kv.block_ids(a) == [0, 1, 2, 6]
    assert not any(hasattr(a, name) for name in ("block_table", "num_cached_blocks", "block_hash_keys"))


def test_a_prefix_hit_reuses_the_exact_blocks_that_hold_its_tokens():
    kv = PagedKVCache(16, 2, prefix_caching=True)
    first = request("first", [10, 11, 12, 13, 14, 15, 16])  # blocks: [10 11] [12 13] [14 15] [16]
    admit(kv, first)
    shared = kv.block_ids(first)[:3]
    second = request("second", [10, 11, 12, 13, 14, 15, 20, 21])
    prefix, alloc = admit(kv, second)
    assert prefix == CachedPrefix(shared, 6) and kv.block_ids(second)[:3] == shared
    assert alloc.new_block_ids == kv.block_ids(second)[3:] and not set(alloc.new_block_ids) & set(shared)
    assert [kv.pool.blocks[b].ref_count for b in shared] == [2, 2, 2]
    # the last token is always computed (its logits are needed): an equal prompt hits all but the block holding it
    assert kv.find_cached_prefix(request("same", [10, 11, 12, 13, 14, 15])) == CachedPrefix(shared[:2], 4)
    assert kv.find_cached_prefix(request("other", [99, 11, 12, 13])) == NO_PREFIX
    # freed, the blocks stay cached: a later request with the prefix gets the very same blocks back
    kv.free(first), kv.free(second)
    third = request("third", [10, 11, 12, 13, 14, 15, 30])
    assert admit(kv, third)[0] == CachedPrefix(shared, 6) and kv.block_ids(third)[:3] == shared


def test_free_returns_every_block_the_request_held_tail_first():
    kv = PagedKVCache(8, 2, prefix_caching=True)
    a, b = request("a", [3, 4, 5, 6, 7]), request("b", [3, 4, 5, 6, 8])
    admit(kv, a), admit(kv, b)
    held_a, held_b = list(kv.block_ids(a)), list(kv.block_ids(b))
    assert held_a[:2] == held_b[:2]  # shared
    assert kv.free(a) == Freed(held_a[::-1]) and kv.free(b) == Freed(held_b[::-1])
    assert kv.free(b) == Freed([])  # nothing left to free
    assert kv.tables == {} and kv.pool.num_free == 8 and kv.num_used == 0
    assert all(block.ref_count == 0 for block in kv.pool.blocks)


def test_contiguous_reserves_one_run_of_blocks_per_request():
    kv = ContiguousKVCache(8, 2, max_model_len=6)  # 3 blocks a request, whatever it uses
    a, b, c = request("a", [3]), request("b", [4] * 5), request("c", [5])
    assert admit(kv, a) == (NO_PREFIX, Allocation([0, 1, 2])) and admit(kv, b)[1] == Allocation([3, 4, 5])
    assert kv.allocate_slots(a, 1) == Allocation([])  # its reservation already holds every token it may have
    assert admit(kv, c)[1] is None  # 2 blocks left: no run of 3
    assert kv.free(a) == Freed([2, 1, 0]) and admit(kv, c)[1] == Allocation([0, 1, 2])


def test_no_kv_cache_is_an_implementation_of_the_interface_not_a_pool_without_one():
    assert isinstance(NoKVCache(4), KVCache) and not issubclass(NoKVCache, KVCacheManager)
    assert all(isinstance(kv, KVCache) for kv in (PagedKVCache(4, 2, True), ContiguousKVCache(4, 2, 4)))
    with pytest.raises(TypeError, match="abstract"):
        KVCache()
    kv, req = NoKVCache(4), request("a", [3, 4, 5])
    assert not hasattr(kv, "pool") and not hasattr(kv, "tables")
    assert admit(kv, req) == (NO_PREFIX, Allocation([])) and kv.block_ids(req) == []
    assert req.num_computed_tokens == 0  # nothing was kept: every step recomputes the whole sequence
    assert kv.free(req) == Freed([]) and kv.num_used == 0 and kv.block_states() == ([], [])
    assert kv.stats().kv_blocks_total == 0 and kv.prefix_cache_queries == kv.prefix_cache_hits == 0


# ---------------------------------------------------------------------------------------------------
# The engine: random add / step / abort interleavings on a tiny model
# ---------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(folder, our model, tokenizer, hf config) of a tiny random llama, loaded once for the module."""
    from engine import LLM
    folder = tmp_path_factory.mktemp("props-llama")
    build_tiny_model("llama", folder)
    llm = LLM(str(folder))
    return str(folder), llm.engine.model, llm.tokenizer, llm.engine.hf_config


_reference: dict[tuple[int, ...], list[int]] = {}
REF_TOKENS = 12


def reference_outputs(tiny, prompts: list[list[int]]) -> dict[tuple[int, ...], list[int]]:
    """Greedy outputs of each prompt with a pool too big to preempt and no prefix caching (memoized)."""
    missing = list({tuple(p) for p in prompts} - set(_reference))
    if missing:
        folder, model, tokenizer, hf_config = tiny
        cfg = EngineConfig.from_kwargs(model=folder, dtype="float32", block_size=16, num_kv_blocks=512,
                                       prefix_caching=False)
        eng = LLMEngine(cfg, model, tokenizer, hf_config)
        params = SamplingParams(temperature=0, max_tokens=REF_TOKENS, ignore_eos=True)
        ids = {eng.add_request(list(p), params): p for p in missing}
        while eng.has_unfinished():
            for out in eng.step():
                if out.finished:
                    _reference[ids[out.request_id]] = out.token_ids
    return _reference


def check_engine(eng: LLMEngine, after_step: bool, sharing_needs_hash: bool = True, seats: int = 0) -> None:
    """seats: how many requests may run beyond max_num_seqs (lowering it in place does not evict the running)."""
    s, kv = eng.scheduler, eng.kv
    check_pool(kv, s.running, s.waiting, sharing_needs_hash)
    assert len(s.running) <= max(eng.config.max_num_seqs, seats)
    assert not set(map(id, s.running)) & set(map(id, s.waiting))
    for req in s.running:
        assert req.status is RequestStatus.RUNNING
        if after_step:  # a running request holds exactly the blocks its computed tokens need
            if req.is_prefilling:  # a chunked prefill under way
                assert 0 < req.num_computed_tokens < req.num_tokens and eng.config.chunked_prefill_active
            else:
                assert req.num_computed_tokens == req.num_tokens - 1
            paged = isinstance(kv, PagedKVCache)
            need = cdiv(req.num_computed_tokens, kv.block_size) if paged else kv.blocks_per_reservation
            assert len(kv.block_ids(req)) == need
    for req in s.waiting:
        assert req.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED) and req.num_computed_tokens == 0
    assert set(kv.tables) <= {r.request_id for r in s.running + list(s.waiting)}, "a table outlived its request"
    snap = eng.snapshot()
    assert snap.block_tables == {r.request_id: kv.block_ids(r) for r in s.running}  # the picture reads the manager
    assert snap.kv_blocks_used == kv.num_used == sum(1 for rc in snap.block_ref_counts if rc > 0)
    assert snap.kv_blocks_total == kv.num_blocks == len(snap.block_ref_counts)
    assert snap.kv_blocks_cached_free == sum(1 for b in kv.pool.free_queue if kv.pool.blocks[b].hash_key is not None)
    owners = {}
    for rid, table in snap.block_tables.items():
        for b in table:
            owners.setdefault(b, []).append(rid)
    assert all(len(owners.get(b, [])) == rc for b, rc in enumerate(snap.block_ref_counts))


engine_configs = st.fixed_dictionaries({
    "block_size": st.sampled_from([2, 4, 8]),
    "num_kv_blocks": st.one_of(st.integers(8, 16), st.integers(8, 40)),  # skewed small: preemption happens
    "max_num_seqs": st.one_of(st.integers(3, 6), st.integers(1, 6)),
    "prefix_caching": st.sampled_from([True, True, False]),
    "paged_kv": st.sampled_from([True, True, True, False]),
    "max_num_batched_tokens": st.sampled_from([None, None, 5, 8, 16, 40]),  # small budgets: prompts are chunked
    "speculative_decoding": st.booleans(),  # suffixes draw from a small alphabet: n-grams repeat, drafts happen
    "num_speculative_tokens": st.integers(1, 5),
    "prompt_lookup_min": st.just(1),
})
CONTIGUOUS_MAX_LEN = 40  # without paging each request reserves max_model_len up front: keep it small


@pytest.mark.slow
@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(cfg=engine_configs, data=st.data())
def test_engine_random_interleavings_keep_blocks_and_requests_exact(tiny, cfg, data):
    folder, model, tokenizer, hf_config = tiny
    if not cfg["paged_kv"]:
        cfg = {**cfg, "max_model_len": CONTIGUOUS_MAX_LEN,
               "num_kv_blocks": max(cfg["num_kv_blocks"], CONTIGUOUS_MAX_LEN // cfg["block_size"])}
    eng = LLMEngine(EngineConfig.from_kwargs(model=folder, dtype="float32", **cfg), model, tokenizer, hf_config)
    reconfig = Reconfiguration.of(eng)  # its owner: changes wait for the step boundary, where they are handed in
    bs, num_blocks, max_len = cfg["block_size"], cfg["num_kv_blocks"], eng.config.max_model_len
    base = data.draw(st.lists(st.integers(3, 49151), min_size=24, max_size=24), label="shared prefix")

    added: dict[str, tuple[list[int], int]] = {}  # id -> (prompt, max_tokens)
    aborted: set[str] = set()
    finished: Counter[str] = Counter()
    streamed: dict[str, list[int]] = {}
    final: dict[str, object] = {}

    def consume(outputs):
        seen = set()
        for out in outputs:
            rid = out.request_id
            assert rid in added and rid not in seen, f"output for {rid} unknown or twice in one step"
            seen.add(rid)
            assert finished[rid] == 0, f"output for {rid} after it finished"
            prev = streamed.get(rid, [])
            if out.finish_reason == "abort":
                assert out.token_ids == prev, "an abort changed the tokens already streamed"
            else:
                grew = len(out.token_ids) - len(prev)  # one token, or more when drafts were accepted
                assert out.token_ids[:len(prev)] == prev and 1 <= grew <= 1 + eng.config.num_speculative_tokens
            streamed[rid] = list(out.token_ids)
            assert out.finished == (out.finish_reason is not None)
            if out.finished:
                finished[rid] += 1
                final[rid] = out

    chunked_steps: list[bool] = []

    def step() -> None:
        reconfig.apply(eng)
        outputs = eng.step()
        chunked_steps.append(any(e.num_new_tokens == 0 for e in eng.steps[-1].entries))  # a prompt chunk
        consume(outputs)

    sharing_needs_hash = True
    seats = 0  # after max_num_seqs is lowered, the requests already running may finish above it

    def check(after_step: bool) -> None:
        nonlocal seats
        check_engine(eng, after_step, sharing_needs_hash, seats)
        seats = min(seats, len(eng.scheduler.running))
    n_ops = data.draw(st.integers(4, 30), label="ops")
    for _ in range(n_ops):
        op = data.draw(st.sampled_from(["add", "step", "step", "add", "step", "abort", "add", "step", "reconfig"]),
                       label="op")
        if op == "add":
            for _ in range(data.draw(st.integers(1, 4), label="burst")):
                if len(added) >= 14:
                    break
                # whole shared prefix, a block-aligned part of it, or any part: the prefix cache gets hits
                keep = data.draw(st.one_of(st.just(len(base)), st.sampled_from([2 * bs, 0]), st.integers(0, len(base))),
                                 label="prefix len")
                suffix = data.draw(st.lists(st.integers(3, 40), min_size=0 if keep else 1, max_size=3 * bs),
                                   label="suffix")
                prompt = base[:keep] + suffix
                max_tokens = data.draw(st.integers(1, REF_TOKENS), label="max_tokens")
                params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
                if len(prompt) >= max_len:
                    with pytest.raises(ValueError, match="max_model_len"):
                        eng.add_request(prompt, params)
                    continue
                if cfg["paged_kv"] and cdiv(len(prompt) + max_tokens, bs) > num_blocks:
                    with pytest.raises(ValueError, match="KV blocks"):
                        eng.add_request(prompt, params)
                    continue
                rid = eng.add_request(prompt, params)
                assert rid not in added
                added[rid] = (prompt, max_tokens)
        elif op == "step":
            step()
            check(after_step=True)
            continue
        elif op == "reconfig":
            changes = data.draw(st.one_of(
                st.fixed_dictionaries({"prefix_caching": st.booleans()}),
                st.fixed_dictionaries({"max_num_seqs": st.integers(1, 6)}),
                st.fixed_dictionaries({"num_kv_blocks": st.integers(4, 24)}),
                st.fixed_dictionaries({"block_size": st.sampled_from([2, 4, 8]), "num_kv_blocks": st.integers(4, 24)}),
                st.fixed_dictionaries({"chunked_prefill": st.booleans(),
                                       "max_num_batched_tokens": st.sampled_from([None, 6, 16])}),
            ), label="changes")
            before, kv_before = eng.config.to_dict(), eng.kv
            try:
                reconfig.update(changes, eng)
            except ValueError as exc:  # a live request, or a contiguous reservation, would not fit: nothing changes
                assert ("KV blocks" in str(exc) or "contiguous KV reserves" in str(exc)
                        or "chunked prefill is off" in str(exc))
                assert eng.config.to_dict() == before
                continue
            if changes.get("prefix_caching") is False and eng.kv.prefix_caching:
                sharing_needs_hash = False  # blocks shared now stay shared, but their hashes are forgotten
            seats = len(eng.scheduler.running)
            step()  # applied at this step boundary; nothing may be added in between
            assert all(eng.config.to_dict()[k] == v for k, v in changes.items() if v is not None)  # None: resolved
            bs, num_blocks = eng.config.block_size, eng.config.num_kv_blocks
            if eng.kv is not kv_before:
                sharing_needs_hash = True  # a new pool
            check(after_step=True)
            continue
        elif op == "abort" and added:
            rid = data.draw(st.sampled_from(sorted(added)), label="abort id")
            was_live = rid not in final and rid not in aborted
            assert eng.abort(rid) == was_live
            if was_live:
                aborted.add(rid)
        check(after_step=False)

    assert eng.abort("no-such-request") is False
    steps = 0
    while eng.has_unfinished():
        step()
        check(after_step=True)
        steps += 1
        assert steps < 10_000, "the engine does not drain"
    assert eng.step() == [], "an idle step produced output"

    event(f"preempted: {eng.scheduler.num_preemptions > 0}")
    event(f"prefix hits: {eng.kv.prefix_cache_hits > 0}")
    event(f"evictions: {eng.kv.pool.num_evictions > 0}")
    event(f"aborted: {len(aborted) > 0}")
    event(f"reconfigured: {eng.last_reconfig is not None}")
    event(f"paged: {cfg['paged_kv']}")
    event(f"chunked: {any(chunked_steps)}")
    event(f"drafts accepted: {eng.spec_stats.num_accepted_tokens > 0}")
    assert_all_blocks_free(eng)
    check_pool(eng.kv, [], [])
    assert eng.requests == {} and not eng.scheduler.running and not eng.scheduler.waiting
    assert set(finished) == set(added) and all(c == 1 for c in finished.values()), "a request lost or finished twice"
    ref = reference_outputs(tiny, [p for p, _ in added.values()])
    for rid, (prompt, max_tokens) in added.items():
        out = final[rid]
        expected = ref[tuple(prompt)][:min(max_tokens, max_len - len(prompt))]
        if rid in aborted:
            assert out.finish_reason == "abort"
            assert out.token_ids == expected[:len(out.token_ids)]
        else:
            assert out.finish_reason == "length" and out.token_ids == expected, f"request {rid} output is wrong"
            assert out.prompt_token_ids == prompt


def test_engine_properties_exercise_preemption_and_prefix_hits(tiny):
    """The random test above is only as good as what it reaches: this fixed case must preempt and hit the cache."""
    folder, model, tokenizer, hf_config = tiny
    cfg = EngineConfig.from_kwargs(model=folder, dtype="float32", block_size=2, num_kv_blocks=16, max_num_seqs=4)
    eng = LLMEngine(cfg, model, tokenizer, hf_config)
    prefix = list(range(100, 110))
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    rid0 = eng.add_request(prefix + [7], params)
    eng.step()
    ids = [rid0] + [eng.add_request(prefix + [8 + i], params) for i in range(3)]
    counts = Counter()
    while eng.has_unfinished():
        for out in eng.step():
            counts[out.request_id] += out.finished
        check_engine(eng, after_step=True)
    assert eng.scheduler.num_preemptions > 0
    assert eng.kv.prefix_cache_hits > 0
    assert counts == Counter({rid: 1 for rid in ids})
    assert_all_blocks_free(eng)


def test_prefix_cache_after_a_block_size_change_reads_the_right_tokens(tiny):
    """Regression: hash keys memoized under the old block size named blocks holding other tokens after a rebuild."""
    folder, model, tokenizer, hf_config = tiny
    shared = [500, 501, 502, 503, 504, 505]
    prompts = [shared + [600 + i for i in range(8)], shared + [700 + i for i in range(8)]]
    ref = reference_outputs(tiny, prompts)
    cfg = EngineConfig.from_kwargs(model=folder, dtype="float32", block_size=2, num_kv_blocks=64)
    eng = LLMEngine(cfg, model, tokenizer, hf_config)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    ids = [eng.add_request(p, params) for p in prompts]
    eng.step()
    reconfig = Reconfiguration.of(eng)
    reconfig.update({"block_size": 4}, eng)  # both are re-prefilled into a new pool; the second may share the first's
    finals = {}
    while eng.has_unfinished():
        reconfig.apply(eng)
        finals.update({o.request_id: o for o in eng.step() if o.finished})
        check_engine(eng, after_step=True)
    for rid, prompt in zip(ids, prompts, strict=True):
        assert finals[rid].token_ids == ref[tuple(prompt)][:6]
    assert_all_blocks_free(eng)
