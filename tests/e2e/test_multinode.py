"""`vllm-cluster up` on a Ray cluster of two nodes that reach each other only over TCP
(tests/e2e/ray_nodes.py: two `ray start`s on loopback addresses of their own): placement
rules in the YAML put the prefill instance on one node and the decode instance on the
other, the KV crosses between them over UCX (tcp) and over gloo, every server binds its
node's own address, and greedy output equals the single-process engine's.

The Ray nodes are shared by the whole module; each test brings a cluster up and down on
them."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.e2e.ray_nodes import RayNodes
from tests.e2e.up import cli
from tests.listening import listening_addresses
from vllm_cluster.client import Client
from vllm_cluster.cluster.state import ClusterState

pytestmark = pytest.mark.slow

PROMPTS = ["The capital of France is", "def fibonacci(n):\n    " * 4]
MAX_TOKENS = 8

CONFIG = """\
engine:
  model:
    model: smollm2-135m-instruct
    dtype: float32
  cache:
    num_blocks: 128
  scheduler:
    max_num_seqs: 4
    max_num_batched_tokens: 128
    max_model_len: 1024
  device: cpu
  num_threads: 1
cluster:
  name: e2e-multinode-{transport}-{pid}
  ray_address: {address}
  host: node                  # each server binds the address of the node it runs on
  transport: {transport}
  num_prefill: 1
  num_decode: 1
  prefill:
    placement: [{{node_a: 1}}]
  decode:
    placement: [{{node_b: 1}}]
router:
  host: {router_host}         # the node `up` runs on (the head)
  port: 0
  http_port: 0
  min_prefill_tokens: 0       # every request crosses prefill -> decode
"""


def _ipv4(address: str) -> str:
    return address.removeprefix("::ffff:")


@pytest.fixture(scope="module")
def nodes(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RayNodes]:
    pytest.importorskip("ray")
    started = RayNodes(tmp_path_factory.mktemp("ray-nodes")).start()
    try:
        yield started
    finally:
        started.stop()


@pytest.fixture(scope="module")
def reference() -> tuple[list[list[int]], list[list[int]]]:
    """PROMPTS' token ids and the single-process engine's greedy tokens for them."""
    from vllm_cluster.engine import LLM, SamplingParams

    llm = LLM("smollm2-135m-instruct", device="cpu", dtype="float32", num_threads=1, num_blocks=64,
              max_model_len=1024)
    prompts = [llm.get_tokenizer().encode(p) for p in PROMPTS]
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    want = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]
    del llm
    return prompts, want


@pytest.mark.parametrize("transport", ["ucx", "nccl"])  # nccl is gloo between CPU caches
def test_prefill_on_one_node_decode_on_the_other(
    nodes: RayNodes, reference: tuple[list[list[int]], list[list[int]]], transport: str, tmp_path: Path
) -> None:
    if transport == "ucx":
        pytest.importorskip("ucxx")
    config = tmp_path / "cluster.yaml"
    config.write_text(CONFIG.format(transport=transport, pid=os.getpid(), address=nodes.address,
                                    router_host=nodes.nodes["node_a"].ip))
    where = ["-f", str(config), "--state-dir", str(tmp_path / "state")]
    up = cli("up", *where, "--detach", timeout_s=600, env=nodes.env)
    try:
        assert up.returncode == 0, up.stdout + up.stderr
        state = ClusterState.load(next((tmp_path / "state").glob("*.json")))
        node_of = {r.name: r.node_ip for r in state.processes}
        a, b = nodes.nodes["node_a"].ip, nodes.nodes["node_b"].ip
        assert node_of == {"prefill-0": a, "decode-0": b, "router": a}, node_of

        for record in state.processes:  # its gRPC, metrics and KV listeners: the node's address only
            bound = {_ipv4(host) for host, _ in listening_addresses(record.process.pid)}
            if transport == "ucx" and record.role != "router":
                # UCX's tcp transport binds the address of the device that holds the KV host;
                # here every node shares lo, whose address is 127.0.0.1 (a machine of its own
                # has a device of its own).
                bound.discard("127.0.0.1")
            assert bound == {record.node_ip}, f"{record.name} on {record.node_ip} listens on {bound}"
            assert record.address.startswith(f"{record.node_ip}:"), record

        prompts, want = reference
        with Client(state.router_address) as client:
            got = [list(client.generate(token_ids=p, max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True).token_ids)
                   for p in prompts]
        assert got == want

        status = cli("status", *where, timeout_s=60, env=nodes.env)
        assert status.returncode == 0, status.stdout + status.stderr
    finally:
        down = cli("down", *where, timeout_s=300, env=nodes.env)
        assert down.returncode == 0, down.stdout + down.stderr
