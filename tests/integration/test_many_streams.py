"""More streams at once than the servers' threads once allowed: every one completes, and
the decode instance stays healthy meanwhile (its Stats polls find a thread), so load is
never mistaken for failure; over HTTP, bursts of 200 and 1,000 requests are answered or
refused with 429, never a 5xx."""

from __future__ import annotations

import asyncio
import threading
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from vllm_cluster.client import Client
from vllm_cluster.cluster.local import LocalCluster
from vllm_cluster.proto import cluster_pb2 as pb
from vllm_cluster.proto import cluster_pb2_grpc as pb_grpc
from vllm_cluster.worker.main import cluster_token
from vllm_cluster.worker.rpc import TOKEN_ENV, make_channel

pytestmark = pytest.mark.slow

CONFIG = Path(__file__).with_name("many_streams_cluster.yaml")
NUM_STREAMS = 200  # the servers' thread pools used to be 64: past that nothing new started
OUTPUT_LEN = 300  # a few seconds per stream: longer than the router's Stats timeout


@pytest.fixture(scope="module")
def cluster() -> Iterator[LocalCluster]:
    with LocalCluster.from_yaml(CONFIG) as running:
        yield running


def test_every_stream_of_a_burst_completes_and_decode_stays_healthy(
    cluster: LocalCluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(TOKEN_ENV, cluster.token)
    stub = pb_grpc.DecodeWorkerStub(make_channel(cluster.decode_addresses[0], cluster_token()))
    unhealthy: list[str] = []
    done = threading.Event()

    def watch() -> None:  # the router's own poll, at a stricter timeout
        while not done.wait(0.2):
            try:
                stub.Stats(pb.StatsRequest(), timeout=2.0)
            except Exception as e:  # noqa: BLE001 - any failure to answer counts
                unhealthy.append(repr(e))

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    client = Client(cluster.router_address)
    prompts = [[(7 * i + j) % 500 + 1 for j in range(16)] for i in range(NUM_STREAMS)]
    try:
        with ThreadPoolExecutor(NUM_STREAMS) as pool:
            results = list(pool.map(
                lambda p: client.generate(token_ids=p, max_tokens=OUTPUT_LEN, temperature=0, ignore_eos=True),
                prompts))
    finally:
        done.set()
        watcher.join()
        client.close()
    assert [len(r.token_ids) for r in results] == [OUTPUT_LEN] * NUM_STREAMS
    assert all(r.finish_reason == "length" for r in results)
    assert not unhealthy, unhealthy[:3]


@pytest.mark.parametrize("num_requests", [200, 1000])
def test_a_burst_of_http_requests_gets_answers_or_429_never_5xx(cluster: LocalCluster, num_requests: int) -> None:
    """Through the router's HTTP front, all at once: each is answered in full or refused with
    429 (the decode batch and the admission queue are full), none with a 5xx."""
    aiohttp = pytest.importorskip("aiohttp")

    async def one(session: Any, i: int) -> tuple[int, Any]:
        body = {"prompt": [(11 * i + j) % 500 + 1 for j in range(16)], "max_tokens": 16, "temperature": 0,
                "ignore_eos": True}
        async with session.post(f"{cluster.http_address}/v1/completions", json=body) as response:
            return response.status, await response.json()

    async def burst() -> list[tuple[int, Any]]:
        connector = aiohttp.TCPConnector(limit=0)  # every request on its own connection, at once
        timeout = aiohttp.ClientTimeout(total=600)
        async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
            return await asyncio.gather(*(one(session, i) for i in range(num_requests)))

    answers = asyncio.run(burst())
    statuses = Counter(status for status, _ in answers)
    assert set(statuses) <= {200, 429}, statuses
    assert statuses[200] >= min(num_requests, 256), statuses  # at least a full batch is served
    for status, body in answers:
        if status == 200:
            assert body["usage"]["completion_tokens"] == 16 and body["choices"][0]["finish_reason"] == "length"
        else:
            assert body["error"]["code"] == 429
