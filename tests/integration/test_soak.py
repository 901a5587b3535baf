"""A bounded soak on a real 2 prefill + 2 decode cluster: random client aborts, deadlines
and timeouts while the transport drops, corrupts and delays KV chunks. Every request ends
(completed or a clean error) and no instance leaks a block. `benchmarks/soak.py` runs the
long version."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from vllm_cluster.cluster.local import LocalCluster
from vllm_cluster.loadtest.soak import soak
from vllm_cluster.proto import cluster_pb2 as pb
from vllm_cluster.proto import cluster_pb2_grpc as pb_grpc
from vllm_cluster.worker.rpc import make_channel

pytestmark = pytest.mark.slow

CONFIG = Path(__file__).with_name("soak_cluster.yaml")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    pytest.importorskip("ucxx")
    local = LocalCluster.from_yaml(CONFIG)  # cluster.kv_faults: the prefill instances inject faults
    assert local.config.kv_faults
    local.log_dir = tmp_path_factory.mktemp("soak-cluster")
    with local:
        yield local


def worker_stats(cluster: LocalCluster) -> dict[str, pb.WorkerStats]:
    stats = {}
    for i, address in enumerate(cluster.prefill_addresses):
        prefill = pb_grpc.PrefillWorkerStub(make_channel(address, cluster.token))
        stats[f"prefill-{i}"] = prefill.Stats(pb.StatsRequest(), timeout=5)  # type: ignore[attr-defined]
    for i, address in enumerate(cluster.decode_addresses):
        decode = pb_grpc.DecodeWorkerStub(make_channel(address, cluster.token))
        stats[f"decode-{i}"] = decode.Stats(pb.StatsRequest(), timeout=5)  # type: ignore[attr-defined]
    return stats


def test_soak_every_request_ends_and_no_block_leaks(cluster: LocalCluster) -> None:
    report = soak(cluster.router_address, lambda: worker_stats(cluster), num_requests=120, concurrency=12, seed=1)
    assert sum(report.outcomes.values()) == 120
    assert not report.unclean, f"requests that ended badly: {report.unclean} (all: {dict(report.outcomes)})"
    assert report.outcomes["completed"] >= 50 and report.outcomes["aborted"] > 0
    assert report.num_recomputed > 0, "no injected transport fault reached decode: the test proves nothing"
    assert not report.leaked_blocks, f"blocks leaked: {report.leaked_blocks}"
    assert all(p.popen.poll() is None for p in cluster.processes)
