"""The health service tells the truth: a real gRPC server whose HealthReporter watches a
problem function flips to NOT_SERVING within a second, back when the problem clears, and
stays NOT_SERVING once draining."""

from __future__ import annotations

import time

from vllm_cluster.worker.rpc import HealthReporter, check_health, make_channel, make_server


def _wait_for(channel, expected: bool, timeout_s: float = 3.0) -> float:  # type: ignore[no-untyped-def]
    start = time.monotonic()
    while check_health(channel) != expected:
        assert time.monotonic() - start < timeout_s, f"health never became {expected}"
        time.sleep(0.05)
    return time.monotonic() - start


def test_health_follows_the_problem_and_the_drain() -> None:
    server, port, health = make_server("127.0.0.1:0", ["vllm_cluster.DecodeWorker"])
    problem: list[str] = []
    reporter = HealthReporter(health, ["vllm_cluster.DecodeWorker"], lambda: problem[0] if problem else None, 0.1)
    server.start()
    channel = make_channel(f"127.0.0.1:{port}")
    try:
        assert check_health(channel) and check_health(channel, "vllm_cluster.DecodeWorker")
        problem.append("the engine loop has been stuck in one step for 130s")
        assert _wait_for(channel, False) < 1.0
        assert not check_health(channel, "vllm_cluster.DecodeWorker")
        problem.clear()
        _wait_for(channel, True)
        reporter.drain()
        assert not check_health(channel)  # at once, not at the next check
        time.sleep(0.3)
        assert not check_health(channel)  # and it stays so
    finally:
        reporter.close()
        channel.close()
        server.stop(0)
