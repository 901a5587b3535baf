"""The pool of KV cache blocks: reference counts, the prefix-cache map and LRU eviction.

A block is in exactly one of three states:
  - in use: ref_cnt > 0 (shared blocks have ref_cnt > 1);
  - free and cached: ref_cnt == 0, still holds a valid prefix (block_hash set), may be
    revived by a prefix hit until it is evicted;
  - free and empty: ref_cnt == 0, block_hash None.
Free blocks wait in one LRU queue; allocation takes from its head, so the least recently
freed cached block is evicted first. Requests free their blocks tail-first, so a prefix's
last blocks go before its first ones. The blocks one allocation takes are returned in
ascending id order: a request's blocks, freed tail-first, come back as ascending runs of
consecutive ids, and the KV transports copy a run at a time. `on_evict` sees each evicted
block (id and hash) while it still holds its KV: the offload tiers copy it out there
(engine/kv_offload.py).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import NewType

from vllm_cluster.engine.block_hash import BlockHash

BlockId = NewType("BlockId", int)


@dataclass(slots=True)
class Block:
    block_id: BlockId
    ref_cnt: int = 0
    block_hash: BlockHash | None = None


class BlockPool:
    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        assert num_blocks > 0
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [Block(BlockId(i)) for i in range(num_blocks)]
        # Insertion order is LRU order: the head is evicted first.
        self._free: OrderedDict[BlockId, None] = OrderedDict((b.block_id, None) for b in self.blocks)
        self._cached: dict[BlockHash, BlockId] = {}
        self.on_stored: Callable[[list[BlockHash]], None] | None = None
        self.on_removed: Callable[[list[BlockHash]], None] | None = None
        self.on_evict: Callable[[list[BlockId], list[BlockHash]], None] | None = None

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def usage(self) -> float:
        return 1.0 - len(self._free) / self.num_blocks

    def get_cached(self, block_hash: BlockHash) -> BlockId | None:
        return self._cached.get(block_hash)

    def cached_hashes(self) -> list[BlockHash]:
        """Every hash in the prefix cache now (a full resync of an external index)."""
        return list(self._cached)

    def allocate(self, num_blocks: int) -> list[BlockId]:
        """Take `num_blocks` free blocks (evicting cached ones, LRU first), in ascending id order;
        ref_cnt becomes 1."""
        if num_blocks > len(self._free):
            raise ValueError(f"cannot allocate {num_blocks} blocks, {len(self._free)} free")
        block_ids = []
        evicted: list[BlockHash] = []
        evicted_ids: list[BlockId] = []
        for _ in range(num_blocks):
            block_id, _ = self._free.popitem(last=False)
            block = self.blocks[block_id]
            assert block.ref_cnt == 0
            if block.block_hash is not None:
                evicted.append(block.block_hash)
                evicted_ids.append(block_id)
                del self._cached[block.block_hash]
                block.block_hash = None
            block.ref_cnt = 1
            block_ids.append(block_id)
        if evicted and self.on_evict is not None:
            self.on_evict(evicted_ids, evicted)
        if evicted and self.on_removed is not None:
            self.on_removed(evicted)
        block_ids.sort()
        return block_ids

    def touch(self, block_ids: Iterable[BlockId]) -> None:
        """Take one more reference on each block (a prefix hit); revives free cached blocks."""
        for block_id in block_ids:
            block = self.blocks[block_id]
            if block.ref_cnt == 0:
                del self._free[block_id]
            block.ref_cnt += 1

    def free(self, block_ids: Iterable[BlockId]) -> None:
        """Drop one reference on each block, in the order given (the first freed is evicted first)."""
        for block_id in block_ids:
            block = self.blocks[block_id]
            assert block.ref_cnt > 0, f"block {block_id} freed twice"
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self._free[block_id] = None

    def cache_blocks(self, block_ids: list[BlockId], block_hashes: list[BlockHash]) -> None:
        """Register full blocks under their hashes so later requests can share them."""
        if not self.enable_caching:
            return
        stored = []
        for block_id, block_hash in zip(block_ids, block_hashes, strict=True):
            block = self.blocks[block_id]
            if block.block_hash is not None:
                assert block.block_hash == block_hash
                continue
            if block_hash in self._cached:
                # Same content computed twice (two requests prefilled together): keep the first.
                continue
            block.block_hash = block_hash
            self._cached[block_hash] = block_id
            stored.append(block_hash)
        if stored and self.on_stored is not None:
            self.on_stored(stored)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix; only possible when no block is in use."""
        if len(self._free) != self.num_blocks:
            return False
        removed = list(self._cached)
        self._cached.clear()
        for block in self.blocks:
            block.block_hash = None
        if removed and self.on_removed is not None:
            self.on_removed(removed)
        return True
