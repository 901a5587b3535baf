"""Maps requests to KV cache blocks: prefix-cache lookup, allocation, caching, freeing.

Protocol per request: `get_computed_blocks` once (when first scheduled), then
`allocate_slots` every step it is scheduled, then `free` when it finishes or is preempted.

Sliding window (`sliding_window` set: every layer attends within that many tokens, and the
engine's role lets blocks go early): a query at position p reads only keys after p - W, so
once a request's next token to compute is at position C, its blocks wholly before C - W + 1
are released (to the free list, still cached if they were) and a new request never takes
the cached-prefix blocks its first chunk cannot see. Such a block's id stays in the request's
table, stale: attention masks those positions and never reads them through the table. A
released block is never cached under the request's hashes afterwards, and prefix hits stay
contiguous from the first block (`get_computed_blocks`), so a hit never spans a block that
was released and reused.

Offload tiers (`attach_offload`, engine/kv_offload.py): the device cache's evictions go to a
host (and disk) tier; a lookup whose device prefix stops short continues there, loads those
blocks into fresh device blocks and caches them, so from then on they are ordinary device
hits. Prefix statistics count the blocks found in each tier apart from the device's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from vllm_cluster.engine.block_hash import BlockHash
from vllm_cluster.engine.block_pool import BlockId, BlockPool
from vllm_cluster.engine.request import Request, RequestId

if TYPE_CHECKING:
    from vllm_cluster.engine.kv_offload import KVOffload, Tier


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(slots=True)
class PrefixCacheStats:
    num_queries: int = 0  # prompt tokens looked up
    num_hits: int = 0  # of which found in the device cache
    num_host_hits: int = 0  # of which loaded from the host tier
    num_disk_hits: int = 0  # of which loaded from the disk tier


class KVCacheManager:
    def __init__(
        self, num_blocks: int, block_size: int, enable_caching: bool = True, sliding_window: int | None = None
    ) -> None:
        assert sliding_window is None or sliding_window >= 1
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.sliding_window = sliding_window
        self.pool = BlockPool(num_blocks, enable_caching)
        self.block_tables: dict[RequestId, list[BlockId]] = {}
        self._num_cached_blocks: dict[RequestId, int] = {}
        self._num_released_blocks: dict[RequestId, int] = {}  # leading table entries not held
        self.prefix_stats = PrefixCacheStats()
        self.offload: KVOffload | None = None
        # Per request not yet admitted: the hashes its lookups loaded from a tier, and which tier.
        self._tier_hits: dict[RequestId, dict[BlockHash, str]] = {}

    def attach_offload(self, offload: KVOffload) -> None:
        """Spill evicted blocks to `offload`'s tiers, and look prefixes up there too."""
        assert self.enable_caching, "offload tiers hold prefix-cache blocks"
        self.offload = offload
        self.pool.on_evict = offload.on_evict

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix, in every tier; only possible when no block is in use."""
        if not self.pool.reset_prefix_cache():
            return False
        if self.offload is not None:
            self.offload.clear()
        return True

    def num_blocks_outside_window(self, first_position: int) -> int:
        """Leading blocks no query at `first_position` or later can read (0 without a window)."""
        if self.sliding_window is None:
            return 0
        return max(0, first_position - self.sliding_window + 1) // self.block_size

    def num_held_blocks(self, request_id: RequestId) -> int:
        """Blocks the request holds a reference on (its table less the released entries)."""
        return len(self.block_tables.get(request_id, ())) - self._num_released_blocks.get(request_id, 0)

    @property
    def usage(self) -> float:
        return self.pool.usage

    def get_computed_blocks(self, request: Request) -> tuple[list[BlockId], int]:
        """The longest cached prefix of `request`, as (block ids, number of tokens).

        At least one token is always left to compute: its logits give the next token.
        """
        if not self.enable_caching:
            return [], 0
        max_blocks = (request.num_tokens - 1) // self.block_size
        block_ids: list[BlockId] = []
        for block_hash in request.block_hashes[:max_blocks]:
            block_id = self.pool.get_cached(block_hash)
            if block_id is None:
                break
            block_ids.append(block_id)
        if self.offload is not None and len(block_ids) < max_blocks:
            block_ids += self._load_from_tiers(request, block_ids, max_blocks)
        return block_ids, len(block_ids) * self.block_size

    def _load_from_tiers(self, request: Request, prefix: list[BlockId], max_blocks: int) -> list[BlockId]:
        """Continue the device prefix `prefix` from the offload tiers: load those blocks into
        free device blocks and cache them there. Returns the loaded blocks (free and cached,
        like any device hit). Never evicts `prefix` itself; uses only free blocks, one left over."""
        assert self.offload is not None
        block_hashes = request.block_hashes[len(prefix) : max_blocks]
        num_free = self.pool.num_free_blocks - sum(1 for b in prefix if self.pool.blocks[b].ref_cnt == 0)
        # Leave a block for the tokens after the hit (at least one is computed): loading into
        # every free block would only make a request that cannot start yet, and the blocks be
        # evicted again before it does.
        if num_free - 1 <= 0 or not self.offload.find(block_hashes[:1]):
            return []
        self.pool.touch(prefix)  # off the free list while blocks are taken from it
        loaded, tiers = self.load_from_tiers(block_hashes, num_free - 1)
        # Freed in the order to evict them: the loaded suffix, then the prefix.
        self.pool.free(reversed(loaded))
        self.pool.free(reversed(prefix))
        hits = self._tier_hits.setdefault(request.request_id, {})
        for block_hash, tier in zip(block_hashes, tiers, strict=False):
            hits[block_hash] = tier.value
        return loaded

    def load_from_tiers(self, block_hashes: list[BlockHash], max_num_blocks: int) -> tuple[list[BlockId], list[Tier]]:
        """Load the leading `block_hashes` held in the offload tiers, at most `max_num_blocks`
        (<= the free blocks), into free device blocks and cache them there. Returns the loaded
        blocks, each holding one reference the caller frees, and the tier each came from. The
        run stops at the first hash in no tier or that fails to load (a corrupt disk file)."""
        assert self.offload is not None
        num_blocks = min(len(self.offload.find(block_hashes)), max_num_blocks)
        if num_blocks <= 0:
            return [], []
        new_ids = self.pool.allocate(num_blocks)  # may evict: into the tiers, before the load
        try:
            tiers = self.offload.load(block_hashes[:num_blocks], [int(b) for b in new_ids])
        except BaseException:
            self.pool.free(new_ids)
            raise
        num_loaded = len(tiers)
        self.pool.cache_blocks(new_ids[:num_loaded], block_hashes[:num_loaded])
        self.pool.free(new_ids[num_loaded:])  # the unused ones: evicted first
        return new_ids[:num_loaded], tiers

    def record_prefix_lookup(self, num_tokens: int, num_hits: int, request: Request | None = None) -> None:
        """Count one admitted request's lookup (not every attempt that found no room);
        `num_hits` includes what it loaded from the offload tiers, counted apart."""
        loaded = self._tier_hits.pop(request.request_id, {}) if request is not None else {}
        host = disk = 0
        if request is not None and loaded:
            tiers = [loaded.get(h) for h in request.block_hashes[: num_hits // self.block_size]]
            host, disk = tiers.count("host") * self.block_size, tiers.count("disk") * self.block_size
        self.prefix_stats.num_queries += num_tokens
        self.prefix_stats.num_hits += num_hits - host - disk
        self.prefix_stats.num_host_hits += host
        self.prefix_stats.num_disk_hits += disk

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        new_computed_blocks: list[BlockId] | None = None,
        cache: bool = True,
    ) -> bool:
        """Make room for `num_new_tokens` more tokens; False (and no change) if blocks run out.

        `cache=False` leaves the new full blocks out of the prefix cache for now: a decode
        reservation's blocks hold nothing until the prefill's KV lands in them."""
        table = self.block_tables.get(request.request_id)
        if table:
            self._release_outside_window(request, table)
        if table and not new_computed_blocks:  # a running request: often no new block at all
            num_tokens = request.num_computed_tokens + num_new_tokens
            if num_tokens <= len(table) * self.block_size:
                if cache:
                    self._cache_full_blocks(request, num_tokens)
                return True
        new_computed_blocks = new_computed_blocks or []
        table = self.block_tables.setdefault(request.request_id, [])
        num_computed = request.num_computed_tokens + len(new_computed_blocks) * self.block_size
        num_required = cdiv(num_computed + num_new_tokens, self.block_size)
        num_new_blocks = num_required - len(table) - len(new_computed_blocks)
        # A new request leaves the cached blocks before its first chunk's window untaken.
        num_skipped = 0
        if not table:
            num_skipped = min(self.num_blocks_outside_window(num_computed), len(new_computed_blocks))
        taken = new_computed_blocks[num_skipped:]
        # Cached blocks on the free list stop being free once this request takes them.
        num_revived = sum(1 for b in taken if self.pool.blocks[b].ref_cnt == 0)
        if num_new_blocks > self.pool.num_free_blocks - num_revived:
            if not table:
                del self.block_tables[request.request_id]
            return False
        self.pool.touch(taken)
        if num_skipped:
            self._num_released_blocks[request.request_id] = num_skipped
        table.extend(new_computed_blocks)
        if num_new_blocks > 0:
            table.extend(self.pool.allocate(num_new_blocks))
        if cache:
            self._cache_full_blocks(request, num_computed + num_new_tokens)
        return True

    def _cache_full_blocks(self, request: Request, num_tokens: int) -> None:
        if not self.enable_caching:
            return
        # A released block may hold another request's tokens by now: never cache it here.
        request_id = request.request_id
        start = max(self._num_cached_blocks.get(request_id, 0), self._num_released_blocks.get(request_id, 0))
        end = min(num_tokens // self.block_size, len(request.block_hashes))
        if end <= start:
            return
        table = self.block_tables[request.request_id]
        self.pool.cache_blocks(table[start:end], request.block_hashes[start:end])
        self._num_cached_blocks[request.request_id] = end

    def _release_outside_window(self, request: Request, table: list[BlockId]) -> None:
        """Drop the blocks that no query from the request's next token on can read. (Async
        scheduling counts the step in flight as computed: that step may still read a block
        dropped here, but a new owner writes it only in a later step, which runs after it.)"""
        start = self._num_released_blocks.get(request.request_id, 0)
        end = min(self.num_blocks_outside_window(request.num_computed_tokens), len(table))
        if end > start:
            self.pool.free(reversed(table[start:end]))
            self._num_released_blocks[request.request_id] = end

    def free(self, request: Request) -> None:
        """Release the request's blocks, tail first, so its prefix outlives its suffix."""
        table = self.block_tables.pop(request.request_id, [])
        self._tier_hits.pop(request.request_id, None)
        self._num_cached_blocks.pop(request.request_id, None)
        num_released = self._num_released_blocks.pop(request.request_id, 0)
        self.pool.free(reversed(table[num_released:]))

    def get_block_table(self, request_id: RequestId) -> list[BlockId]:
        return self.block_tables[request_id]
