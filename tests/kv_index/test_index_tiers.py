"""The index agrees with an engine's KV tiers: a KVCacheManager with host and disk offload
tiers (tiny CPU tensors), its device and tier events published to a real Redis, through a
random sequence of admissions (stores, loads), finishes (evictions) and restarts; then every
tier lookup equals the leading blocks the instance holds, each in its fastest tier."""

from __future__ import annotations

import argparse
import random
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from vllm_cluster.engine import LLM
from vllm_cluster.engine.block_hash import BlockHash
from vllm_cluster.engine.engine_loop import EngineLoop
from vllm_cluster.engine.kv_cache_manager import KVCacheManager
from vllm_cluster.engine.kv_offload import DiskTierConfig, KVOffload, Tier
from vllm_cluster.engine.request import Request, RequestId
from vllm_cluster.engine.sampling_params import SamplingParams
from vllm_cluster.kv_index import BlockEventPublisher, EmbeddedRedis, PrefixIndex, TierOverlap, start_embedded_redis
from vllm_cluster.worker.main import _start_publisher

MODEL = "test-model"
BLOCK_SIZE = 2


class _Instance:
    """One engine's KV cache manager with offload tiers, published under `instance_id`."""

    def __init__(self, url: str, instance_id: str, directory: Path) -> None:
        self.instance_id = instance_id
        self.lock = threading.Lock()  # the publisher thread reads the tiers in its snapshots
        caches = [torch.zeros((8, 2, BLOCK_SIZE, 1, 2)) for _ in range(2)]
        self.kv = KVCacheManager(8, BLOCK_SIZE)
        self.offload = KVOffload(caches, 4, DiskTierConfig(directory, 6))
        self.kv.attach_offload(self.offload)
        self.publisher = BlockEventPublisher(
            url, MODEL, instance_id, self.snapshot, heartbeat_ttl_s=5.0, tier_snapshot=self.tier_snapshot
        )
        self.kv.pool.on_stored = self.publisher.on_stored
        self.kv.pool.on_removed = self.publisher.on_removed
        self.offload.on_event = lambda tier, stored, hashes: self.publisher.on_tier_event(
            tier.value, stored, [bytes(h) for h in hashes]
        )
        self.live: list[Request] = []
        self.publisher.start()

    def snapshot(self) -> list[bytes]:
        with self.lock:
            return [bytes(h) for h in self.kv.pool.cached_hashes()]

    def tier_snapshot(self) -> dict[str, list[bytes]]:
        with self.lock:
            return {t.value: [bytes(h) for h in self.offload.hashes(t)] for t in (Tier.HOST, Tier.DISK)}

    def admit(self, request: Request) -> None:
        with self.lock:
            computed, num_cached = self.kv.get_computed_blocks(request)
            if self.kv.allocate_slots(request, request.num_tokens - num_cached, computed):
                self.live.append(request)
            else:
                self.kv.free(request)

    def finish(self, rng: random.Random) -> None:
        with self.lock:
            if self.live:
                self.kv.free(self.live.pop(rng.randrange(len(self.live))))

    def truth(self, chain: list[BlockHash]) -> TierOverlap | None:
        counts = {"device": 0, "host": 0, "disk": 0}
        host, disk = set(self.offload.hashes(Tier.HOST)), set(self.offload.hashes(Tier.DISK))
        for h in chain:
            tier = "device" if self.kv.pool.get_cached(h) is not None else "host" if h in host else (
                "disk" if h in disk else None)
            if tier is None:
                break
            counts[tier] += 1
        if not any(counts.values()):
            return None
        return TierOverlap(counts["device"], counts["host"], counts["disk"])


@pytest.fixture
def server() -> Iterator[EmbeddedRedis]:
    with start_embedded_redis() as embedded:
        yield embedded


def _request(request_id: str, prompt: list[int]) -> Request:
    request = Request(RequestId(request_id), list(prompt), SamplingParams(max_tokens=1), None, 1)
    request.update_block_hashes(BLOCK_SIZE)
    return request


def test_tier_lookups_agree_with_the_tiers_through_evictions_and_restarts(
    server: EmbeddedRedis, tmp_path: Path
) -> None:
    rng = random.Random(11)
    families = [[rng.randrange(1000) for _ in range(12)] for _ in range(5)]
    prompts = [f[:n] + [7] for f in families for n in (4, 8, 12)]
    instances = [_Instance(server.url, f"i{k}", tmp_path / f"i{k}") for k in range(2)]
    index = PrefixIndex(server.url, MODEL, timeout_s=1.0)
    try:
        seen_tiers: set[str] = set()
        for step in range(240):
            k = rng.randrange(len(instances))
            if step % 80 == 79:  # a restart: a new engine (empty tiers) under the same id, a new epoch
                instances[k].publisher.close()
                instances[k] = _Instance(server.url, f"i{k}", tmp_path / f"i{k}")
            elif rng.random() < 0.55:
                instances[k].admit(_request(f"r{step}", rng.choice(prompts)))
            else:
                instances[k].finish(rng)
            if step % 20 == 19:
                for inst in instances:
                    assert inst.publisher.flush()
                for prompt in prompts:
                    chain = _request("probe", prompt).block_hashes
                    truth = {i.instance_id: t for i in instances if (t := i.truth(chain)) is not None}
                    assert index.tier_overlap([bytes(h) for h in chain]) == truth
                    for t in truth.values():
                        seen_tiers |= {name for name, n in zip(("device", "host", "disk"), (
                            t.num_device, t.num_host, t.num_disk), strict=True) if n}
        assert seen_tiers == {"device", "host", "disk"}, "the sequence should exercise every tier"
    finally:
        index.close()
        for inst in instances:
            inst.publisher.close()


def test_a_worker_publishes_its_engines_tiers(server: EmbeddedRedis, smollm2: LLM) -> None:
    """The serving process's wiring: device and host-tier events of a real engine reach the index."""
    block_bytes = sum(c[0].numel() * c.element_size() for c in smollm2.core.runner.kv_caches)
    llm = smollm2.derive(num_blocks=8, max_model_len=128, host_kv_gib=16 * block_bytes / 2**30)
    loop = EngineLoop(llm.core, llm.tokenizer)
    publisher = _start_publisher(argparse.Namespace(redis_url=server.url), loop, "127.0.0.1:1")
    index = PrefixIndex(server.url, llm.core.config.model.model, timeout_s=1.0)
    try:
        prompt = list(range(1000, 1040))  # 2 full blocks
        greedy = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
        for request_id, tokens in (("a", prompt), ("b", list(range(2000, 2120)))):  # b evicts a's blocks
            list(loop.add(loop.core.make_request(request_id, tokens, greedy)))
        assert publisher.flush()
        chain = [bytes(h) for h in _request16(prompt)]
        assert index.tier_overlap(chain) == {"colocated@127.0.0.1:1": TierOverlap(0, 2, 0)}
        list(loop.add(loop.core.make_request("c", prompt, greedy)))  # loads them back to the device
        assert publisher.flush()
        assert index.tier_overlap(chain)["colocated@127.0.0.1:1"].num_device == 2
    finally:
        index.close()
        publisher.close()
        loop.stop()


def _request16(prompt: list[int]) -> list[BlockHash]:
    request = Request(RequestId("probe"), list(prompt), SamplingParams(max_tokens=1), None, 1)
    request.update_block_hashes(16)
    return request.block_hashes


def test_tier_lookup_reads_an_instance_without_tiers_as_device_only(server: EmbeddedRedis) -> None:
    """Instances that publish only the device set (no tiers, or an older publisher) still count."""
    chain = [bytes([i]) * 16 for i in range(1, 6)]
    publisher = BlockEventPublisher(server.url, MODEL, "plain", lambda: chain[:3], heartbeat_ttl_s=5.0)
    publisher.start()
    index = PrefixIndex(server.url, MODEL, timeout_s=1.0)
    try:
        assert publisher.flush()
        assert index.overlap(chain) == {"plain": 3}
        assert index.tier_overlap(chain) == {"plain": TierOverlap(3, 0, 0)}
        publisher.on_tier_event("host", True, chain[3:4])
        assert publisher.flush()
        assert index.overlap(chain) == {"plain": 3}  # the device-only lookup is unchanged
        assert index.tier_overlap(chain) == {"plain": TierOverlap(3, 1, 0)}
    finally:
        index.close()
        publisher.close()
