"""The index agrees with real BlockPools: random allocate / cache / free / reset on several
pools (one publisher each, one shared Redis), then every lookup equals the leading blocks
each pool holds. Also across a Redis stop and restart mid-run."""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable, Iterator

import pytest

from vllm_cluster.engine.block_hash import BlockHash, hash_block_tokens
from vllm_cluster.engine.block_pool import BlockId, BlockPool
from vllm_cluster.kv_index import BlockEventPublisher, EmbeddedRedis, PrefixIndex, start_embedded_redis

MODEL = "test-model"
BLOCK_SIZE = 4
NUM_BLOCKS = 40  # per pool: small, so the chains below evict each other all the time


class _Instance:
    """A BlockPool driven like KVCacheManager drives it, its events wired to a publisher."""

    def __init__(self, url: str, instance_id: str, heartbeat_ttl_s: float) -> None:
        self.instance_id = instance_id
        self.pool = BlockPool(NUM_BLOCKS)
        self.lock = threading.Lock()  # the publisher thread reads the pool in snapshot()
        self.requests: list[list[BlockId]] = []
        self.publisher = BlockEventPublisher(
            url, MODEL, instance_id, self.snapshot, heartbeat_ttl_s=heartbeat_ttl_s
        )
        self.pool.on_stored = self.publisher.on_stored
        self.pool.on_removed = self.publisher.on_removed

    def snapshot(self) -> list[BlockHash]:
        with self.lock:
            return [b.block_hash for b in self.pool.blocks if b.block_hash is not None]

    def num_leading(self, chain: list[BlockHash]) -> int:
        n = 0
        while n < len(chain) and self.pool.get_cached(chain[n]) is not None:
            n += 1
        return n

    def admit(self, chain: list[BlockHash], num_to_cache: int) -> None:
        """Take the cached prefix, allocate the rest, cache up to `num_to_cache` new blocks."""
        with self.lock:
            hit: list[BlockId] = []
            for block_hash in chain:
                block_id = self.pool.get_cached(block_hash)
                if block_id is None:
                    break
                hit.append(block_id)
            self.pool.touch(hit)
            num_new = len(chain) - len(hit)
            if num_new > self.pool.num_free_blocks:
                self.pool.free(reversed(hit))
                return
            new = self.pool.allocate(num_new)
            k = min(num_to_cache, num_new)
            self.pool.cache_blocks(new[:k], chain[len(hit) : len(hit) + k])
            self.requests.append(hit + new)

    def finish(self, rng: random.Random) -> None:
        with self.lock:
            if self.requests:
                block_ids = self.requests.pop(rng.randrange(len(self.requests)))
                self.pool.free(reversed(block_ids))  # tail first, as the engine frees

    def reset(self) -> None:
        with self.lock:
            for block_ids in self.requests:
                self.pool.free(reversed(block_ids))
            self.requests.clear()
            assert self.pool.reset_prefix_cache()


def _chains(rng: random.Random) -> list[list[BlockHash]]:
    """Chains that share prefixes: 4 roots x 3 branches x prefix cuts x 2 tenants."""
    chains = []
    for _ in range(4):
        root = [rng.randrange(50_000) for _ in range(6 * BLOCK_SIZE)]
        branches = [[rng.randrange(50_000) for _ in range(rng.randint(0, 4) * BLOCK_SIZE)] for _ in range(3)]
        for branch in branches:
            for num_root_blocks in (2, 4, 6):
                for salt in ("tenant-0", "tenant-1"):
                    tokens = root[: num_root_blocks * BLOCK_SIZE] + branch
                    chains.append(hash_block_tokens(tokens, BLOCK_SIZE, (salt,)))
    return chains


def _random_ops(instances: list[_Instance], chains: list[list[BlockHash]], rng: random.Random, num_ops: int) -> None:
    for _ in range(num_ops):
        inst = rng.choice(instances)
        r = rng.random()
        if r < 0.55:
            chain = rng.choice(chains)
            inst.admit(chain, num_to_cache=rng.choice([len(chain), len(chain), rng.randint(0, len(chain))]))
        elif r < 0.97:
            inst.finish(rng)
        else:
            inst.reset()


def _truth(instances: list[_Instance], chain: list[BlockHash]) -> dict[str, int]:
    counts = {inst.instance_id: inst.num_leading(chain) for inst in instances}
    return {instance_id: n for instance_id, n in counts.items() if n > 0}


def _check(index: PrefixIndex, instances: list[_Instance], chains: list[list[BlockHash]]) -> list[dict[str, int]]:
    for inst in instances:
        assert inst.publisher.flush(), inst.instance_id
    truths = []
    for chain in chains:
        truth = _truth(instances, chain)
        assert index.overlap(chain) == truth
        truths.append(truth)
    return truths


@pytest.fixture
def server() -> Iterator[EmbeddedRedis]:
    with start_embedded_redis() as embedded:
        yield embedded


@pytest.fixture
def cluster(server: EmbeddedRedis) -> Iterator[Callable[[int, float], list[_Instance]]]:
    made: list[_Instance] = []

    def make(num_instances: int, heartbeat_ttl_s: float) -> list[_Instance]:
        for i in range(num_instances):
            inst = _Instance(server.url, f"engine-{i}", heartbeat_ttl_s)
            inst.publisher.start()
            made.append(inst)
        return made

    yield make
    for inst in made:
        inst.publisher.close()


@pytest.mark.parametrize("seed", [0, 1])
def test_index_matches_block_pools(
    server: EmbeddedRedis, cluster: Callable[[int, float], list[_Instance]], seed: int
) -> None:
    rng = random.Random(seed)
    chains = _chains(rng)
    instances = cluster(3, 3.0)
    index = PrefixIndex(server.url, MODEL)
    num_partial = num_shared = 0
    for _ in range(100):
        _random_ops(instances, chains, rng, num_ops=15)
        for chain, truth in zip(chains, _check(index, instances, rng.sample(chains, 15)), strict=False):
            num_partial += any(0 < n < len(chain) for n in truth.values())
            num_shared += len(truth) > 1
    # The run exercised what it claims to: partial prefixes and several holders of one prefix.
    assert num_partial > 100 and num_shared > 100, (num_partial, num_shared)
    assert index.num_failures == 0
    assert all(inst.publisher.num_failures == 0 for inst in instances)
    index.close()


def test_index_recovers_after_redis_restart(
    server: EmbeddedRedis, cluster: Callable[[int, float], list[_Instance]]
) -> None:
    rng = random.Random(2)
    chains = _chains(rng)
    instances = cluster(3, 0.6)  # publishers retry every 0.2 s while Redis is away
    index = PrefixIndex(server.url, MODEL, timeout_s=0.05, retry_interval_s=0.2)
    for _ in range(5):
        _random_ops(instances, chains, rng, num_ops=15)
        _check(index, instances, chains)
    held = [c for c in chains if _truth(instances, c)]
    assert held

    server.stop()
    assert index.overlap(held[0]) == {}  # returns at once: routing falls back to load
    assert index.num_failures == 1
    _random_ops(instances, chains, rng, num_ops=30)  # the engines go on; events are dropped
    for inst in instances:
        assert not inst.publisher.flush()
        assert inst.publisher.num_failures >= 1
    epochs = [inst.publisher.epoch for inst in instances]

    server.start()  # same port, empty
    _random_ops(instances, chains, rng, num_ops=15)
    deadline = time.monotonic() + 10.0
    while not all(inst.publisher.flush() for inst in instances):
        assert time.monotonic() < deadline, "publishers did not republish after the restart"
    time.sleep(index.retry_interval_s)
    for _ in range(5):
        _check(index, instances, chains)
        _random_ops(instances, chains, rng, num_ops=15)
    assert all(inst.publisher.epoch != epoch for inst, epoch in zip(instances, epochs, strict=True))
    index.close()
