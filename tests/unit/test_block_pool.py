"""BlockPool: exact block ids, reference counts, LRU eviction and the prefix-cache map."""

from __future__ import annotations

import pytest

from vllm_cluster.engine.block_hash import BlockHash, hash_block_tokens
from vllm_cluster.engine.block_pool import BlockId, BlockPool
from vllm_cluster.engine.kv_cache_manager import KVCacheManager
from vllm_cluster.engine.request import Request, RequestId
from vllm_cluster.engine.sampling_params import SamplingParams


def _hashes(n: int) -> list[BlockHash]:
    return hash_block_tokens([0] * n, block_size=1)


def _ids(*ids: int) -> list[BlockId]:
    return [BlockId(i) for i in ids]


def _ref_cnts(pool: BlockPool) -> list[int]:
    return [b.ref_cnt for b in pool.blocks]


def _recording_pool(num_blocks: int) -> tuple[BlockPool, list[list[BlockHash]], list[list[BlockHash]]]:
    pool = BlockPool(num_blocks)
    stored: list[list[BlockHash]] = []
    removed: list[list[BlockHash]] = []
    pool.on_stored = stored.append
    pool.on_removed = removed.append
    return pool, stored, removed


def test_fresh_pool_allocates_ids_in_order() -> None:
    pool = BlockPool(8)
    assert pool.num_free_blocks == 8
    assert pool.allocate(3) == [0, 1, 2]
    assert pool.allocate(2) == [3, 4]
    assert pool.num_free_blocks == 3
    assert _ref_cnts(pool) == [1, 1, 1, 1, 1, 0, 0, 0]
    assert pool.usage == pytest.approx(5 / 8)


def test_allocating_more_than_free_raises_and_changes_nothing() -> None:
    pool = BlockPool(4)
    pool.allocate(3)
    with pytest.raises(ValueError, match="cannot allocate 2 blocks, 1 free"):
        pool.allocate(2)
    assert pool.num_free_blocks == 1
    assert pool.allocate(1) == [3]


def test_touch_and_free_count_references() -> None:
    pool = BlockPool(4)
    pool.allocate(2)
    pool.touch(_ids(0, 1))
    pool.touch(_ids(0))
    assert _ref_cnts(pool) == [3, 2, 0, 0]
    pool.free(_ids(0, 1))
    assert _ref_cnts(pool) == [2, 1, 0, 0]
    assert pool.num_free_blocks == 2
    pool.free(_ids(1))
    assert _ref_cnts(pool) == [2, 0, 0, 0]
    assert pool.num_free_blocks == 3


def test_freeing_a_free_block_is_an_error() -> None:
    pool = BlockPool(2)
    pool.allocate(1)
    pool.free(_ids(0))
    with pytest.raises(AssertionError, match="block 0 freed twice"):
        pool.free(_ids(0))


def test_blocks_freed_first_are_allocated_first() -> None:
    pool = BlockPool(4)
    pool.allocate(4)
    pool.free(_ids(2, 0))
    pool.free(_ids(3, 1))
    assert pool.allocate(2) == [0, 2]
    assert pool.allocate(1) == [3]


def test_free_blocks_queue_behind_never_used_ones() -> None:
    pool = BlockPool(4)
    pool.allocate(2)
    pool.free(_ids(1, 0))
    assert pool.allocate(2) == [2, 3]
    assert pool.allocate(1) == [1]


def test_a_request_freed_tail_first_comes_back_as_one_ascending_run() -> None:
    pool = BlockPool(8)
    table = pool.allocate(5)
    pool.free(reversed(table))
    assert pool.allocate(5) == [3, 4, 5, 6, 7] and pool.allocate(3) == [0, 1, 2]


def test_request_blocks_are_freed_tail_first() -> None:
    kv = KVCacheManager(num_blocks=4, block_size=4)
    request = Request(RequestId("r"), list(range(12)), SamplingParams(max_tokens=4), None, 4)
    request.update_block_hashes(4)
    assert kv.allocate_slots(request, 12)
    assert kv.get_block_table(request.request_id) == [0, 1, 2]
    kv.free(request)
    # Block 3 was never used; then the request's tail (2) goes before its head (0).
    assert [kv.pool.allocate(1)[0] for _ in range(4)] == [3, 2, 1, 0]


def test_touch_revives_a_cached_free_block() -> None:
    pool = BlockPool(4)
    h = _hashes(2)
    pool.allocate(2)
    pool.cache_blocks(_ids(0, 1), h)
    pool.free(_ids(1, 0))
    assert pool.num_free_blocks == 4
    assert pool.get_cached(h[0]) == 0
    pool.touch(_ids(0))
    assert pool.num_free_blocks == 3
    assert _ref_cnts(pool) == [1, 0, 0, 0]
    # Block 0 left the free queue: allocation skips it.
    assert [pool.allocate(1)[0] for _ in range(3)] == [2, 3, 1]
    assert pool.get_cached(h[0]) == 0
    assert pool.blocks[0].block_hash == h[0]


def test_eviction_removes_the_hash_from_the_cache() -> None:
    pool, _, removed = _recording_pool(2)
    h = _hashes(2)
    pool.allocate(2)
    pool.cache_blocks(_ids(0, 1), h)
    pool.free(_ids(1, 0))
    assert pool.allocate(1) == [1]
    assert pool.get_cached(h[1]) is None
    assert pool.blocks[1].block_hash is None
    assert pool.get_cached(h[0]) == 0
    assert removed == [[h[1]]]


def test_on_stored_receives_the_newly_cached_hashes() -> None:
    pool, stored, removed = _recording_pool(4)
    h = _hashes(3)
    pool.allocate(3)
    pool.cache_blocks(_ids(0, 1), h[:2])
    # Block 0 already holds h[0]: only h[2] is new.
    pool.cache_blocks(_ids(0, 2), [h[0], h[2]])
    assert stored == [[h[0], h[1]], [h[2]]]
    assert removed == []


def test_same_content_in_two_blocks_keeps_the_first() -> None:
    pool, stored, _ = _recording_pool(4)
    h = _hashes(1)
    pool.allocate(2)
    pool.cache_blocks(_ids(0), h)
    pool.cache_blocks(_ids(1), h)
    assert pool.get_cached(h[0]) == 0
    assert pool.blocks[1].block_hash is None
    assert stored == [[h[0]]]


def test_on_removed_receives_all_evicted_hashes_of_one_allocation() -> None:
    pool, _, removed = _recording_pool(3)
    h = _hashes(3)
    pool.allocate(3)
    pool.cache_blocks(_ids(0, 1, 2), h)
    pool.free(_ids(2, 1, 0))
    assert pool.allocate(2) == [1, 2]  # the LRU two, in id order
    assert removed == [[h[2], h[1]]]  # in eviction order, in one call


def test_caching_disabled_stores_nothing() -> None:
    pool = BlockPool(2, enable_caching=False)
    stored: list[list[BlockHash]] = []
    pool.on_stored = stored.append
    h = _hashes(1)
    pool.allocate(1)
    pool.cache_blocks(_ids(0), h)
    assert pool.get_cached(h[0]) is None
    assert pool.blocks[0].block_hash is None
    assert stored == []


def test_reset_prefix_cache_refuses_while_blocks_are_in_use() -> None:
    pool, _, removed = _recording_pool(2)
    h = _hashes(2)
    pool.allocate(2)
    pool.cache_blocks(_ids(0, 1), h)
    pool.free(_ids(1))
    assert pool.reset_prefix_cache() is False
    assert pool.get_cached(h[0]) == 0
    assert pool.get_cached(h[1]) == 1
    assert removed == []


def test_reset_prefix_cache_forgets_every_prefix() -> None:
    pool, _, removed = _recording_pool(3)
    h = _hashes(2)
    pool.allocate(2)
    pool.cache_blocks(_ids(0, 1), h)
    pool.free(_ids(1, 0))
    assert pool.reset_prefix_cache() is True
    assert pool.get_cached(h[0]) is None
    assert pool.get_cached(h[1]) is None
    assert [b.block_hash for b in pool.blocks] == [None, None, None]
    assert removed == [h]
    # Nothing left to evict: a later allocation reports no removals.
    pool.allocate(3)
    assert removed == [h]
