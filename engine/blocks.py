"""The KV block pool: reference counts, block tables, prefix-cache hash chains and an LRU of cached-free blocks.

A full block is named by a hash chained over (parent block's hash, the block's tokens), so equal hashes
mean equal prefixes. Free blocks sit in one ordered queue: plain free blocks at the front (used first),
cached-free blocks at the back in least-recently-freed order, so eviction takes the oldest cached block.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from .request import Request
from .utils import cdiv


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    # (parent block's hash, this block's tokens), set once the block is full and registered in the
    # prefix cache. The dict of cached blocks is keyed by it, so a hash collision cannot alias two prefixes.
    hash_key: tuple | None = None

    @property
    def block_hash(self) -> int | None:
        return None if self.hash_key is None else hash(self.hash_key)


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
        run_start, run_len = None, 0
        for block in self.blocks:
            if block.block_id in self.free_queue:
                if run_len == 0:
                    run_start = block.block_id
                run_len += 1
                if run_len == n:
                    ids = list(range(run_start, run_start + n))
                    for i in ids:
                        self.touch(i)
                    return ids
            else:
                run_len = 0
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

    def lookup(self, key: tuple) -> int | None:
        return self.cached.get(key)

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
    """The pool's counters, read by the snapshot and the benchmarks alike (names as the snapshot shows them)."""
    kv_blocks_total: int
    kv_blocks_used: int  # held by at least one request
    kv_blocks_cached_free: int  # held by none, but still naming a cached prefix
    prefix_cache_queries: int  # prompt tokens looked up (first admission only)
    prefix_cache_hits: int  # of those, tokens served from the cache
    prefix_cache_evictions: int


class KVCacheManager:
    """Gives requests block tables from one pool, and keeps its counters: what every layout with a pool shares.
    The layouts are its subclasses (PagedKVCache, ContiguousKVCache); NoKVCache has the same interface and no
    pool. The scheduler asks them for room and never touches the pool itself."""

    keeps_kv = True
    paged = False
    prefix_caching = False

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.pool = BlockPool(num_blocks)
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.prefix_cache_queries = 0  # prompt tokens looked up (first admission only)
        self.prefix_cache_hits = 0  # of those, tokens served from cache

    @property
    def num_used(self) -> int:
        return self.num_blocks - self.pool.num_free

    def stats(self) -> KVCacheStats:
        pool = self.pool
        cached_free = sum(1 for b in pool.cached.values() if pool.blocks[b].ref_count == 0)
        return KVCacheStats(self.num_blocks, self.num_used, cached_free, self.prefix_cache_queries,
                            self.prefix_cache_hits, pool.num_evictions)

    def block_states(self) -> tuple[list[int], list[int | None]]:
        """(ref count, prefix hash or None) of every physical block, for the block-table picture."""
        blocks = self.pool.blocks
        return [b.ref_count for b in blocks], [b.block_hash for b in blocks]

    def adopt_counters(self, old: KVCacheManager | NoKVCache) -> None:
        """Carry the prefix-cache counters over when the pool is rebuilt (they describe the engine's life)."""
        self.prefix_cache_queries, self.prefix_cache_hits = old.prefix_cache_queries, old.prefix_cache_hits

    def mark_computed(self, request: Request, num_tokens: int) -> None:
        """The first num_tokens tokens' K/V now sit in the request's blocks."""
        request.num_computed_tokens = num_tokens

    def set_prefix_caching(self, on: bool) -> None:
        """Prefix caching needs shared blocks: only the paged layout has them."""

    def find_cached_prefix(self, request: Request) -> list[int]:
        return []

    def count_query(self, request: Request, num_hit_tokens: int) -> None:
        pass

    def count_skipped_chunk(self, num_hit_tokens: int) -> None:
        pass

    def cache_full_blocks(self, request: Request, num_tokens: int) -> None:
        pass

    def allocate_slots(self, request: Request, num_new_tokens: int, cached_blocks: list[int] = ()) -> bool:
        """Make room for num_new_tokens more tokens. False (and nothing changed) if the pool is short."""
        raise NotImplementedError

    def free(self, request: Request) -> None:
        # Release the tail first: it is the least likely to be shared, so it is evicted first.
        for block_id in reversed(request.block_table):
            self.pool.release(block_id)
        request.block_table = []
        request.num_cached_blocks = 0


class ContiguousKVCache(KVCacheManager):
    """Before paging: each request reserves max_model_len's worth of consecutive blocks at admission, whatever it
    will use (the memory a paged cache saves), and nothing is shared."""

    def __init__(self, num_blocks: int, block_size: int, max_model_len: int) -> None:
        super().__init__(num_blocks, block_size)
        self.blocks_per_reservation = cdiv(max_model_len, block_size)

    def allocate_slots(self, request: Request, num_new_tokens: int, cached_blocks: list[int] = ()) -> bool:
        if request.block_table:
            return True
        ids = self.pool.allocate_contiguous(self.blocks_per_reservation)
        if ids is None:
            return False
        request.block_table = ids
        return True


class PagedKVCache(KVCacheManager):
    """Blocks on demand, anywhere in the pool; with prefix caching, full blocks named by their hash chain and shared
    by every request whose prompt starts the same way."""

    paged = True

    def __init__(self, num_blocks: int, block_size: int, prefix_caching: bool) -> None:
        super().__init__(num_blocks, block_size)
        self.prefix_caching = prefix_caching

    def mark_computed(self, request: Request, num_tokens: int) -> None:
        """Blocks past the first num_tokens held only the slots of rejected draft tokens (never registered in the
        prefix cache): they go back to the pool."""
        request.num_computed_tokens = num_tokens
        keep = cdiv(num_tokens, self.block_size)
        while len(request.block_table) > keep:
            self.pool.release(request.block_table.pop())

    def set_prefix_caching(self, on: bool) -> None:
        self.prefix_caching = on
        if not on:
            self.pool.clear_cache()

    def _hash_keys(self, request: Request) -> list[tuple]:
        """Chained hash keys of the request's full blocks, extended as its tokens grow."""
        bs, keys = self.block_size, request.block_hash_keys
        if keys and len(keys[0][1]) != bs:  # made for another block size (the pool was rebuilt): start over
            keys.clear()
        while (len(keys) + 1) * bs <= request.num_tokens:
            i = len(keys)
            keys.append((hash(keys[-1]) if keys else None, tuple(request.token_ids[i * bs:(i + 1) * bs])))
        return keys

    def find_cached_prefix(self, request: Request) -> list[int]:
        """Cached blocks that continue the request's block table: from its first block at admission, or, in the
        middle of a chunked prefill, from its next block (chunks another request computed meanwhile are skipped).
        The last token is always recomputed (its logits are needed)."""
        first = len(request.block_table)
        if request.prompt_logprobs is not None:  # every prompt position needs its logits: computed, not cached
            return []
        if not self.prefix_caching or request.num_computed_tokens != first * self.block_size:
            return []  # off, or the request's last block is partly written: it must be continued, not replaced
        keys = self._hash_keys(request)
        max_blocks = (request.num_tokens - 1) // self.block_size
        hits = []
        for key in keys[first:max_blocks]:
            block_id = self.pool.lookup(key)
            if block_id is None:
                break
            hits.append(block_id)
        return hits

    def count_query(self, request: Request, num_hit_tokens: int) -> None:
        """Called on a request's first admission only: recomputation after a preemption is not a query."""
        if self.prefix_caching:
            self.prefix_cache_queries += request.num_prompt_tokens
            self.prefix_cache_hits += num_hit_tokens

    def count_skipped_chunk(self, num_hit_tokens: int) -> None:
        """Prompt tokens of a request's first prefill, already queried at admission, found cached mid-prefill."""
        self.prefix_cache_hits += num_hit_tokens

    def allocate_slots(self, request: Request, num_new_tokens: int, cached_blocks: list[int] = ()) -> bool:
        """Make room for num_new_tokens more tokens. False (and nothing changed) if the pool is short."""
        total = request.num_computed_tokens + len(cached_blocks) * self.block_size + num_new_tokens
        num_needed = cdiv(total, self.block_size) - len(request.block_table) - len(cached_blocks)
        # cached blocks that sit in the free queue leave it when touched: they count against the free pool
        num_cached_free = sum(1 for b in cached_blocks if self.pool.blocks[b].ref_count == 0)
        if num_needed + num_cached_free > self.pool.num_free:
            return False
        for block_id in cached_blocks:
            self.pool.touch(block_id)
        if cached_blocks:  # every block before them is registered too (full blocks register as they are computed)
            request.block_table.extend(cached_blocks)
            request.num_cached_blocks = len(request.block_table)
        for _ in range(max(num_needed, 0)):
            request.block_table.append(self.pool.allocate())
        return True

    def cache_full_blocks(self, request: Request, num_tokens: int) -> None:
        """Register the blocks that are full once the first num_tokens tokens' K/V are written.

        The scheduler calls this as soon as a request's place in the step is final, before the forward
        pass: a request admitted later in the same step can already share these blocks, because every
        layer writes the whole step's K/V into the cache before any attention reads it.
        """
        if not self.prefix_caching:
            return
        num_full = num_tokens // self.block_size
        if num_full <= request.num_cached_blocks:
            return
        keys = self._hash_keys(request)
        for i in range(request.num_cached_blocks, min(num_full, len(keys))):
            self.pool.register(request.block_table[i], keys[i])
        request.num_cached_blocks = num_full


class NoKVCache(KVCacheManager):
    """The naive loop's cache: the KV manager's interface, keeping nothing (no pool at all).

    Every step recomputes each sequence from its first token, because no K/V survives a step: a request's
    num_computed_tokens stays 0, allocation always succeeds, and there is nothing to share or free.
    """

    keeps_kv = False
    num_blocks = 0
    num_used = 0

    def __init__(self, block_size: int) -> None:  # no pool
        self.block_size = block_size
        self.prefix_cache_queries = self.prefix_cache_hits = 0

    def stats(self) -> KVCacheStats:
        return KVCacheStats(0, 0, 0, 0, 0, 0)

    def block_states(self) -> tuple[list[int], list[int | None]]:
        return [], []

    def adopt_counters(self, old) -> None:
        pass  # nothing is looked up, so nothing to count

    def allocate_slots(self, request: Request, num_new_tokens: int, cached_blocks: list[int] = ()) -> bool:
        return True

    def mark_computed(self, request: Request, num_tokens: int) -> None:
        request.num_computed_tokens = 0  # nothing was kept

    def free(self, request: Request) -> None:
        request.block_table = []


def kv_cache_for(kv_cache: bool, paged: bool, prefix_caching: bool, num_blocks: int, block_size: int,
                 max_model_len: int) -> KVCacheManager | NoKVCache:
    """The manager for a configuration's KV layout: none (the naive loop), contiguous, or paged."""
    if not kv_cache:
        return NoKVCache(block_size)
    if not paged:
        return ContiguousKVCache(num_blocks, block_size, max_model_len)
    return PagedKVCache(num_blocks, block_size, prefix_caching)
