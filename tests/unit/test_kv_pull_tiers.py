"""The holder's part of a pull when its prefix left the device cache: pin what the device
still holds, load the rest from the host and disk tiers into free device blocks, push them,
unpin. Exact block ids and reference counts; every block pinned is released exactly once."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from vllm_cluster.engine.block_hash import BlockHash
from vllm_cluster.engine.kv_cache_manager import KVCacheManager
from vllm_cluster.engine.kv_offload import DiskTierConfig, KVOffload, Tier
from vllm_cluster.engine.kv_pull import pin_prefix, unpin
from vllm_cluster.engine.request import Request, RequestId
from vllm_cluster.engine.sampling_params import SamplingParams
from vllm_cluster.kv_transfer import KVLayout, LocalReceiver, LocalSender

BLOCK_SIZE = 4
NUM_BLOCKS = 8
BLOCK_SHAPE = (2, BLOCK_SIZE, 1, 2)  # [2, block_size, num_kv_heads, head_dim]


def _value(block_hash: BlockHash, layer: int) -> torch.Tensor:
    """One block's KV in one layer, told apart by its hash."""
    seed = int.from_bytes(bytes(block_hash)[:3], "little") % 1000
    return torch.full(BLOCK_SHAPE, float(seed * 10 + layer))


class Holder:
    """A holder whose 5-block prefix was evicted: hashes 0-3 in its host tier (4 slots), 4 on disk."""

    def __init__(self, tmp_path: Path) -> None:
        # caches[layer]: [NUM_BLOCKS, 2, BLOCK_SIZE, 1, 2]
        self.caches = [torch.zeros((NUM_BLOCKS, *BLOCK_SHAPE)) for _ in range(2)]
        self.kv = KVCacheManager(NUM_BLOCKS, BLOCK_SIZE)
        self.offload = KVOffload(self.caches, 4, DiskTierConfig(tmp_path / "kv", 4))
        self.kv.attach_offload(self.offload)
        request = Request(RequestId("h"), list(range(100, 122)), SamplingParams(max_tokens=1), None, 1)
        request.update_block_hashes(BLOCK_SIZE)
        assert self.kv.allocate_slots(request, 22)
        self.hashes = list(request.block_hashes)  # 5 full blocks (and 2 tokens)
        for block_id, block_hash in zip(self.kv.get_block_table(request.request_id), self.hashes, strict=False):
            for layer, cache in enumerate(self.caches):
                cache[block_id] = _value(block_hash, layer)
        self.kv.free(request)
        self.kv.pool.free(self.kv.pool.allocate(NUM_BLOCKS))  # evicts every cached block to the tiers
        for cache in self.caches:
            cache.zero_()
        assert self.offload.find(self.hashes) == [Tier.HOST] * 4 + [Tier.DISK]

    def refs(self) -> list[int]:
        return [block.ref_cnt for block in self.kv.pool.blocks]

    def holds(self, block_ids: list[int], block_hashes: list[BlockHash]) -> bool:
        return all(
            torch.equal(cache[b], _value(h, layer))
            for b, h in zip(block_ids, block_hashes, strict=True)
            for layer, cache in enumerate(self.caches)
        )


def test_a_prefix_in_the_tiers_is_loaded_pinned_pushed_and_released_once(tmp_path: Path) -> None:
    holder = Holder(tmp_path)
    pinned = pin_prefix(holder.kv, [bytes(h) for h in holder.hashes])
    assert (pinned.block_ids, pinned.num_host_blocks, pinned.num_disk_blocks) == ([0, 1, 2, 3, 4], 4, 1)
    assert pinned.ready is None  # CPU: the loads are done
    assert holder.holds(pinned.block_ids, holder.hashes)
    assert holder.refs() == [1, 1, 1, 1, 1, 0, 0, 0]
    assert [holder.kv.pool.get_cached(h) for h in holder.hashes] == [0, 1, 2, 3, 4]  # they joined the cache
    # Pushed from the device blocks, as a device-cache pull is.
    layout = KVLayout.from_kv_caches(holder.caches, model="tiny")
    landed = [torch.zeros((NUM_BLOCKS, *BLOCK_SHAPE)) for _ in range(2)]
    receiver = LocalReceiver(landed, layout, "pull-target")
    sender = LocalSender(holder.caches, layout)
    try:
        receiver.expect("t", [3, 4, 5, 6, 7])
        for layer in range(2):
            sender.push_layer(receiver.endpoint, "t", layer, pinned.block_ids, [3, 4, 5, 6, 7])
        assert sender.wait("t", 1.0).name == "DONE"
        assert receiver.wait_blocks("t", [3, 4, 5, 6, 7], 1.0)
    finally:
        receiver.close()
        sender.close()
    assert all(torch.equal(landed[layer][3:8], holder.caches[layer][0:5]) for layer in range(2))
    unpin(holder.kv.pool, pinned.block_ids)
    assert holder.refs() == [0] * NUM_BLOCKS
    assert holder.kv.pool.num_free_blocks == NUM_BLOCKS
    with pytest.raises(AssertionError, match="freed twice"):
        unpin(holder.kv.pool, pinned.block_ids)
    # The tiers keep their copies: evicting the blocks again costs no copy.
    assert holder.offload.find(holder.hashes) == [Tier.HOST] * 4 + [Tier.DISK]


def test_a_block_that_fails_to_load_ends_the_run(tmp_path: Path) -> None:
    holder = Holder(tmp_path)
    assert holder.offload.disk is not None
    holder.offload.disk.path(holder.hashes[4]).write_bytes(b"not a block")
    pinned = pin_prefix(holder.kv, [bytes(h) for h in holder.hashes])
    assert (pinned.block_ids, pinned.num_host_blocks, pinned.num_disk_blocks) == ([0, 1, 2, 3], 4, 0)
    assert holder.refs() == [1, 1, 1, 1, 0, 0, 0, 0]  # the block taken for the failed load is back
    assert holder.offload.stats[Tier.DISK].num_failed_loads == 1
    unpin(holder.kv.pool, pinned.block_ids)
    assert holder.kv.pool.num_free_blocks == NUM_BLOCKS


def test_device_and_tier_blocks_mix_and_pins_past_the_run_are_released(tmp_path: Path) -> None:
    holder = Holder(tmp_path)
    h = holder.hashes
    for back in (h[1], h[3]):  # two blocks back in the device cache (free and cached there)
        unpin(holder.kv.pool, pin_prefix(holder.kv, [bytes(back)]).block_ids)
    device_1, device_3 = holder.kv.pool.get_cached(h[1]), holder.kv.pool.get_cached(h[3])
    assert (device_1, device_3) == (0, 1)
    busy = holder.kv.pool.allocate(4)  # blocks in use by requests: 2 free ones are left after the pins
    pinned = pin_prefix(holder.kv, [bytes(b) for b in h])
    # Free blocks less one: room to load h[0] only, so the run is h[0] (loaded), h[1] (device);
    # h[2] stays in the host tier and h[3]'s pin is dropped again.
    assert (pinned.block_ids, pinned.num_host_blocks, pinned.num_disk_blocks) == ([busy[-1] + 1, 0], 1, 0)
    assert holder.holds(pinned.block_ids, h[:2])
    assert holder.kv.pool.blocks[device_3].ref_cnt == 0 and holder.kv.pool.get_cached(h[3]) == device_3
    holder.kv.pool.free(busy)
    unpin(holder.kv.pool, pinned.block_ids)
    assert holder.refs() == [0] * NUM_BLOCKS


def test_nothing_held_pins_nothing(tmp_path: Path) -> None:
    holder = Holder(tmp_path)
    holder.offload.clear()
    pinned = pin_prefix(holder.kv, [bytes(h) for h in holder.hashes])
    assert (pinned.block_ids, pinned.num_host_blocks, pinned.num_disk_blocks) == ([], 0, 0)
    assert holder.refs() == [0] * NUM_BLOCKS
