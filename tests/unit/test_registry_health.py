"""The router's view of an instance's health: liveness, not speed. A busy instance whose
Stats answer late is slow, not dead; only a run of missed polls, or an instance that
cannot be reached or says it cannot serve, is unhealthy; an answer makes it healthy again.
Real gRPC servers over loopback."""

from __future__ import annotations

import time
from collections.abc import Iterator

import grpc
import pytest

from vllm_cluster.proto import cluster_pb2 as pb
from vllm_cluster.proto import cluster_pb2_grpc as pb_grpc
from vllm_cluster.router.registry import MISSES_BEFORE_DEAD, Registry
from vllm_cluster.worker.rpc import make_server

POLL_TIMEOUT_S = 0.3


class _Decode(pb_grpc.DecodeWorkerServicer):
    def __init__(self) -> None:
        self.delay_s = 0.0
        self.problem = ""

    def Stats(self, request: pb.StatsRequest, context: grpc.ServicerContext) -> pb.WorkerStats:
        if self.problem:
            context.abort(grpc.StatusCode.UNAVAILABLE, self.problem)
        time.sleep(self.delay_s)
        return pb.WorkerStats(num_running=3)


@pytest.fixture
def served() -> Iterator[tuple[_Decode, Registry, grpc.Server]]:
    decode = _Decode()
    server, port, _ = make_server("127.0.0.1:0", ["vllm_cluster.DecodeWorker"])
    pb_grpc.add_DecodeWorkerServicer_to_server(decode, server)
    server.start()
    # An interval of an hour: the poller thread stays out of the way; the test polls.
    registry = Registry([], [f"127.0.0.1:{port}"], None, interval_s=3600, poll_timeout_s=POLL_TIMEOUT_S)
    yield decode, registry, server
    registry.close()
    server.stop(0)


def test_a_slow_instance_stays_healthy_until_a_run_of_misses(served) -> None:  # type: ignore[no-untyped-def]
    decode, registry, _ = served
    instance = registry.instances["decode-0"]
    assert instance.healthy and instance.stats.num_running == 3
    decode.delay_s = 2 * POLL_TIMEOUT_S
    for _ in range(MISSES_BEFORE_DEAD - 1):
        registry.poll()
        assert instance.healthy, "one late answer is load, not death"
    registry.poll()
    assert not instance.healthy and instance.missed_polls == MISSES_BEFORE_DEAD
    decode.delay_s = 0.0
    time.sleep(2 * POLL_TIMEOUT_S)  # the late handlers finish
    registry.poll()
    assert instance.healthy and instance.missed_polls == 0


def test_an_instance_that_says_it_cannot_serve_is_unhealthy_at_once(served) -> None:  # type: ignore[no-untyped-def]
    decode, registry, _ = served
    decode.problem = "the engine loop died"
    registry.poll()
    assert not registry.instances["decode-0"].healthy


def test_an_unreachable_instance_is_unhealthy_at_once(served) -> None:  # type: ignore[no-untyped-def]
    _, registry, server = served
    server.stop(0).wait()
    registry.poll()
    assert not registry.instances["decode-0"].healthy


def test_one_poll_asks_every_instance_and_judges_each_alone() -> None:
    slow, fast = _Decode(), _Decode()
    servers, addresses = [], []
    for servicer in (slow, fast):
        server, port, _ = make_server("127.0.0.1:0", ["vllm_cluster.DecodeWorker"])
        pb_grpc.add_DecodeWorkerServicer_to_server(servicer, server)
        server.start()
        servers.append(server)
        addresses.append(f"127.0.0.1:{port}")
    registry = Registry([], addresses, None, interval_s=3600, poll_timeout_s=POLL_TIMEOUT_S)
    try:
        slow.delay_s = 2 * POLL_TIMEOUT_S
        registry.poll()
        first, second = registry.instances["decode-0"], registry.instances["decode-1"]
        assert (first.missed_polls, second.missed_polls) == (1, 0)
        assert first.healthy and second.healthy
    finally:
        registry.close()
        for server in servers:
            server.stop(0)
