"""KV offload tiers under the KVCacheManager: exact block accounting against a simple model.

The device cache, a host tier and a disk tier on tiny CPU tensors. Each block's KV is a
pattern derived from its hash, so any mix-up of blocks between tiers shows as wrong data.
"""

from __future__ import annotations

import random
from collections import OrderedDict
from pathlib import Path

import pytest
import torch

from vllm_cluster.engine import kv_offload
from vllm_cluster.engine.block_hash import BlockHash
from vllm_cluster.engine.config import CacheConfig
from vllm_cluster.engine.errors import ConfigError
from vllm_cluster.engine.kv_cache_manager import KVCacheManager
from vllm_cluster.engine.kv_offload import DiskTierConfig, KVOffload, Tier, build_offload
from vllm_cluster.engine.request import Request, RequestId
from vllm_cluster.engine.sampling_params import SamplingParams

BLOCK_SIZE = 2
NUM_LAYERS = 2
BLOCK_SHAPE = (2, BLOCK_SIZE, 1, 3)  # [2, block_size, num_kv_heads, head_dim]


def _pattern(block_hash: BlockHash, layer: int) -> torch.Tensor:
    seed = int.from_bytes(bytes(block_hash)[:4], "little") % 10_000
    return torch.arange(12, dtype=torch.float32).view(BLOCK_SHAPE) + seed * 100 + layer


def _request(request_id: str, prompt: list[int]) -> Request:
    request = Request(RequestId(request_id), list(prompt), SamplingParams(max_tokens=1), None, 1)
    request.update_block_hashes(BLOCK_SIZE)
    return request


class TierModel:
    """What the tiers must hold: inclusive LRU caches fed by device evictions, oldest first."""

    def __init__(self, num_host: int, num_disk: int) -> None:
        self.host: OrderedDict[BlockHash, None] = OrderedDict()
        self.disk: OrderedDict[BlockHash, None] = OrderedDict()
        self.num_host, self.num_disk = num_host, num_disk
        self.num_dropped = 0

    def evict(self, block_hashes: list[BlockHash]) -> None:
        for h in block_hashes:
            if h in self.host:
                self.host.move_to_end(h)
                continue
            if len(self.host) == self.num_host:
                old, _ = self.host.popitem(last=False)
                self._spill(old)
            self.host[h] = None

    def _spill(self, h: BlockHash) -> None:
        if h in self.disk:
            self.disk.move_to_end(h)
            return
        if len(self.disk) == self.num_disk:
            self.disk.popitem(last=False)
            self.num_dropped += 1
        self.disk[h] = None

    def load(self, block_hashes: list[BlockHash]) -> None:
        for h in block_hashes:
            if h in self.host:
                self.host.move_to_end(h)
            else:
                self.disk.move_to_end(h)


class Harness:
    def __init__(self, tmp_path: Path, num_blocks: int = 8, num_host: int = 4, num_disk: int = 6) -> None:
        self.caches = [torch.zeros((num_blocks, *BLOCK_SHAPE)) for _ in range(NUM_LAYERS)]
        self.kv = KVCacheManager(num_blocks, BLOCK_SIZE)
        self.offload = KVOffload(self.caches, num_host, DiskTierConfig(tmp_path / "kv", num_disk))
        self.kv.attach_offload(self.offload)
        self.model = TierModel(num_host, num_disk)
        offload_evict = self.kv.pool.on_evict
        assert offload_evict is not None

        def on_evict(block_ids: list, block_hashes: list) -> None:
            self.model.evict(list(block_hashes))
            offload_evict(block_ids, block_hashes)

        self.kv.pool.on_evict = on_evict
        self.live: dict[str, Request] = {}
        self.num_loaded = {Tier.HOST: 0, Tier.DISK: 0}

    def admit(self, request: Request) -> bool:
        device_before = set(self.kv.pool.cached_hashes())
        computed, num_cached = self.kv.get_computed_blocks(request)
        hit_hashes = request.block_hashes[: len(computed)]
        loaded = [h for h in hit_hashes if h not in device_before]
        self.num_loaded[Tier.HOST] += sum(1 for x in loaded if x in self.model.host)
        self.num_loaded[Tier.DISK] += sum(1 for x in loaded if x not in self.model.host)
        self.model.load(loaded)
        for block_id, h in zip(computed, hit_hashes, strict=True):  # every hit holds its block's KV
            for layer, cache in enumerate(self.caches):
                assert torch.equal(cache[block_id], _pattern(h, layer)), f"block {block_id} holds the wrong KV"
        if not self.kv.allocate_slots(request, request.num_tokens - num_cached, computed):
            self.kv.free(request)  # as the scheduler's finish does for a request given up waiting
            return False
        self.kv.record_prefix_lookup(request.num_tokens, num_cached, request)
        table = self.kv.get_block_table(request.request_id)
        for block_id, h in list(zip(table, request.block_hashes, strict=False))[len(computed) :]:
            for layer, cache in enumerate(self.caches):  # "compute" the new full blocks
                cache[block_id] = _pattern(h, layer)
        request.num_computed_tokens = request.num_tokens
        self.live[str(request.request_id)] = request
        return True

    def finish(self, request_id: str) -> None:
        self.kv.free(self.live.pop(request_id))

    def check(self) -> None:
        pool = self.kv.pool
        held = sum(self.kv.num_held_blocks(r.request_id) for r in self.live.values())
        assert sum(b.ref_cnt for b in pool.blocks) == held
        assert pool.num_free_blocks + sum(1 for b in pool.blocks if b.ref_cnt > 0) == pool.num_blocks
        assert self.offload.hashes(Tier.HOST) == list(self.model.host)
        assert self.offload.hashes(Tier.DISK) == list(self.model.disk)
        slots = [self.offload.host.slot(h) for h in self.offload.hashes(Tier.HOST)]
        assert len(set(slots)) == len(slots)
        for h in self.offload.hashes(Tier.HOST):
            for layer, data in enumerate(self.offload.host.block(self.offload.host.slot(h))):
                assert torch.equal(data, _pattern(h, layer))
        assert self.offload.disk is not None
        files = sorted(p.name for p in self.offload.disk.directory.iterdir())
        assert files == sorted(self.offload.disk.path(h).name for h in self.model.disk)


def test_randomized_sequence_keeps_every_tier_exact(tmp_path: Path) -> None:
    rng = random.Random(7)
    h = Harness(tmp_path)
    families = [[rng.randrange(1000) for _ in range(12)] for _ in range(5)]
    host_hits = disk_hits = 0
    for step in range(300):
        if h.live and (len(h.live) >= 2 or rng.random() < 0.4):
            h.finish(rng.choice(sorted(h.live)))
        else:
            family = rng.choice(families)
            prompt = family[: rng.randrange(3, 12)] + [rng.randrange(1000)]
            before = h.kv.prefix_stats.num_host_hits, h.kv.prefix_stats.num_disk_hits
            h.admit(_request(f"r{step}", prompt))
            host_hits += h.kv.prefix_stats.num_host_hits - before[0]
            disk_hits += h.kv.prefix_stats.num_disk_hits - before[1]
        h.check()
    stats = h.offload.stats
    assert host_hits > 0 and disk_hits > 0, "the sequence should hit both tiers"
    assert stats[Tier.HOST].num_hit_blocks == h.num_loaded[Tier.HOST]
    assert stats[Tier.DISK].num_hit_blocks == h.num_loaded[Tier.DISK]
    # Admitted requests' tier hits, each block once (a lookup that found no room loads but does not count).
    assert 0 < host_hits <= h.num_loaded[Tier.HOST] * BLOCK_SIZE
    assert 0 < disk_hits <= h.num_loaded[Tier.DISK] * BLOCK_SIZE
    assert stats[Tier.HOST].num_stored_blocks == stats[Tier.HOST].num_evicted_blocks + len(h.model.host)
    assert stats[Tier.DISK].num_stored_blocks == stats[Tier.DISK].num_evicted_blocks + len(h.model.disk)
    assert stats[Tier.DISK].num_evicted_blocks == h.model.num_dropped


def _evict_all(h: Harness, filler_prefix: int) -> None:
    """Fill the device cache with other blocks, so everything cached before leaves it."""
    for i in range(3):
        assert h.admit(_request(f"fill{filler_prefix}-{i}", [filler_prefix + i * 10 + j for j in range(5)]))
        h.finish(f"fill{filler_prefix}-{i}")


def test_a_host_hit_loads_instead_of_recomputing(tmp_path: Path) -> None:
    h = Harness(tmp_path, num_blocks=6, num_host=8, num_disk=2)
    prompt = list(range(7))  # 3 full blocks, 1 token left to compute
    assert h.admit(_request("a", prompt))
    h.finish("a")
    _evict_all(h, 5000)
    assert not set(_request("x", prompt).block_hashes) & set(h.kv.pool.cached_hashes())
    computed, num_cached = h.kv.get_computed_blocks(_request("b", prompt))
    assert num_cached == 6 and len(computed) == 3
    assert h.offload.stats[Tier.HOST].num_hit_blocks == 3


def test_a_corrupt_disk_file_is_recomputed(tmp_path: Path) -> None:
    h = Harness(tmp_path, num_blocks=6, num_host=1, num_disk=20)
    prompt = list(range(7))
    a = _request("a", prompt)
    assert h.admit(a)
    h.finish("a")
    _evict_all(h, 5000)
    _evict_all(h, 7000)
    assert h.offload.disk is not None
    on_disk = [x for x in a.block_hashes if x in h.offload.disk]
    assert on_disk == a.block_hashes[:3]
    path = h.offload.disk.path(a.block_hashes[1])
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))
    b = _request("b", prompt)
    computed, num_cached = h.kv.get_computed_blocks(b)
    assert num_cached == BLOCK_SIZE  # the first block loads; the corrupt one and after are recomputed
    assert a.block_hashes[1] not in h.offload.disk and not path.exists()
    assert h.offload.stats[Tier.DISK].num_failed_loads == 1
    h.model.load([a.block_hashes[0]])
    h.model.disk.pop(a.block_hashes[1])
    assert h.kv.allocate_slots(b, b.num_tokens - num_cached, computed)


def test_a_missing_disk_file_is_recomputed(tmp_path: Path) -> None:
    h = Harness(tmp_path, num_blocks=6, num_host=1, num_disk=20)
    prompt = list(range(7))
    a = _request("a", prompt)
    assert h.admit(a)
    h.finish("a")
    _evict_all(h, 5000)
    _evict_all(h, 7000)
    assert h.offload.disk is not None
    h.offload.disk.path(a.block_hashes[0]).unlink()
    _, num_cached = h.kv.get_computed_blocks(_request("b", prompt))
    assert num_cached == 0


def test_reset_prefix_cache_empties_every_tier(tmp_path: Path) -> None:
    h = Harness(tmp_path, num_blocks=6, num_host=1, num_disk=20)
    assert h.admit(_request("a", list(range(7))))
    h.finish("a")
    _evict_all(h, 5000)
    assert h.offload.hashes(Tier.HOST) and h.offload.hashes(Tier.DISK)
    assert h.kv.reset_prefix_cache()
    assert h.offload.hashes(Tier.HOST) == [] and h.offload.hashes(Tier.DISK) == []
    assert h.offload.disk is not None and list(h.offload.disk.directory.iterdir()) == []


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"host_kv_gib": -1.0}, "must be >= 0"),
        ({"host_kv_gib": 1.0, "disk_kv_gib": 1.0}, "go together"),
        ({"disk_kv_dir": "/tmp/x", "disk_kv_gib": 1.0}, "needs cache.host_kv_gib"),
        ({"host_kv_gib": 1.0, "enable_prefix_caching": False}, "needs enable_prefix_caching"),
    ],
)
def test_bad_tier_config_says_what_to_change(options: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        CacheConfig(**options).validate()


def test_a_host_tier_too_small_for_one_block_is_refused() -> None:
    caches = [torch.zeros((4, *BLOCK_SHAPE)) for _ in range(NUM_LAYERS)]
    with pytest.raises(ConfigError, match="holds no KV block"):
        build_offload(1e-12, None, 0.0, caches)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float8_e4m3fn])
def test_blocks_round_trip_bit_exact_through_host_and_disk(tmp_path: Path, dtype: torch.dtype) -> None:
    caches = [torch.randn((4, *BLOCK_SHAPE)).to(dtype) for _ in range(NUM_LAYERS)]
    offload = KVOffload(caches, 1, DiskTierConfig(tmp_path, 4))
    original = [c[1].clone() for c in caches], [c[2].clone() for c in caches]
    a, b = BlockHash(b"a" * 16), BlockHash(b"b" * 16)
    offload.on_evict([1, 2], [a, b])  # a goes on to disk, b stays in the host tier
    assert offload.hashes(Tier.HOST) == [b] and offload.hashes(Tier.DISK) == [a]
    assert offload.load([a, b], [3, 0]) == [Tier.DISK, Tier.HOST]
    for layer, cache in enumerate(caches):
        assert torch.equal(cache[3].view(torch.uint8), original[0][layer].view(torch.uint8))
        assert torch.equal(cache[0].view(torch.uint8), original[1][layer].view(torch.uint8))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the copy stream needs a CUDA GPU")
def test_copy_stream_orders_evictions_loads_and_overwrites_on_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    """On CUDA a block's copy to the host crosses on a stream of its own; a load from a slot
    still being written, and the next step's writes into the evicted blocks, still see the
    KV the block held when it was evicted. Staging bounded to 1 MiB: many chunks, the
    compute stream waiting on the oldest."""
    monkeypatch.setattr(kv_offload, "_MAX_STAGED_BYTES", 1 << 20)
    num_blocks, shape = 64, (2, 16, 8, 128)
    caches = [torch.randn((num_blocks, *shape), device="cuda").to(torch.bfloat16) for _ in range(4)]
    offload = KVOffload(caches, 2 * num_blocks)
    expected = [c.clone() for c in caches]
    hashes = [BlockHash(i.to_bytes(16, "little")) for i in range(num_blocks)]
    ids = list(range(num_blocks))
    offload.on_evict(ids, hashes)
    for cache in caches:  # the compute stream reuses every evicted block at once
        cache.fill_(-1)
    assert offload.load(hashes, ids[::-1]) == [Tier.HOST] * num_blocks  # straight back, reversed
    torch.cuda.synchronize()
    for cache, original in zip(caches, expected, strict=True):
        assert torch.equal(cache.view(torch.uint8), original.flip(0).view(torch.uint8))


def test_a_prefix_evicted_tail_first_lands_in_ascending_slots_and_loads_back_exact() -> None:
    """A request's blocks leave the device tail first; the host tier still holds its prefix
    in ascending slots, so the way back into ascending device blocks is one run."""
    caches = [torch.randn((8, *BLOCK_SHAPE)) for _ in range(NUM_LAYERS)]
    offload = KVOffload(caches, 8)
    prefix = [BlockHash(bytes([i]) * 16) for i in range(4)]
    original = [c[:4].clone() for c in caches]
    offload.on_evict([3, 2, 1, 0], prefix[::-1])  # tail first
    assert [offload.host.slot(h) for h in prefix] == [0, 1, 2, 3]
    assert offload.hashes(Tier.HOST) == prefix[::-1]  # LRU order is still the eviction order
    assert offload.load(prefix, [4, 5, 6, 7]) == [Tier.HOST] * 4
    for cache, before in zip(caches, original, strict=True):
        assert torch.equal(cache[4:8], before)
