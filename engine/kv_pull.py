"""Cross-instance KV reuse: a prompt's prefix pulled from the instance that holds it.

Lifecycle of one pull (router/pull.py drives it, worker/kv_pull.py serves both ends; the
functions here are the engine's part and run on its thread, through `EngineLoop.call`):
  1. The router reserves on the target instance T as for any request (T's receiver expects
     every block after those T already holds, `num_cached_tokens`).
  2. The prefix index says another instance H holds more of the prompt's leading blocks
     (in its device cache, host tier or disk tier), and `router.pull.plan_pull` finds
     moving them cheaper than computing them (their bytes over the link, plus a load for a
     block in a tier, against their tokens at the recompute rate).
  3. The router calls `PushCached` on H with those blocks' hashes and T's reservation. H
     `pin_prefix`es them: a reference on each leading block in its device cache, and for
     each one held only in its host or disk tier, a free device block the tier's load path
     fills and caches (the run ends at a block in no tier, one that fails to load, or when
     the free blocks run out: what was pinned is pushed, maybe nothing). H's KV sender
     pushes every layer of them into T's reserved blocks; H `unpin`s them once the sends
     finished (or failed) and answers how many landed.
  4. The router calls `Decode` on T with `num_pulled_blocks` and no first token. T waits
     until every layer of those blocks landed (`KVReceiver.wait_blocks`), stops its
     receiver, and `cache_pulled` registers them in its prefix cache under the prompt's
     hashes. The request then computes its prompt as when prefill is skipped: its prefix
     lookup finds the pulled blocks, so only the rest is computed.
  5. Any failure (blocks evicted, a transfer error or timeout, H down or too slow) leaves
     fewer pulled blocks, or none: T computes the rest. Nothing else changes for the
     request, and its blocks are freed exactly as without a pull.
Invariants: H's pinned blocks are full cached blocks, never written while pinned, and
unpinned exactly once (a block loaded for the pull stays in H's device cache after, like a
prefix hit's); T caches a pulled block only after all its layers landed and its
receiver stopped, so nothing lands in a block after it joined the cache.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from vllm_cluster.engine.block_hash import BlockHash
from vllm_cluster.engine.block_pool import BlockId, BlockPool
from vllm_cluster.engine.kv_cache_manager import KVCacheManager
from vllm_cluster.engine.kv_offload import Tier
from vllm_cluster.engine.request import Request, RequestId

if TYPE_CHECKING:
    from vllm_cluster.engine.engine_core import EngineCore


@dataclass(slots=True)
class PinnedPrefix:
    """The holder's blocks for one pull: the leading asked blocks, each holding one reference
    this pull drops with `unpin`."""

    block_ids: list[int] = field(default_factory=list)
    num_host_blocks: int = 0  # of which loaded from the host tier for this pull
    num_disk_blocks: int = 0  # of which loaded from the disk tier
    ready: torch.cuda.Event | None = None  # on CUDA: the loads are done when it is


def pin_prefix(kv: KVCacheManager, block_hashes: Sequence[bytes]) -> PinnedPrefix:
    """Holder: the device blocks of the leading `block_hashes`, each with one more reference
    so no allocation reuses it until `unpin`. A block held only in an offload tier is loaded
    into a free device block first (at most the free blocks less one), and joins the cache."""
    pool = kv.pool
    hashes = [BlockHash(h) for h in block_hashes]
    held: list[BlockId | None] = []  # per leading hash: its device block, or None: in a tier
    for block_hash in hashes:
        block_id = pool.get_cached(block_hash)
        if block_id is None and (kv.offload is None or not kv.offload.find([block_hash])):
            break
        held.append(block_id)
    device_ids = [b for b in held if b is not None]
    pool.touch(device_ids)  # first: the loads' allocation must not evict them
    to_load = [h for h, b in zip(hashes, held, strict=False) if b is None]
    loaded: list[BlockId] = []
    tiers: list[Tier] = []
    if to_load:
        loaded, tiers = kv.load_from_tiers(to_load, pool.num_free_blocks - 1)
    # The run ends at the first tier block that did not load: every loaded one comes before it.
    block_ids: list[BlockId] = []
    next_loaded = iter(loaded)
    for block_id in held:
        block_id = block_id if block_id is not None else next(next_loaded, None)
        if block_id is None:
            break
        block_ids.append(block_id)
    past_run = [b for b in held[len(block_ids) :] if b is not None]
    pool.free(reversed(past_run))
    ready = None
    if loaded and kv.offload is not None and kv.offload.device.type == "cuda":
        ready = torch.cuda.Event()
        ready.record()  # the sender reads these blocks from another thread and stream
    return PinnedPrefix([int(b) for b in block_ids], tiers.count(Tier.HOST), tiers.count(Tier.DISK), ready)


def unpin(pool: BlockPool, block_ids: Sequence[int]) -> None:
    """Holder: drop `pin_prefix`'s references, last block first (it is evicted first)."""
    pool.free(BlockId(b) for b in reversed(block_ids))


def transferring_request(core: EngineCore, request_id: str) -> Request | None:
    """Target: the reserved request whose KV is still to land; None if the reservation is gone."""
    return core.scheduler.transferring.get(RequestId(request_id))


def reserved_blocks(kv: KVCacheManager, request: Request) -> tuple[list[int], int]:
    """Target: the reservation's block ids and how many leading ones were cached at Reserve."""
    return [int(b) for b in kv.get_block_table(request.request_id)], request.num_cached_tokens // kv.block_size


def cache_pulled(kv: KVCacheManager, request: Request, num_pulled_blocks: int) -> None:
    """Target: the reserved request's `num_pulled_blocks` blocks after its cached ones hold
    pulled KV; register them in the prefix cache under the prompt's hashes."""
    start = request.num_cached_tokens // kv.block_size
    end = start + num_pulled_blocks
    assert end <= len(request.block_hashes), "a pull fills whole prompt blocks only"
    table = kv.get_block_table(request.request_id)
    kv.pool.cache_blocks(table[start:end], request.block_hashes[start:end])
