"""The KV manager: which blocks each request holds, in a pool with reference counts, prefix-cache hash chains and an
LRU of cached-free blocks. Requests hold none of this: the scheduler, the runner and the snapshot ask the manager.

A full block is named by a hash chained over (parent block's hash, the block's tokens), so equal hashes
mean equal prefixes. Free blocks sit in one ordered queue: plain free blocks at the front (used first),
cached-free blocks at the back in least-recently-freed order, so eviction takes the oldest cached block.
"""
from __future__ import annotations

import itertools
from abc import ABC, abstractmethod
from collections import OrderedDict
from dataclasses import dataclass, field

from .request import Request
from .utils import cdiv


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    # set once the block is full and registered; the cached blocks are keyed by it, not by its hash, so a hash
    # collision cannot alias two prefixes
    hash_key: tuple | None = None


class BlockPool:
    def __init__(self, num_blocks: int) -> None:
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_queue: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.cached: dict[tuple, int] = {}  # hash key -> block id
        self.num_evictions = 0

    @property
    def num_free(self) -> int:
        return len(self.free_queue)

    def allocate(self) -> int:
        block_id, _ = self.free_queue.popitem(last=False)
        block = self.blocks[block_id]
        if block.hash_key is not None:  # evicting a cached-free block: it no longer names a prefix
            del self.cached[block.hash_key]
            block.hash_key = None
            self.num_evictions += 1
        block.ref_count = 1
        return block_id

    def allocate_contiguous(self, n: int) -> list[int] | None:
        """First fit of n consecutive free block ids (the contiguous layout needs one run)."""
        run = 0
        for block_id in range(len(self.blocks)):
            run = run + 1 if block_id in self.free_queue else 0
            if run == n:
                ids = list(range(block_id - n + 1, block_id + 1))
                for i in ids:
                    self.touch(i)
                return ids
        return None

    def touch(self, block_id: int) -> None:
        """Take a reference; a free (possibly cached) block leaves the free queue and keeps its hash."""
        block = self.blocks[block_id]
        if block.ref_count == 0:
            del self.free_queue[block_id]
        block.ref_count += 1

    def release(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.ref_count <= 0:
            raise RuntimeError(f"block {block_id} released with ref_count {block.ref_count}")
        block.ref_count -= 1
        if block.ref_count == 0:
            self.free_queue[block_id] = None
            if block.hash_key is None:  # plain free blocks are reused before any cached one is evicted
                self.free_queue.move_to_end(block_id, last=False)

    def register(self, block_id: int, key: tuple) -> None:
        if key in self.cached:  # another request computed the same block first; keep that one
            return
        self.blocks[block_id].hash_key = key
        self.cached[key] = block_id

    def clear_cache(self) -> None:
        """Forget every prefix hash (prefix caching switched off); blocks in use are untouched."""
        for block_id in self.cached.values():
            block = self.blocks[block_id]
            block.hash_key = None
            if block.ref_count == 0:
                self.free_queue.move_to_end(block_id, last=False)
        self.cached.clear()


@dataclass
class KVCacheStats:
    """The pool's counters, named as the snapshot shows them."""
    kv_blocks_total: int
    kv_blocks_used: int  # held by at least one request
    kv_blocks_cached_free: int  # held by none, but still naming a cached prefix
    prefix_cache_queries: int  # prompt tokens looked up (first admission only)
    prefix_cache_hits: int  # of those, tokens served from the cache
    prefix_cache_evictions: int


@dataclass(frozen=True)
class CachedPrefix:
    """Cached blocks that continue a request's block table, and the tokens they hold."""
    block_ids: list[int] = field(default_factory=list)
    num_tokens: int = 0


NO_PREFIX = CachedPrefix()


@dataclass(frozen=True)
class Allocation:
    """Blocks a request took from the pool (after any cached prefix, which it now shares)."""
    new_block_ids: list[int]


@dataclass(frozen=True)
class Freed:
    """Blocks a request let go, in release order (the tail first)."""
    block_ids: list[int]


class KVCache(ABC):
    """What the scheduler and the engine ask of a KV layout. The defaults are a layout with no pool and no prefix
    cache (the empty hooks are deliberately no-ops: only the paged layout shares blocks)."""

    block_size: int
    num_blocks = num_used = 0
    prefix_caching = False
    prefix_cache_queries = prefix_cache_hits = 0  # as KVCacheStats says

    @abstractmethod
    def block_ids(self, request: Request) -> list[int]:
        """The request's block table: the manager's own list, to read and never to change."""

    @abstractmethod
    def allocate_slots(self, request: Request, num_new_tokens: int,
                       cached: CachedPrefix = NO_PREFIX) -> Allocation | None:
        """Room for num_new_tokens more tokens after the cached prefix; None (nothing changed) if the pool is short."""

    @abstractmethod
    def free(self, request: Request) -> Freed:
        """Let go of the request's blocks and of all the manager knows of it."""

    def mark_computed(self, request: Request, num_tokens: int) -> None:
        """The first num_tokens tokens' K/V now sit in the request's blocks."""
        request.num_computed_tokens = num_tokens

    def stats(self) -> KVCacheStats:
        return KVCacheStats(self.num_blocks, self.num_used, 0, self.prefix_cache_queries, self.prefix_cache_hits, 0)

    def block_states(self) -> tuple[list[int], list[int | None]]:
        """(ref count, prefix hash or None) of every physical block, for the block-table picture."""
        return [], []

    def find_cached_prefix(self, request: Request) -> CachedPrefix:
        return NO_PREFIX

    def cache_full_blocks(self, request: Request, num_tokens: int) -> None:
        """Name the blocks that are full once the first num_tokens tokens' K/V are written. Called as soon as a
        request's place in the step is final, before the forward pass: a request admitted later in the same step can
        already share them, because every layer writes the whole step's K/V before any attention reads it."""

    def count_prefix_hits(self, num_queried: int, num_hit: int) -> None:
        """num_queried: the prompt at a request's first admission (0 for a chunk found cached mid-prefill)."""
        if self.prefix_caching:
            self.prefix_cache_queries += num_queried
            self.prefix_cache_hits += num_hit

    def set_prefix_caching(self, on: bool) -> None:
        """Switched in place (a reconfiguration that keeps the pool)."""

    def adopt_counters(self, old: KVCache) -> None:
        """Carry the prefix-cache counters over when the pool is rebuilt (they describe the engine's life)."""


@dataclass
class RequestBlocks:
    """One request's blocks in a pool, and the prefix-cache names of its full ones."""
    block_ids: list[int] = field(default_factory=list)
    hash_keys: list[tuple] = field(default_factory=list)  # chained keys of its full blocks, extended lazily
    num_registered: int = 0  # leading blocks already registered in the prefix cache


class KVCacheManager(KVCache):
    """What every layout with a pool shares: the pool, each request's blocks in it, and the pool's counters."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.pool = BlockPool(num_blocks)
        self.num_blocks, self.block_size = num_blocks, block_size
        self.tables: dict[str, RequestBlocks] = {}  # request id -> its blocks

    @property
    def num_used(self) -> int:
        return self.num_blocks - self.pool.num_free

    def stats(self) -> KVCacheStats:
        pool = self.pool
        cached_free = sum(1 for b in pool.cached.values() if pool.blocks[b].ref_count == 0)
        return KVCacheStats(self.num_blocks, self.num_used, cached_free, self.prefix_cache_queries,
                            self.prefix_cache_hits, pool.num_evictions)

    def block_states(self) -> tuple[list[int], list[int | None]]:
        blocks = self.pool.blocks
        return [b.ref_count for b in blocks], [None if b.hash_key is None else hash(b.hash_key) for b in blocks]

    def adopt_counters(self, old: KVCache) -> None:
        self.prefix_cache_queries, self.prefix_cache_hits = old.prefix_cache_queries, old.prefix_cache_hits

    def block_ids(self, request: Request) -> list[int]:
        table = self.tables.get(request.request_id)
        return [] if table is None else table.block_ids

    def _table(self, request: Request) -> RequestBlocks:
        return self.tables.setdefault(request.request_id, RequestBlocks())

    def free(self, request: Request) -> Freed:
        # Release the tail first: it is the least likely to be shared, so it is evicted first.
        freed = self.tables.pop(request.request_id, RequestBlocks()).block_ids[::-1]
        for block_id in freed:
            self.pool.release(block_id)
        return Freed(freed)


class ContiguousKVCache(KVCacheManager):
    """Before paging: each request reserves max_model_len's worth of consecutive blocks at admission, whatever it
    will use (the memory a paged cache saves), and nothing is shared."""

    def __init__(self, num_blocks: int, block_size: int, max_model_len: int) -> None:
        super().__init__(num_blocks, block_size)
        self.blocks_per_reservation = cdiv(max_model_len, block_size)

    def allocate_slots(self, request: Request, num_new_tokens: int,
                       cached: CachedPrefix = NO_PREFIX) -> Allocation | None:
        if self.block_ids(request):
            return Allocation([])
        ids = self.pool.allocate_contiguous(self.blocks_per_reservation)
        if ids is None:
            return None
        self._table(request).block_ids = ids
        return Allocation(list(ids))


class PagedKVCache(KVCacheManager):
    """Blocks on demand, anywhere in the pool; with prefix caching, full blocks named by their hash chain and shared
    by every request whose prompt starts the same way."""

    def __init__(self, num_blocks: int, block_size: int, prefix_caching: bool) -> None:
        super().__init__(num_blocks, block_size)
        self.prefix_caching = prefix_caching

    def mark_computed(self, request: Request, num_tokens: int) -> None:
        """Blocks past the first num_tokens held only the slots of rejected draft tokens (never registered in the
        prefix cache): they go back to the pool."""
        request.num_computed_tokens = num_tokens
        blocks = self.block_ids(request)
        while len(blocks) > cdiv(num_tokens, self.block_size):
            self.pool.release(blocks.pop())

    def set_prefix_caching(self, on: bool) -> None:
        self.prefix_caching = on
        if not on:
            self.pool.clear_cache()

    def _hash_keys(self, request: Request) -> list[tuple]:
        bs, keys = self.block_size, self._table(request).hash_keys
        while (len(keys) + 1) * bs <= request.num_tokens:
            i = len(keys)
            keys.append((hash(keys[-1]) if keys else None, tuple(request.token_ids[i * bs:(i + 1) * bs])))
        return keys

    def find_cached_prefix(self, request: Request) -> CachedPrefix:
        """Cached blocks that continue the request's block table: from its first block at admission, or, in the
        middle of a chunked prefill, from its next block (chunks another request computed meanwhile are skipped).
        The last token is always recomputed (its logits are needed)."""
        first = len(self.block_ids(request))
        if request.prompt_logprobs is not None:  # every prompt position needs its logits: computed, not cached
            return NO_PREFIX
        if not self.prefix_caching or request.num_computed_tokens != first * self.block_size:
            return NO_PREFIX  # off, or the request's last block is partly written: it must be continued, not replaced
        keys = self._hash_keys(request)[first:(request.num_tokens - 1) // self.block_size]
        hits = list(itertools.takewhile(lambda block_id: block_id is not None, map(self.pool.cached.get, keys)))
        return CachedPrefix(hits, len(hits) * self.block_size)

    def allocate_slots(self, request: Request, num_new_tokens: int,
                       cached: CachedPrefix = NO_PREFIX) -> Allocation | None:
        held = len(self.block_ids(request))
        total = request.num_computed_tokens + cached.num_tokens + num_new_tokens
        num_needed = cdiv(total, self.block_size) - held - len(cached.block_ids)
        # cached blocks that sit in the free queue leave it when touched: they count against the free pool
        num_cached_free = sum(1 for b in cached.block_ids if self.pool.blocks[b].ref_count == 0)
        if num_needed + num_cached_free > self.pool.num_free:
            return None
        table = self._table(request)
        for block_id in cached.block_ids:
            self.pool.touch(block_id)
        if cached.block_ids:  # every block before them is registered too (full blocks register as they are computed)
            table.block_ids.extend(cached.block_ids)
            table.num_registered = len(table.block_ids)
        new = [self.pool.allocate() for _ in range(num_needed)]
        table.block_ids.extend(new)
        return Allocation(new)

    def cache_full_blocks(self, request: Request, num_tokens: int) -> None:
        if not self.prefix_caching:
            return
        table, num_full = self.tables[request.request_id], num_tokens // self.block_size
        if num_full <= table.num_registered:
            return
        keys = self._hash_keys(request)
        for i in range(table.num_registered, min(num_full, len(keys))):
            self.pool.register(table.block_ids[i], keys[i])
        table.num_registered = num_full


class NoKVCache(KVCache):
    """The naive loop's: nothing is kept, so every step recomputes each sequence from its first token."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size

    def block_ids(self, request: Request) -> list[int]:
        return []

    def allocate_slots(self, request: Request, num_new_tokens: int,
                       cached: CachedPrefix = NO_PREFIX) -> Allocation | None:
        return Allocation([])

    def free(self, request: Request) -> Freed:
        return Freed([])

    def mark_computed(self, request: Request, num_tokens: int) -> None:
        request.num_computed_tokens = 0  # nothing was kept
