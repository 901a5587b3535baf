"""Publishes one engine instance's prefix-cache contents to the Redis prefix index.

Lifecycle:
  1. Construct with a fresh random epoch; wire `on_stored`/`on_removed` to the BlockPool,
     and `on_tier_event` to the KV offload tiers if the engine has them (`tier_snapshot`
     then lists what each tier holds).
  2. `start()`: a daemon thread publishes `snapshot()` under the epoch (the set first, then
     the epoch key, in one MULTI), then every `flush_interval_s` writes the buffered events
     in one pipeline and every `heartbeat_ttl_s / 3` refreshes the epoch key's and the set's
     TTL.
  3. Redis unreachable, slow (over `timeout_s`) or erroring: the events are dropped, one
     warning per outage is logged, `num_failures` counts each failed attempt, and a new
     attempt is made every `heartbeat_ttl_s / 3`. The attempt that succeeds publishes the
     whole `snapshot()` under a NEW epoch, so nothing lost in the outage lingers. The same
     happens when a heartbeat finds its epoch key gone (Redis lost its data, or this thread
     stalled past the TTL).
  4. `close()`: stops the thread, deletes the set and (if still ours) the epoch key, so the
     instance stops counting at once. A process that dies instead stops counting when its
     epoch key expires, at most `heartbeat_ttl_s` later; its set follows.

Invariants:
  - `on_stored`/`on_removed` run on the engine thread: they only append to a deque. They
    never block on Redis and never raise.
  - Events are applied in order: each flush writes the last event of every hash in it, so
    stored-then-removed ends removed.
  - A resync drains the buffer BEFORE calling `snapshot()`. Events that race in between are
    then both in the snapshot and in the buffer; re-applying them is harmless because an
    event sets a hash's membership, and the last one wins.
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence

import redis

from vllm_cluster.kv_index.schema import HEARTBEAT, TIERS, UNREGISTER, IndexKeys, connect, run_script

logger = logging.getLogger(__name__)

# Members per SADD/SREM command: keeps each command (and Redis's pause for it) small.
_CHUNK = 8192
_CLOSE_TIMEOUT_S = 5.0


def _new_epoch() -> str:
    return secrets.token_hex(8)


def _chunks(items: list[bytes]) -> Iterable[list[bytes]]:
    for i in range(0, len(items), _CHUNK):
        yield items[i : i + _CHUNK]


class _FlushWaiter:
    """A marker in the event queue: set once every event queued before it is in Redis (or dropped)."""

    __slots__ = ("done", "ok")

    def __init__(self) -> None:
        self.done = threading.Event()
        self.ok = False

    def finish(self, ok: bool) -> None:
        self.ok = ok
        self.done.set()


_Event = tuple[str, bool, tuple[bytes, ...]]  # (tier, stored?, block hashes)


class BlockEventPublisher:
    def __init__(
        self,
        redis_url: str,
        model: str,
        instance_id: str,
        snapshot: Callable[[], Iterable[bytes]],
        heartbeat_ttl_s: float = 3.0,
        flush_interval_s: float = 0.02,
        timeout_s: float = 0.2,
        tier_snapshot: Callable[[], dict[str, list[bytes]]] | None = None,
    ) -> None:
        """`tier_snapshot`: {"host": hashes, "disk": hashes} held below the device now."""
        assert instance_id, "instance_id must not be empty"
        assert heartbeat_ttl_s > 0 and flush_interval_s > 0 and timeout_s > 0
        self.instance_id = instance_id
        self.epoch = _new_epoch()
        self.heartbeat_ttl_s = heartbeat_ttl_s
        self.flush_interval_s = flush_interval_s
        self.num_failures = 0  # failed attempts to reach Redis
        self.num_resyncs = 0  # full snapshots published, the first one included
        self._keys = IndexKeys(model)
        self._snapshot = snapshot
        self._tier_snapshot = tier_snapshot
        self._client = connect(redis_url, timeout_s)
        self._ttl_ms = max(1, int(heartbeat_ttl_s * 1000))
        self._heartbeat_interval_s = heartbeat_ttl_s / 3
        self._queue: deque[_Event | _FlushWaiter] = deque()
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        self._closed = False
        self._synced = False  # the current epoch's set mirrors the pool, up to the queue
        self._epoch_fresh = True  # nothing was written under self.epoch yet
        self._in_outage = False
        self._next_heartbeat_at = 0.0
        self._next_resync_at = 0.0

    # -- engine thread -------------------------------------------------------------------

    def on_stored(self, block_hashes: Sequence[bytes]) -> None:
        self.on_tier_event("device", True, block_hashes)

    def on_removed(self, block_hashes: Sequence[bytes]) -> None:
        self.on_tier_event("device", False, block_hashes)

    def on_tier_event(self, tier: str, stored: bool, block_hashes: Sequence[bytes]) -> None:
        """`tier` ("device", "host", "disk") now holds (`stored`) or no longer holds these blocks."""
        assert tier in TIERS, tier
        if block_hashes and not self._closed:
            self._queue.append((tier, stored, tuple(block_hashes)))

    # -- control -------------------------------------------------------------------------

    def start(self) -> None:
        assert self._thread is None, "publisher already started"
        self._thread = threading.Thread(
            target=self._run, name=f"kv-index-publisher-{self.instance_id}", daemon=True
        )
        self._thread.start()

    def flush(self, timeout_s: float = 5.0) -> bool:
        """Wait until every event given before this call is in Redis. False if they were
        dropped (Redis unavailable), the publisher is closed, or `timeout_s` passed."""
        if self._closed or self._thread is None:
            return False
        waiter = _FlushWaiter()
        self._queue.append(waiter)
        self._wake.set()
        return waiter.done.wait(timeout_s) and waiter.ok

    def close(self) -> None:
        """Stop publishing and remove this epoch's entries. Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._thread is not None:
            self._stop.set()
            self._wake.set()
            self._thread.join(timeout=_CLOSE_TIMEOUT_S)
            if self._thread.is_alive():  # stuck in snapshot(): it will not publish after this
                logger.warning("kv index: publisher thread of %s did not stop within %.0f s",
                               self.instance_id, _CLOSE_TIMEOUT_S)
        try:
            run_script(self._client, UNREGISTER, self._epoch_keys(), [self.epoch, self.instance_id])
        except redis.RedisError as exc:
            logger.warning("kv index: could not unregister %s (%s); its entries expire "
                           "within %.1f s", self.instance_id, exc, self.heartbeat_ttl_s)
        self._client.close()
        for waiter in self._drain()[1]:
            waiter.finish(False)

    # -- publisher thread ----------------------------------------------------------------

    def _run(self) -> None:
        while not self._stop.is_set():
            self._wake.clear()
            events, waiters = self._drain()
            try:
                ok = self._publish(events)
            except redis.RedisError as exc:
                self._on_failure(exc)
                ok = False
            except Exception:  # a bug (e.g. in snapshot()) must not end the thread
                logger.exception("kv index: publisher step failed for %s", self.instance_id)
                self._on_failure(None)
                ok = False
            for waiter in waiters:
                waiter.finish(ok)
            self._wake.wait(self.flush_interval_s)

    def _drain(self) -> tuple[list[_Event], list[_FlushWaiter]]:
        events: list[_Event] = []
        waiters: list[_FlushWaiter] = []
        while self._queue:
            item = self._queue.popleft()
            if isinstance(item, _FlushWaiter):
                waiters.append(item)
            else:
                events.append(item)
        return events, waiters

    def _publish(self, events: list[_Event]) -> bool:
        """Bring Redis up to date with `events`; False if they were dropped (outage)."""
        now = time.monotonic()
        if self._synced:
            if events:
                self._write(events)
            if now >= self._next_heartbeat_at and not self._heartbeat():
                logger.warning("kv index: epoch of %s vanished from Redis; republishing its "
                               "cache", self.instance_id)
                self._synced = False
        if not self._synced and now >= self._next_resync_at:
            self._resync()
        return self._synced

    def _write(self, events: list[_Event]) -> None:
        last: dict[tuple[str, bytes], bool] = {}
        for tier, stored, block_hashes in events:
            for block_hash in block_hashes:
                last[(tier, block_hash)] = stored
        pipe = self._client.pipeline(transaction=False)
        for tier in TIERS:
            added = [h for (t, h), stored in last.items() if t == tier and stored]
            removed = [h for (t, h), stored in last.items() if t == tier and not stored]
            blocks_key = self._keys.tier_blocks(self.instance_id, self.epoch, tier)
            for chunk in _chunks(removed):
                pipe.srem(blocks_key, *chunk)
            for chunk in _chunks(added):
                pipe.sadd(blocks_key, *chunk)
            if added:  # SADD may have just created the set, without a TTL
                pipe.pexpire(blocks_key, self._ttl_ms)
        pipe.execute()

    def _epoch_keys(self) -> list[str]:
        """The keys HEARTBEAT and UNREGISTER take: epoch, device set, instances, tier sets."""
        device, *tiers = self._keys.epoch_sets(self.instance_id, self.epoch)
        return [self._keys.epoch(self.instance_id), device, self._keys.instances, *tiers]

    def _heartbeat(self) -> bool:
        alive = run_script(self._client, HEARTBEAT, self._epoch_keys(),
                           [self.epoch, self._ttl_ms, self.instance_id])
        self._next_heartbeat_at = time.monotonic() + self._heartbeat_interval_s
        return bool(alive)

    def _resync(self) -> None:
        """Publish the whole snapshot under a new epoch (the constructor's, the first time)."""
        old_keys = self._keys.epoch_sets(self.instance_id, self.epoch)
        if not self._epoch_fresh:
            self.epoch = _new_epoch()
        self._epoch_fresh = False
        block_hashes = list(self._snapshot())
        held = {"device": block_hashes, **(self._tier_snapshot() if self._tier_snapshot is not None else {})}
        if self._stop.is_set():  # closed while snapshot() ran: registering now would outlive close()
            return
        pipe = self._client.pipeline(transaction=True)
        for tier in TIERS:
            key = self._keys.tier_blocks(self.instance_id, self.epoch, tier)
            pipe.delete(key)
            for chunk in _chunks(list(held.get(tier, ()))):
                pipe.sadd(key, *chunk)
            pipe.pexpire(key, self._ttl_ms)
        pipe.set(self._keys.epoch(self.instance_id), self.epoch, px=self._ttl_ms)
        pipe.sadd(self._keys.instances, self.instance_id)
        for old_key in old_keys:
            if old_key not in self._keys.epoch_sets(self.instance_id, self.epoch):
                pipe.delete(old_key)
        pipe.execute()
        self._synced = True
        self.num_resyncs += 1
        self._next_heartbeat_at = time.monotonic() + self._heartbeat_interval_s
        if self._in_outage:
            self._in_outage = False
            logger.info("kv index: Redis is back; %s republished %d blocks under epoch %s",
                        self.instance_id, len(block_hashes), self.epoch)

    def _on_failure(self, exc: Exception | None) -> None:
        self.num_failures += 1
        self._synced = False
        self._next_resync_at = time.monotonic() + self._heartbeat_interval_s
        if not self._in_outage:
            self._in_outage = True
            logger.warning("kv index: Redis unavailable for %s (%s); block events are dropped "
                           "until it is back, then the whole cache is republished",
                           self.instance_id, exc)
