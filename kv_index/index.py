"""The router's view of the Redis prefix index: which live instances hold how many leading
blocks of a prompt.

Lifecycle: construct (no I/O) -> `overlap()` (device cache only) or `tier_overlap()`
(device, host and disk tiers) per request -> `close()`.

Invariants:
  - One lookup is one round trip: the LOOKUP script walks the live instances (epoch key
    present) and counts each one's leading hashes in its current epoch's set.
  - The answer is exact at the moment the script runs (it is atomic in Redis); it lags the
    engines by the publishers' flush interval.
  - Routing never waits on Redis for longer than about `timeout_s`: on any error or timeout
    `overlap()` returns {} (the router then routes on load alone). One warning is logged per
    outage and `num_failures` counts the failed lookups. For `retry_interval_s` after a
    failure, lookups answer {} without trying, so an unreachable Redis costs each request
    nothing; the first lookup after that reconnects.
  - Safe to call from several threads (the client pools its connections).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import redis

from vllm_cluster.kv_index.schema import (
    BLOCK_HASH_BYTES,
    LOOKUP,
    TIER_LOOKUP,
    IndexKeys,
    LuaScript,
    connect,
    run_script,
)

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class TierOverlap:
    """A prompt's leading blocks one instance holds, counted in the fastest tier holding each."""

    num_device: int = 0
    num_host: int = 0
    num_disk: int = 0


class PrefixIndex:
    def __init__(
        self, redis_url: str, model: str, timeout_s: float = 0.05, retry_interval_s: float = 0.5
    ) -> None:
        assert timeout_s > 0 and retry_interval_s >= 0
        self.retry_interval_s = retry_interval_s
        self.num_failures = 0
        self._keys = IndexKeys(model)
        self._client = connect(redis_url, timeout_s)
        self._lock = threading.Lock()
        self._in_outage = False
        self._retry_at = 0.0

    def overlap(self, block_hashes: Sequence[bytes]) -> dict[str, int]:
        """{instance id: number of leading `block_hashes` it holds}, for the live instances
        holding at least one; {} when Redis is unavailable."""
        flat = self._lookup(LOOKUP, block_hashes)
        return {flat[i].decode(): int(flat[i + 1]) for i in range(0, len(flat), 2)}

    def tier_overlap(self, block_hashes: Sequence[bytes]) -> dict[str, TierOverlap]:
        """{instance id: the leading `block_hashes` it holds, by fastest tier holding each},
        for the live instances holding at least one; {} when Redis is unavailable."""
        flat = self._lookup(TIER_LOOKUP, block_hashes)
        return {
            flat[i].decode(): TierOverlap(int(flat[i + 1]), int(flat[i + 2]), int(flat[i + 3]))
            for i in range(0, len(flat), 4)
        }

    def _lookup(self, script: LuaScript, block_hashes: Sequence[bytes]) -> list[Any]:
        if not block_hashes or time.monotonic() < self._retry_at:
            return []
        blob = b"".join(block_hashes)
        assert len(blob) == BLOCK_HASH_BYTES * len(block_hashes), "block hashes are 16 bytes"
        try:
            flat = run_script(self._client, script, [self._keys.instances], [self._keys.prefix, blob])
        except redis.RedisError as exc:
            self._on_failure(exc)
            return []
        if self._in_outage:
            with self._lock:
                if self._in_outage:
                    self._in_outage = False
                    logger.info("kv index: Redis is back; prefix-aware routing resumes")
        return list(flat)

    def close(self) -> None:
        self._client.close()

    def _on_failure(self, exc: redis.RedisError) -> None:
        with self._lock:
            self.num_failures += 1
            self._retry_at = time.monotonic() + self.retry_interval_s
            if not self._in_outage:
                self._in_outage = True
                logger.warning("kv index: Redis unavailable (%s); routing on load alone until "
                               "it is back", exc)
