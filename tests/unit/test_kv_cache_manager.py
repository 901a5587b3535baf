"""KVCacheManager: slot allocation, prefix-cache lookup and sharing, with exact block ids."""

from __future__ import annotations

from vllm_cluster.engine.kv_cache_manager import KVCacheManager
from vllm_cluster.engine.request import Request, RequestId
from vllm_cluster.engine.sampling_params import SamplingParams

BLOCK_SIZE = 4


def _request(request_id: str, prompt: list[int], extra_keys: tuple[str, ...] = ()) -> Request:
    request = Request(
        RequestId(request_id), list(prompt), SamplingParams(max_tokens=4), None, 4, extra_keys=extra_keys
    )
    request.update_block_hashes(BLOCK_SIZE)
    return request


def _prefill(kv: KVCacheManager, request: Request) -> None:
    """Admit `request` as the scheduler does: cached prefix first, then the rest."""
    computed_blocks, num_cached = kv.get_computed_blocks(request)
    assert kv.allocate_slots(request, request.num_tokens - num_cached, computed_blocks)
    kv.record_prefix_lookup(request.num_tokens, num_cached)
    request.num_computed_tokens = request.num_tokens


PROMPT = list(range(100, 112))  # 3 full blocks


def test_allocate_slots_takes_ceil_tokens_over_block_size() -> None:
    kv = KVCacheManager(num_blocks=10, block_size=BLOCK_SIZE)
    a, b = _request("a", list(range(10))), _request("b", list(range(50, 55)))
    assert kv.allocate_slots(a, 10)
    assert kv.get_block_table(a.request_id) == [0, 1, 2]
    assert kv.allocate_slots(b, 5)
    assert kv.get_block_table(b.request_id) == [3, 4]
    assert kv.pool.num_free_blocks == 5


def test_allocate_slots_grows_only_at_a_block_boundary() -> None:
    kv = KVCacheManager(num_blocks=10, block_size=BLOCK_SIZE)
    a = _request("a", list(range(10)))
    assert kv.allocate_slots(a, 10)
    a.num_computed_tokens = 10
    assert kv.allocate_slots(a, 2)  # 12 tokens: still 3 blocks
    assert kv.get_block_table(a.request_id) == [0, 1, 2]
    a.num_computed_tokens = 12
    assert kv.allocate_slots(a, 1)  # 13 tokens: a 4th block
    assert kv.get_block_table(a.request_id) == [0, 1, 2, 3]
    assert kv.pool.num_free_blocks == 6


def test_allocate_slots_fails_without_change_when_blocks_run_out() -> None:
    kv = KVCacheManager(num_blocks=3, block_size=BLOCK_SIZE)
    a, b = _request("a", list(range(8))), _request("b", list(range(50, 59)))
    assert kv.allocate_slots(a, 8)
    assert kv.allocate_slots(b, 9) is False
    assert b.request_id not in kv.block_tables
    assert kv.pool.num_free_blocks == 1
    a.num_computed_tokens = 8
    assert kv.allocate_slots(a, 5) is False  # needs 4 blocks, has 2, 1 free
    assert kv.get_block_table(a.request_id) == [0, 1]
    assert [blk.ref_cnt for blk in kv.pool.blocks] == [1, 1, 0]
    assert kv.allocate_slots(a, 4)
    assert kv.get_block_table(a.request_id) == [0, 1, 2]


def test_allocate_slots_caches_only_full_blocks() -> None:
    kv = KVCacheManager(num_blocks=10, block_size=BLOCK_SIZE)
    a = _request("a", list(range(10)))
    assert kv.allocate_slots(a, 10)
    assert len(a.block_hashes) == 2
    assert [kv.pool.get_cached(h) for h in a.block_hashes] == [0, 1]
    assert kv.pool.blocks[2].block_hash is None


def test_longest_cached_prefix_is_found() -> None:
    kv = KVCacheManager(num_blocks=10, block_size=BLOCK_SIZE)
    _prefill(kv, _request("a", PROMPT))
    b = _request("b", PROMPT[:8] + [7, 7, 7, 7, 7])
    assert kv.get_computed_blocks(b) == ([0, 1], 8)
    c = _request("c", PROMPT + [7])
    assert kv.get_computed_blocks(c) == ([0, 1, 2], 12)
    d = _request("d", [1] + PROMPT[1:])
    assert kv.get_computed_blocks(d) == ([], 0)


def test_a_prompt_of_full_blocks_leaves_its_last_block_to_compute() -> None:
    kv = KVCacheManager(num_blocks=10, block_size=BLOCK_SIZE)
    _prefill(kv, _request("a", PROMPT))
    b = _request("b", PROMPT)
    assert kv.get_computed_blocks(b) == ([0, 1], 8)
    one_block = _request("c", PROMPT[:4])
    assert kv.get_computed_blocks(one_block) == ([], 0)


def test_other_extra_keys_miss_the_cache() -> None:
    kv = KVCacheManager(num_blocks=10, block_size=BLOCK_SIZE)
    _prefill(kv, _request("a", PROMPT, extra_keys=("tenant-a",)))
    assert kv.get_computed_blocks(_request("b", PROMPT + [7], ("tenant-b",))) == ([], 0)
    assert kv.get_computed_blocks(_request("c", PROMPT + [7], ("tenant-a",))) == ([0, 1, 2], 12)


def test_shared_prefix_shares_block_ids() -> None:
    kv = KVCacheManager(num_blocks=10, block_size=BLOCK_SIZE)
    a, b = _request("a", PROMPT), _request("b", PROMPT[:8] + [7, 7, 7])
    _prefill(kv, a)
    _prefill(kv, b)
    assert kv.get_block_table(a.request_id) == [0, 1, 2]
    assert kv.get_block_table(b.request_id) == [0, 1, 3]
    assert [blk.ref_cnt for blk in kv.pool.blocks[:4]] == [2, 2, 1, 1]
    assert kv.pool.num_free_blocks == 6
    kv.free(a)
    assert [blk.ref_cnt for blk in kv.pool.blocks[:4]] == [1, 1, 0, 1]
    assert kv.pool.num_free_blocks == 7


def test_prefix_hits_revive_freed_blocks() -> None:
    kv = KVCacheManager(num_blocks=4, block_size=BLOCK_SIZE)
    a = _request("a", PROMPT)
    _prefill(kv, a)
    kv.free(a)
    assert kv.pool.num_free_blocks == 4
    b = _request("b", PROMPT[:8] + [7, 7, 7, 7, 7])  # 13 tokens: 2 hits + 2 new blocks
    _prefill(kv, b)
    # The two new blocks come from the free queue head (never-used 3, then a's tail 2), in id order.
    assert kv.get_block_table(b.request_id) == [0, 1, 2, 3]
    assert kv.pool.get_cached(a.block_hashes[2]) is None
    assert kv.pool.num_free_blocks == 0


def test_revived_blocks_do_not_count_as_free_room() -> None:
    kv = KVCacheManager(num_blocks=3, block_size=BLOCK_SIZE)
    a = _request("a", PROMPT)
    _prefill(kv, a)
    kv.free(a)
    b = _request("b", PROMPT + [7])  # 3 hits (all free blocks) + 1 new block: no room
    computed_blocks, num_cached = kv.get_computed_blocks(b)
    assert (computed_blocks, num_cached) == ([0, 1, 2], 12)
    assert kv.allocate_slots(b, 1, computed_blocks) is False
    assert b.request_id not in kv.block_tables
    assert kv.pool.num_free_blocks == 3
    assert [kv.pool.get_cached(h) for h in a.block_hashes] == [0, 1, 2]


def test_prefix_stats_count_queried_and_hit_tokens() -> None:
    kv = KVCacheManager(num_blocks=10, block_size=BLOCK_SIZE)
    _prefill(kv, _request("a", PROMPT))  # 12 queried, 0 hit
    _prefill(kv, _request("b", PROMPT[:8] + [7]))  # 9 queried, 8 hit
    _prefill(kv, _request("c", PROMPT))  # 12 queried, 8 hit
    assert kv.prefix_stats.num_queries == 33
    assert kv.prefix_stats.num_hits == 16


def test_caching_disabled_gives_no_hits() -> None:
    kv = KVCacheManager(num_blocks=10, block_size=BLOCK_SIZE, enable_caching=False)
    a, b = _request("a", PROMPT), _request("b", PROMPT + [7])
    _prefill(kv, a)
    assert kv.get_computed_blocks(b) == ([], 0)
    _prefill(kv, b)
    assert kv.get_block_table(b.request_id) == [3, 4, 5, 6]
    assert [blk.block_hash for blk in kv.pool.blocks] == [None] * 10
    assert kv.prefix_stats.num_hits == 0


def test_free_releases_every_block_and_forgets_the_request() -> None:
    kv = KVCacheManager(num_blocks=10, block_size=BLOCK_SIZE)
    a = _request("a", list(range(10)))
    assert kv.allocate_slots(a, 10)
    kv.free(a)
    assert kv.pool.num_free_blocks == 10
    assert a.request_id not in kv.block_tables
    kv.free(a)  # a second free is a no-op
    assert kv.pool.num_free_blocks == 10
