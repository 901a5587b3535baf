"""The router's admission queue: bounded, counts exactly, and a waiter never sleeps past
its poll interval (so it sees its deadline and any freed room). The queue's behaviour in a
real cluster (shedding with RESOURCE_EXHAUSTED / 429) is tested in tests/integration."""

from __future__ import annotations

import threading
import time

from vllm_cluster.router.admission import MAX_RETRY_AFTER_S, AdmissionQueue


def test_bound_and_count() -> None:
    queue = AdmissionQueue(max_queued=2)
    assert queue.enter() and queue.enter()
    assert not queue.enter() and queue.num_queued == 2
    queue.leave()
    assert queue.enter() and queue.num_queued == 2
    assert not AdmissionQueue(max_queued=0).enter()


def test_room_freed_wakes_a_waiter() -> None:
    queue = AdmissionQueue(max_queued=1)
    woke = threading.Event()

    def waiter() -> None:
        queue.wait_for_room(timeout_s=60.0)
        woke.set()

    thread = threading.Thread(target=waiter)
    thread.start()
    try:
        time.sleep(0.05)  # let it start waiting
        queue.room_freed()
        # Woken by the notify, or at the latest by its 0.2 s poll: never the 60 s it was given.
        assert woke.wait(timeout=5.0)
    finally:
        thread.join(timeout=5.0)


def test_wait_ends_at_its_timeout_without_room() -> None:
    queue = AdmissionQueue(max_queued=1)
    start = time.monotonic()
    queue.wait_for_room(timeout_s=0.0)
    assert time.monotonic() - start < 5.0


def test_retry_after_is_the_time_the_queue_needs_at_the_recent_departure_rate() -> None:
    queue = AdmissionQueue(max_queued=100)
    assert queue.retry_after_s() == 1  # no departures yet: no rate to go by
    for _ in range(10):  # 10 requests leave within a second: at least 10 per second
        queue.room_freed()
    assert queue.retry_after_s() == 1
    for _ in range(49):
        assert queue.enter()
    assert queue.retry_after_s() == 5  # 50 ahead (49 queued and this one) at 10 per second
    for _ in range(49):
        queue.leave()
    big = AdmissionQueue(max_queued=10_000)
    big.room_freed()
    for _ in range(5000):
        big.enter()
    assert big.retry_after_s() == MAX_RETRY_AFTER_S
