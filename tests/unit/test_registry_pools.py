"""Pools that change while the router serves: the registry adds an instance (routed to from
its first healthy poll), removes one (out of routing at once, draining until its requests
are done, then forgotten), and names what it adds. Real gRPC servers over loopback."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import grpc
import pytest

from vllm_cluster.engine.config import EngineRole
from vllm_cluster.proto import cluster_pb2 as pb
from vllm_cluster.proto import cluster_pb2_grpc as pb_grpc
from vllm_cluster.router.registry import Registry
from vllm_cluster.worker.rpc import make_server


class _Decode(pb_grpc.DecodeWorkerServicer):
    def Stats(self, request: pb.StatsRequest, context: grpc.ServicerContext) -> pb.WorkerStats:
        return pb.WorkerStats(num_waiting=2)


@pytest.fixture
def addresses() -> Iterator[list[str]]:
    servers, addresses = [], []
    for _ in range(3):
        server, port, _ = make_server("127.0.0.1:0", ["vllm_cluster.DecodeWorker"])
        pb_grpc.add_DecodeWorkerServicer_to_server(_Decode(), server)
        server.start()
        servers.append(server)
        addresses.append(f"127.0.0.1:{port}")
    yield addresses
    for server in servers:
        server.stop(0)


@pytest.fixture
def registry(addresses: list[str]) -> Iterator[Registry]:
    # An interval of an hour: the poller thread stays out of the way; the test polls.
    registry = Registry([], addresses[:1], None, interval_s=3600, poll_timeout_s=1.0)
    yield registry
    registry.close()


def _names(registry: Registry) -> list[str]:
    return [load.name for load in registry.loads(EngineRole.DECODE) if load.healthy]


def test_an_added_instance_is_routed_to_from_its_first_healthy_poll(registry: Registry, addresses: list[str]) -> None:
    assert registry.add(EngineRole.DECODE, addresses[1]) == ("decode-1", True)
    assert _names(registry) == ["decode-0"], "not before a poll has found it healthy"
    registry.poll()
    assert _names(registry) == ["decode-0", "decode-1"]
    assert registry.instances["decode-1"].stats.num_waiting == 2
    assert registry.add(EngineRole.DECODE, addresses[1]) == ("decode-1", False)
    assert registry.add(EngineRole.DECODE, addresses[2], "decode-7") == ("decode-7", True)
    # A name another instance has (a router restarted with its old list): the next free one.
    assert registry.add(EngineRole.DECODE, "127.0.0.1:2", "decode-0") == ("decode-2", True)
    assert registry.add(EngineRole.PREFILL, "127.0.0.1:1") == ("prefill-0", True)
    assert [i.name for i in registry.of_role(EngineRole.PREFILL)] == ["prefill-0"]


def test_a_removed_instance_drains_then_is_forgotten(registry: Registry, addresses: list[str]) -> None:
    registry.add(EngineRole.DECODE, addresses[1])
    registry.poll()
    held = registry.acquire("decode-1")  # a request on it
    assert registry.remove(addresses[1]) == (True, 1)
    assert _names(registry) == ["decode-0"], "no new request goes to it"
    assert [i.name for i in registry.draining()] == ["decode-1"]
    assert registry.acquire("decode-1") is held, "a request ranked onto it just before still gets it"
    registry.release(held)
    assert registry.remove(addresses[1]) == (True, 1)
    registry.release(held)
    assert registry.remove(addresses[1]) == (True, 0)
    assert registry.draining() == []
    assert registry.remove(addresses[1]) == (False, 0)
    assert registry.remove("127.0.0.1:1") == (False, 0)
    # Added again at the same address (scaled back up): a new instance, a new name.
    assert registry.add(EngineRole.DECODE, addresses[1]) == ("decode-2", True)
    assert registry.add(EngineRole.DECODE, addresses[2], "decode-1") == ("decode-1", True), "its name is free"


def test_adds_and_removes_from_many_threads_keep_the_counts(registry: Registry, addresses: list[str]) -> None:
    def churn(k: int) -> None:
        address = f"127.0.0.1:{2 + k}"  # nothing listens there: never healthy, never routed
        for _ in range(50):
            registry.add(EngineRole.DECODE, address)
            registry.remove(address)
            registry.remove(address)

    threads = [threading.Thread(target=churn, args=(k,)) for k in range(4)]
    for thread in threads:
        thread.start()
    for _ in range(20):
        registry.poll()
    for thread in threads:
        thread.join()
    assert [i.name for i in registry.of_role(EngineRole.DECODE)] == ["decode-0"]
    assert registry.draining() == []
    assert _names(registry) == ["decode-0"]
