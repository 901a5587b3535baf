"""Cross-instance KV reuse: a prompt's prefix pulled from the instance that holds it.

Lifecycle of one pull (router/pull.py drives it, worker/kv_pull.py serves both ends; the
functions here are the engine's part and run on its thread, through `EngineLoop.call`):
  1. The router reserves on the target instance T as for any request (T's receiver expects
     every block after those T already holds, `num_cached_tokens`).
  2. The prefix index says another instance H holds more of the prompt's leading blocks,
     and `router.pull.plan_pull` finds moving them cheaper than computing them (their
     bytes over the link against their tokens at the recompute rate).
  3. The router calls `PushCached` on H with those blocks' hashes and T's reservation. H
     `pin_cached_prefix`es them: a reference on each leading block still in its device
     cache (a block evicted meanwhile ends the run: what is still there is pushed, maybe
     nothing). H's KV sender pushes every layer of them into T's reserved blocks; H
     `unpin`s them once the sends finished (or failed) and answers how many landed.
  4. The router calls `Decode` on T with `num_pulled_blocks` and no first token. T waits
     until every layer of those blocks landed (`KVReceiver.wait_blocks`), stops its
     receiver, and `cache_pulled` registers them in its prefix cache under the prompt's
     hashes. The request then computes its prompt as when prefill is skipped: its prefix
     lookup finds the pulled blocks, so only the rest is computed.
  5. Any failure (blocks evicted, a transfer error or timeout, H down or too slow) leaves
     fewer pulled blocks, or none: T computes the rest. Nothing else changes for the
     request, and its blocks are freed exactly as without a pull.
Invariants: H's pinned blocks are full cached blocks, never written while pinned, and
unpinned exactly once; T caches a pulled block only after all its layers landed and its
receiver stopped, so nothing lands in a block after it joined the cache.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from vllm_cluster.engine.block_hash import BlockHash
from vllm_cluster.engine.block_pool import BlockId, BlockPool
from vllm_cluster.engine.kv_cache_manager import KVCacheManager
from vllm_cluster.engine.request import Request, RequestId

if TYPE_CHECKING:
    from vllm_cluster.engine.engine_core import EngineCore


def pin_cached_prefix(pool: BlockPool, block_hashes: Sequence[bytes]) -> list[int]:
    """Holder: the device blocks of the leading `block_hashes` still cached here, each with
    one more reference so no allocation reuses it until `unpin`."""
    block_ids: list[BlockId] = []
    for block_hash in block_hashes:
        block_id = pool.get_cached(BlockHash(block_hash))
        if block_id is None:
            break
        block_ids.append(block_id)
    pool.touch(block_ids)
    return [int(b) for b in block_ids]


def unpin(pool: BlockPool, block_ids: Sequence[int]) -> None:
    """Holder: drop `pin_cached_prefix`'s references, last block first (it is evicted first)."""
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
