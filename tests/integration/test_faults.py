"""Faults on a real cluster (router + 1 prefill + 2 decode over UCX): a decode instance
killed mid-stream is replaced without the client noticing, and what is left frees its
blocks. Tests that kill an instance run last in this module."""

from __future__ import annotations

import contextlib
import os
import pickle
import random
import signal
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from vllm_cluster.client import Client, ClientError
from vllm_cluster.cluster.local import LocalCluster
from vllm_cluster.engine import LLM, SamplingParams
from vllm_cluster.proto import cluster_pb2 as pb
from vllm_cluster.proto import cluster_pb2_grpc as pb_grpc
from vllm_cluster.worker.rpc import make_channel

pytestmark = pytest.mark.slow

CONFIG = Path(__file__).with_name("faults_cluster.yaml")
PROMPT = "Write a long story about a lighthouse keeper and the sea."


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    pytest.importorskip("ucxx")
    local = LocalCluster.from_yaml(CONFIG)
    local.log_dir = tmp_path_factory.mktemp("faults-cluster")
    with local:
        yield local


@pytest.fixture(scope="module")
def client(cluster: LocalCluster) -> Iterator[Client]:
    with Client(cluster.router_address, timeout_s=300) as c:
        yield c


def _decode_stats(cluster: LocalCluster) -> dict[str, pb.WorkerStats]:
    stats = {}
    for i, address in enumerate(cluster.decode_addresses):
        if cluster.process(f"decode-{i}").popen.poll() is not None:
            continue
        stub = pb_grpc.DecodeWorkerStub(make_channel(address, cluster.token))
        stats[f"decode-{i}"] = stub.Stats(pb.StatsRequest(), timeout=5)  # type: ignore[attr-defined]
    return stats


def _assert_live_blocks_return(cluster: LocalCluster, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        busy = {n: (s.num_free_blocks, s.num_total_blocks, s.num_running) for n, s in _decode_stats(cluster).items()
                if s.num_free_blocks != s.num_total_blocks or s.num_running or s.num_waiting or s.num_transferring}
        if not busy:
            return
        assert time.monotonic() < deadline, f"blocks not returned (free, total, running): {busy}"
        time.sleep(0.2)


class _Evil:
    """Unpickling this would create the marker file: nothing may unpickle it."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):  # type: ignore[no-untyped-def]
        return (os.system, (f"touch {self.marker}",))


def _listeners(cluster: LocalCluster) -> dict[str, tuple[str, int]]:
    """Every TCP listener of the cluster: gRPC, HTTP, metrics, KV transfer."""
    found = {"router grpc": cluster.router_address, "router http": cluster.http_address.removeprefix("http://")}
    for i, address in enumerate(cluster.prefill_addresses):
        found[f"prefill-{i} grpc"] = address
    for i, address in enumerate(cluster.decode_addresses):
        found[f"decode-{i} grpc"] = address
    for name, url in cluster.metrics_addresses.items():
        found[f"{name} metrics"] = url.removeprefix("http://")
    for name, stats in _decode_stats(cluster).items():
        found[f"{name} kv"] = stats.kv_endpoint.split("://")[-1]
    return {name: (a.rsplit(":", 1)[0], int(a.rsplit(":", 1)[1])) for name, a in found.items()}


def test_pickles_and_garbage_on_every_listener_are_refused(cluster: LocalCluster, client: Client,
                                                           tmp_path: Path) -> None:
    marker = tmp_path / "unpickled"
    payloads = [pickle.dumps(_Evil(marker)), random.Random(0).randbytes(64 * 1024), b"\x00" * 4096,
                b"POST /v1/completions HTTP/1.1\r\n"
                b"Content-Type: application/python-pickle\r\nContent-Length: 70\r\n\r\n"
                + pickle.dumps(_Evil(marker))[:70]]
    listeners = _listeners(cluster)
    assert len(listeners) >= 9, listeners
    for host, port in listeners.values():
        for payload in payloads:
            with socket.create_connection((host, port), timeout=5) as sock:
                sock.sendall(payload)
                sock.settimeout(2)
                with contextlib.suppress(OSError):
                    sock.recv(4096)
    time.sleep(1.0)
    assert not marker.exists(), "a listener unpickled network data"
    dead = [p.name for p in cluster.processes if p.popen.poll() is not None]
    assert not dead, f"processes died of garbage on their listeners: {dead}"
    assert client.generate(text="The capital of France is", max_tokens=4, temperature=0).finish_reason == "length"
    _assert_live_blocks_return(cluster)


def test_decode_killed_mid_stream_is_replayed_elsewhere(cluster: LocalCluster, client: Client, smollm2: LLM) -> None:
    max_tokens = 80
    expected = smollm2.generate(PROMPT, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True),
                                use_tqdm=False)[0].outputs[0]
    token_ids: list[int] = []
    text = ""
    last = None
    killed = ""
    with client.stream(text=PROMPT, max_tokens=max_tokens, temperature=0, ignore_eos=True) as stream:
        for piece in stream:
            token_ids += piece.token_ids
            text += piece.text
            last = piece
            if not killed and len(token_ids) >= 10:
                busy = [name for name, s in _decode_stats(cluster).items() if s.num_running]
                assert len(busy) == 1, busy
                killed = busy[0]
                cluster.kill(killed)
    assert killed and last is not None
    assert token_ids == expected.token_ids  # no token twice, none missing, same greedy path
    assert text == expected.text
    assert last.finish_reason == "length" and last.usage.completion_tokens == max_tokens
    assert last.timings.migrations == 1
    _assert_live_blocks_return(cluster)


def test_sigterm_drains_the_last_decode_instance(cluster: LocalCluster, client: Client) -> None:
    """SIGTERM: the request in flight finishes, new ones are refused, the process exits 0."""
    (name,) = _decode_stats(cluster)  # the one left after the test above
    process = cluster.process(name)
    with client.stream(text=PROMPT, max_tokens=40, temperature=0, ignore_eos=True) as stream:
        pieces = iter(stream)
        next(pieces)
        process.popen.send_signal(signal.SIGTERM)
        rest = list(pieces)
    assert rest[-1].finish_reason == "length" and rest[-1].usage.completion_tokens == 40
    with pytest.raises(ClientError) as error:
        client.generate(text="Hi", max_tokens=2)
    assert error.value.code.name == "UNAVAILABLE"  # no decode instance left to serve
    assert process.popen.wait(timeout=40) == 0
