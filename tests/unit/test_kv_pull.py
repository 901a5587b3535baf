"""Cross-instance KV reuse without a network: the router's pull decision, the holder's pins,
the target's partial wait and caching, over the in-process transport with exact block ids."""

from __future__ import annotations

import pytest
import torch

from vllm_cluster.engine.kv_cache_manager import KVCacheManager
from vllm_cluster.engine.kv_pull import cache_pulled, pin_prefix, reserved_blocks, unpin
from vllm_cluster.engine.request import Request, RequestId
from vllm_cluster.engine.sampling_params import SamplingParams
from vllm_cluster.kv_index import TierOverlap
from vllm_cluster.kv_transfer import KVLayout, LocalReceiver, LocalSender
from vllm_cluster.router.pull import PullCost, PullPlan, plan_pull, pull_is_cheaper, pull_saving_s

BLOCK_SIZE = 4
COST = PullCost(link_bytes_per_s=1e9, recompute_tokens_per_s=1000.0, setup_s=0.01)


def test_a_pull_is_cheaper_when_the_link_beats_the_compute() -> None:
    # 10 blocks of 40 tokens: 0.01 s + 10 * 1 MB / 1 GB/s = 0.02 s against 0.04 s of compute.
    assert pull_is_cheaper(10, 1_000_000, BLOCK_SIZE, COST)
    # 100 MB blocks: 1.01 s of transfer against 0.04 s of compute.
    assert not pull_is_cheaper(10, 100_000_000, BLOCK_SIZE, COST)
    # One block: the setup cost alone (0.01 s) beats its compute (0.004 s).
    assert not pull_is_cheaper(1, 1000, BLOCK_SIZE, COST)
    assert not pull_is_cheaper(0, 1000, BLOCK_SIZE, COST)


def test_plan_pulls_from_the_holder_with_most_blocks_past_the_target() -> None:
    overlap = {"decode@a": TierOverlap(num_device=6), "decode@b": TierOverlap(num_device=9),
               "decode@t": TierOverlap(num_device=2), "prefill@p": TierOverlap(num_host=5)}
    holders = {"decode@a", "decode@b", "decode@t", "prefill@p"}
    plan = plan_pull(overlap, "decode@t", holders, 50, BLOCK_SIZE, 2 * BLOCK_SIZE, 1000, COST)
    # The target holds 2 blocks; b holds 9, of which 7 are new (p: 3 new, from its host tier).
    assert plan == PullPlan("decode@b", num_skip_blocks=2, num_blocks=7)


def test_plan_leaves_the_last_prompt_token_to_compute() -> None:
    overlap = {"decode@a": TierOverlap(num_device=10)}
    # 40 tokens = 10 whole blocks; the last token's block stays with the target.
    plan = plan_pull(overlap, "decode@t", {"decode@a", "decode@t"}, 40, BLOCK_SIZE, 0, 1000, COST)
    assert plan == PullPlan("decode@a", 0, 9)


def test_no_plan_without_a_better_holder_or_a_saving() -> None:
    overlap = {"decode@a": TierOverlap(num_device=3), "decode@t": TierOverlap(num_device=3)}
    assert plan_pull(overlap, "decode@t", {"decode@a", "decode@t"}, 50, BLOCK_SIZE, 12, 1000, COST) is None
    # An unhealthy holder is not among holder_ids.
    assert plan_pull({"decode@a": TierOverlap(num_device=9)}, "decode@t", {"decode@t"}, 50, BLOCK_SIZE, 0,
                     1000, COST) is None
    # A slow link: computing is cheaper.
    assert plan_pull({"decode@a": TierOverlap(num_device=9)}, "decode@t", {"decode@a"}, 50, BLOCK_SIZE, 0,
                     10**9, COST) is None


def test_a_tier_block_costs_its_load_as_prefix_aware_routing_prices_it() -> None:
    # Per block: 4 ms to compute, 1 us to move; a host load costs 1 - 0.8 of the compute, a
    # disk load 1 - 0.4 (PrefixWeights.host, .disk).
    move_s, compute_s = 1000 / COST.link_bytes_per_s, BLOCK_SIZE / COST.recompute_tokens_per_s
    saving_s = pull_saving_s(10, 1000, BLOCK_SIZE, COST, num_host_blocks=3, num_disk_blocks=2)
    assert saving_s == pytest.approx(10 * compute_s - (COST.setup_s + 10 * move_s + compute_s * (3 * 0.2 + 2 * 0.6)))
    device, host, disk = (pull_saving_s(10, 1000, BLOCK_SIZE, COST, *tiers) for tiers in ((0, 0), (10, 0), (0, 10)))
    assert device > host > disk > 0


def test_a_holder_with_the_prefix_in_its_host_tier_serves_the_pull() -> None:
    overlap = {"decode@a": TierOverlap(num_device=2, num_host=7), "decode@t": TierOverlap(num_device=2)}
    plan = plan_pull(overlap, "decode@t", {"decode@a", "decode@t"}, 50, BLOCK_SIZE, 2 * BLOCK_SIZE, 1000, COST)
    # Past the target's 2 blocks a holds 7 more, all in its host tier (its device ones lead).
    assert plan == PullPlan("decode@a", num_skip_blocks=2, num_blocks=7, num_host_blocks=7)
    # Its disk tier counts too, after the host one.
    overlap = {"decode@a": TierOverlap(num_device=3, num_host=2, num_disk=4)}
    plan = plan_pull(overlap, "decode@t", {"decode@a"}, 50, BLOCK_SIZE, 0, 1000, COST)
    assert plan == PullPlan("decode@a", 0, 9, num_host_blocks=2, num_disk_blocks=4)


def test_the_faster_tier_wins_between_holders_of_as_many_blocks() -> None:
    overlap = {"decode@a": TierOverlap(num_disk=8), "decode@b": TierOverlap(num_host=8),
               "decode@c": TierOverlap(num_device=4, num_host=4)}
    holders = {"decode@a", "decode@b", "decode@c"}
    assert plan_pull(overlap, "decode@t", holders, 50, BLOCK_SIZE, 0, 1000, COST) == PullPlan("decode@c", 0, 8, 4)
    del overlap["decode@c"]
    assert plan_pull(overlap, "decode@t", holders, 50, BLOCK_SIZE, 0, 1000, COST) == PullPlan("decode@b", 0, 8, 8)
    # But more blocks from a slower tier beat fewer from a faster one when they save more.
    overlap = {"decode@a": TierOverlap(num_disk=12), "decode@b": TierOverlap(num_device=3)}
    assert plan_pull(overlap, "decode@t", holders, 60, BLOCK_SIZE, 0, 1000, COST) == PullPlan("decode@a", 0, 12, 0, 12)


def test_a_tier_whose_load_and_move_cost_more_than_compute_is_left_out() -> None:
    # 2.5 MB blocks: 2.5 ms to move against 4 ms of compute. A host block saves 3.2 - 2.5 ms,
    # a disk block 1.6 - 2.5 ms: the pull stops where the holder's disk tier starts.
    overlap = {"decode@a": TierOverlap(num_device=10, num_host=20, num_disk=5)}
    plan = plan_pull(overlap, "decode@t", {"decode@a"}, 200, BLOCK_SIZE, 0, 2_500_000, COST)
    assert plan == PullPlan("decode@a", 0, 30, num_host_blocks=20)
    # A holder with disk blocks only: nothing is worth pulling.
    assert plan_pull({"decode@a": TierOverlap(num_disk=10)}, "decode@t", {"decode@a"}, 50, BLOCK_SIZE, 0,
                     2_500_000, COST) is None


def _request(request_id: str, prompt: list[int]) -> Request:
    request = Request(RequestId(request_id), prompt, SamplingParams(max_tokens=4), None, 4)
    request.update_block_hashes(BLOCK_SIZE)
    return request


def test_pins_hold_the_leading_cached_blocks_until_unpinned() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=BLOCK_SIZE)  # no offload tiers
    holder = _request("h", list(range(100, 114)))  # 3 full blocks, then 2 tokens
    assert kv.allocate_slots(holder, 14)
    kv.free(holder)  # cached and free: evictable
    hashes = [bytes(h) for h in holder.block_hashes]
    pinned = pin_prefix(kv, hashes[:2] + [b"\0" * 16] + hashes[2:])
    assert (pinned.block_ids, pinned.num_host_blocks) == ([0, 1], 0)  # a missing block ends the run
    assert [kv.pool.blocks[b].ref_cnt for b in range(3)] == [1, 1, 0]
    assert kv.pool.num_free_blocks == 6
    unpin(kv.pool, pinned.block_ids)
    assert kv.pool.num_free_blocks == 8
    assert all(block.ref_cnt == 0 for block in kv.pool.blocks)
    # Evicted meanwhile (and no tier below the device): nothing to pin, nothing to push.
    kv.pool.allocate(8)
    assert pin_prefix(kv, hashes).block_ids == []


def _caches(num_blocks: int) -> list[torch.Tensor]:
    # kv_caches[layer]: [num_blocks, 2, block_size, num_kv_heads, head_dim]
    return [torch.zeros(num_blocks, 2, BLOCK_SIZE, 1, 2) for _ in range(2)]


def test_target_waits_for_the_pulled_part_only_then_caches_it() -> None:
    layout = KVLayout.from_kv_caches(_caches(8), model="tiny")
    source = [torch.arange(8 * 2 * BLOCK_SIZE * 2, dtype=torch.float32).reshape(8, 2, BLOCK_SIZE, 1, 2) + layer
              for layer in range(2)]
    landed = _caches(8)
    receiver = LocalReceiver(landed, layout, "pull-target")
    sender = LocalSender(source, layout)
    try:
        kv = KVCacheManager(num_blocks=8, block_size=BLOCK_SIZE)
        target = _request("t", list(range(100, 118)))  # 4 full blocks + 2 tokens: 5 blocks reserved
        assert kv.allocate_slots(target, 18, cache=False)  # as Scheduler.reserve does
        target.num_cached_tokens = 0
        block_ids, num_skip = reserved_blocks(kv, target)
        assert (block_ids, num_skip) == ([0, 1, 2, 3, 4], 0)
        receiver.expect("t", block_ids)
        for layer in range(2):
            sender.push_layer(receiver.endpoint, "t", layer, [5, 6, 7], block_ids[:3])
        assert sender.wait("t", 1.0).name == "DONE"
        assert receiver.wait_blocks("t", block_ids[:3], 1.0)
        assert all(torch.equal(landed[layer][:3], source[layer][5:8]) for layer in range(2))
        assert not receiver.wait_blocks("t", block_ids[:4], 0.01)  # block 3 never came
        assert not receiver.wait_blocks("t", [7], 0.01)  # not this transfer's block
        receiver.cancel("t")
        assert not receiver.wait_blocks("t", block_ids[:3], 0.01)  # cancelled
        cache_pulled(kv, target, 3)
        assert [kv.pool.get_cached(h) for h in target.block_hashes] == [0, 1, 2, None]
        kv.free(target)
        assert kv.pool.num_free_blocks == 8
        again = _request("again", list(range(100, 118)))
        assert kv.get_computed_blocks(again) == ([0, 1, 2], 12)
    finally:
        receiver.close()
        sender.close()
