"""KVCacheManager with a sliding window: blocks behind every layer's window are released as a
request moves on, a new request takes no cached block before its window, and prefix hits
stay contiguous from the first block. Exact block ids; window 8, blocks of 4."""

from __future__ import annotations

from torch import nn

from tests.unit.test_kv_cache_manager import BLOCK_SIZE, _prefill, _request
from vllm_cluster.engine.kv_cache_manager import KVCacheManager
from vllm_cluster.engine.layers.attention import Attention, sliding_window_of_every_layer
from vllm_cluster.engine.request import Request, RequestId

WINDOW = 8


def _decode(kv: KVCacheManager, request: Request, num_steps: int) -> None:
    """`num_steps` decode steps as the scheduler makes them: allocate, compute, sample."""
    for step in range(num_steps):
        assert kv.allocate_slots(request, 1)
        request.num_computed_tokens += 1
        request.append_output_token(500 + step, None)
        request.update_block_hashes(BLOCK_SIZE)


def test_blocks_behind_the_window_are_released_as_decoding_moves_on() -> None:
    kv = KVCacheManager(num_blocks=10, block_size=BLOCK_SIZE, sliding_window=WINDOW)
    a = _request("a", list(range(12)))
    _prefill(kv, a)
    assert kv.get_block_table(a.request_id) == [0, 1, 2]
    _decode(kv, a, 1)  # position 12 reads 5..12: block 0 (0..3) goes
    assert kv.num_held_blocks(a.request_id) == 3 and kv.pool.num_free_blocks == 7
    assert kv.get_block_table(a.request_id) == [0, 1, 2, 3]  # entry 0 stale, held no more
    assert kv.pool.blocks[0].ref_cnt == 0 and kv.pool.blocks[0].block_hash is not None  # still cached
    _decode(kv, a, 4)  # position 16 reads 9..16: blocks 0 and 1 gone
    assert kv.num_held_blocks(a.request_id) == 3 and kv.pool.num_free_blocks == 7
    kv.free(a)
    assert kv.pool.num_free_blocks == 10 and all(b.ref_cnt == 0 for b in kv.pool.blocks)


def test_without_a_window_every_block_is_held() -> None:
    kv = KVCacheManager(num_blocks=10, block_size=BLOCK_SIZE)
    a = _request("a", list(range(12)))
    _prefill(kv, a)
    _decode(kv, a, 5)
    assert kv.num_held_blocks(a.request_id) == 5 and kv.pool.num_free_blocks == 5


def test_a_new_request_takes_only_the_cached_blocks_inside_its_window() -> None:
    kv = KVCacheManager(num_blocks=10, block_size=BLOCK_SIZE, sliding_window=WINDOW)
    a = _request("a", list(range(16)))
    _prefill(kv, a)
    kv.free(a)  # blocks 0-3 cached and free
    b = _request("b", [*range(16), 99, 98])
    computed, num_cached = kv.get_computed_blocks(b)
    assert (computed, num_cached) == ([0, 1, 2, 3], 16)
    # Position 16 reads 9..16: blocks 0 and 1 are not taken, nor counted as needed.
    assert kv.allocate_slots(b, 2, computed)
    assert kv.get_block_table(b.request_id) == [0, 1, 2, 3, 4]
    assert [kv.pool.blocks[i].ref_cnt for i in range(5)] == [0, 0, 1, 1, 1]
    assert kv.num_held_blocks(b.request_id) == 3
    kv.free(b)
    assert kv.pool.num_free_blocks == 10 and all(blk.ref_cnt == 0 for blk in kv.pool.blocks)


def test_a_prefix_whose_first_block_was_evicted_is_not_revived() -> None:
    kv = KVCacheManager(num_blocks=6, block_size=BLOCK_SIZE, sliding_window=WINDOW)
    a = _request("a", list(range(12)))
    _prefill(kv, a)
    _decode(kv, a, 1)  # block 0 released (cached, at the free list's tail; block 3 taken)
    other = _request("other", list(range(300, 304)))
    assert kv.allocate_slots(other, 4)
    assert kv.get_block_table(other.request_id) == [4]  # the never-used blocks go first
    assert kv.allocate_slots(_request("more", list(range(400, 404))), 4)
    assert kv.get_block_table(RequestId("more")) == [5]
    assert kv.allocate_slots(_request("evicts", list(range(500, 504))), 4)
    assert kv.get_block_table(RequestId("evicts")) == [0]  # block 0's prefix is evicted
    # Blocks 1 and 2 still hold a's prefix under their hashes, but nothing before them does.
    b = _request("b", [*range(12), 77])
    assert kv.get_computed_blocks(b) == ([], 0)


def _model(windows: list[int | None]) -> nn.Module:
    return nn.ModuleList(Attention(16, 2, 1, 8, False, None, sliding_window=w) for w in windows)


def test_only_a_model_whose_every_layer_slides_releases_blocks() -> None:
    assert sliding_window_of_every_layer(_model([8, 8]), 2) == 8
    assert sliding_window_of_every_layer(_model([4, 8]), 2) == 8  # the widest binds
    assert sliding_window_of_every_layer(_model([8, None]), 2) is None  # a global layer
    assert sliding_window_of_every_layer(_model([8]), 2) is None  # a shard of the layers
