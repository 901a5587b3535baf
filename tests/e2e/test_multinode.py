"""`vllm-cluster up` on a Ray cluster of two nodes that reach each other only over TCP
(tests/e2e/ray_nodes.py: two `ray start`s on loopback addresses of their own): placement
rules in the YAML put the prefill instance on one node and the decode instance on the
other, the KV crosses between them over UCX (tcp) and over gloo, every server binds its
node's own address, and greedy output equals the single-process engine's.

The Ray nodes are shared by the whole module; each test brings a cluster up and down on
them."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest

from tests.e2e.ray_nodes import RayNodes
from tests.e2e.up import ENGINE_YAML, cli
from tests.listening import listening_addresses
from vllm_cluster.client import Client, ClientError
from vllm_cluster.cluster.state import ClusterState

pytestmark = pytest.mark.slow
T = TypeVar("T")

PROMPTS = ["The capital of France is", "def fibonacci(n):\n    " * 4]
MAX_TOKENS = 8

CONFIG = ENGINE_YAML + """\
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
            completions = [client.generate(token_ids=p, max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
                           for p in prompts]
        assert [list(c.token_ids) for c in completions] == want
        for c in completions:  # the KV crossed from node_a to node_b; decode did not compute the prompt itself
            assert c.timings is not None and c.timings.num_kv_blocks_sent > 0 and not c.timings.recomputed, c.timings

        status = cli("status", *where, timeout_s=60, env=nodes.env)
        assert status.returncode == 0, status.stdout + status.stderr
    finally:
        down = cli("down", *where, timeout_s=300, env=nodes.env)
        assert down.returncode == 0, down.stdout + down.stderr


NODE_LOSS_CONFIG = ENGINE_YAML + """\
cluster:
  name: e2e-node-loss-{pid}
  ray_address: {address}
  host: node
  num_prefill: 2
  num_decode: 2
  prefill:
    placement: [{{node_a: 1}}, {{node_b: 1}}]   # prefill-0 on node_a, prefill-1 on node_b
  decode:
    placement: [{{node_a: 1}}, {{node_b: 1}}]
router:
  host: {router_host}
  port: 0
  http_port: 0
  policy: prefix_aware        # the Redis index too (on the head, with the router)
  min_prefill_tokens: 0
  queue_timeout_s: 30
  lease_s: 10                 # a reservation whose request died is freed soon
  transfer_timeout_s: 5
"""

LOAD_PROMPTS = [f"Request {i}: tell me a long story about the number {i}." for i in range(8)]
END_DEADLINE_S = 120.0  # every request in flight at the loss ends (completes or fails cleanly) within this


def test_a_lost_node_is_routed_around_and_repaired(
    nodes: RayNodes, reference: tuple[list[list[int]], list[list[int]]], tmp_path: Path
) -> None:
    """Every process of node_b SIGKILLed under load: each request in flight completes
    (migrated) or ends with a clean error, new requests go to node_a's instances and answer
    as before, the Redis index forgets node_b's instances, `status` names the node and what
    it took, no KV block stays held, and `repair` places the lost instances again once the
    node is back."""
    pytest.importorskip("ucxx")
    a, b = nodes.nodes["node_a"].ip, nodes.nodes["node_b"].ip
    config = tmp_path / "cluster.yaml"
    config.write_text(NODE_LOSS_CONFIG.format(pid=os.getpid(), address=nodes.address, router_host=a))
    where = ["-f", str(config), "--state-dir", str(tmp_path / "state")]
    up = cli("up", *where, "--detach", timeout_s=600, env=nodes.env)
    try:
        assert up.returncode == 0, up.stdout + up.stderr
        state = ClusterState.load(next((tmp_path / "state").glob("*.json")))
        on_b = sorted(r.name for r in state.processes if r.node_ip == b)
        assert on_b == ["decode-1", "prefill-1"], {r.name: r.node_ip for r in state.processes}

        load = _Load(state.router_address, LOAD_PROMPTS)
        load.wait_for_tokens()
        nodes.kill("node_b")
        outcomes = load.join(END_DEADLINE_S)
        assert len(outcomes) == len(LOAD_PROMPTS), f"requests still hanging: {outcomes}"
        unclean = [o for o in outcomes if o not in ("completed", "UNAVAILABLE", "ABORTED", "INTERNAL",
                                                     "RESOURCE_EXHAUSTED", "DEADLINE_EXCEEDED")]
        assert not unclean, outcomes
        assert outcomes.count("completed") >= len(LOAD_PROMPTS) // 2, outcomes

        router_log = Path(state.record("router").log_file).read_text().splitlines()
        for name in on_b:  # the router took each of them out of routing
            assert any(f"{name} at " in line and "is unhealthy" in line for line in router_log), router_log[-30:]
        prompts, want = reference  # the survivors answer as a single process does
        with Client(state.router_address, timeout_s=60) as client:
            got = [list(client.generate(token_ids=p, max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True).token_ids)
                   for p in prompts]
        assert got == want

        lost_ids = {f"{r.role}@{r.address}" for r in state.processes if r.node_ip == b}
        kept_ids = {f"{r.role}@{r.address}" for r in state.processes if r.node_ip == a and r.role in ("prefill",
                                                                                                      "decode")}
        published = _wait_for(lambda: _published_instances(state.redis_url), lambda ids: not ids & lost_ids, 30.0)
        assert not published & lost_ids and kept_ids <= published, published

        status = cli("status", *where, timeout_s=60, env=nodes.env)
        assert status.returncode == 1, status.stdout + status.stderr
        assert f"node {b} is gone: prefill-1, decode-1" in status.stdout, status.stdout

        in_use = _wait_for(lambda: _blocks_in_use(state, b), lambda held: not held, 60.0)
        assert not in_use, f"KV blocks held once idle: {in_use}"

        nodes.restart("node_b")
        repair = cli("repair", *where, timeout_s=600, env=nodes.env)
        assert repair.returncode == 0, repair.stdout + repair.stderr
        assert "prefill-1" in repair.stdout and "decode-1" in repair.stdout, repair.stdout
        status = _wait_for(lambda: cli("status", *where, timeout_s=60, env=nodes.env),
                           lambda done: done.returncode == 0, 60.0)
        assert status.returncode == 0, status.stdout + status.stderr
        repaired = ClusterState.load(next((tmp_path / "state").glob("*.json")))
        assert {r.name: r.address for r in repaired.processes} == {r.name: r.address for r in state.processes}
        with Client(state.router_address, timeout_s=60) as client:
            got = [list(client.generate(token_ids=p, max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True).token_ids)
                   for p in prompts]
        assert got == want
    finally:
        down = cli("down", *where, timeout_s=300, env=nodes.env)
        assert down.returncode == 0, down.stdout + down.stderr


class _Load:
    """One streaming request per prompt, each in a thread; the outcome of each: "completed"
    or the gRPC status code's name of its clean error."""

    def __init__(self, address: str, prompts: list[str]) -> None:
        self.address = address
        self.outcomes: list[str] = []
        self.first_token = threading.Event()
        self.threads = [threading.Thread(target=self._run, args=(p,), daemon=True) for p in prompts]
        for thread in self.threads:
            thread.start()

    def _run(self, prompt: str) -> None:
        try:
            with Client(self.address, timeout_s=END_DEADLINE_S) as client, \
                    client.stream(prompt, max_tokens=64, temperature=0, ignore_eos=True) as stream:
                for _ in stream:
                    self.first_token.set()
            self.outcomes.append("completed")
        except ClientError as e:
            self.outcomes.append(e.code.name)

    def wait_for_tokens(self) -> None:
        assert self.first_token.wait(timeout=120), "no request streamed a token"

    def join(self, timeout_s: float) -> list[str]:
        deadline = time.monotonic() + timeout_s
        for thread in self.threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        return list(self.outcomes)


def _wait_for(probe: Callable[[], T], done: Callable[[T], bool], timeout_s: float) -> T:
    deadline = time.monotonic() + timeout_s
    while not done(value := probe()) and time.monotonic() < deadline:
        time.sleep(0.5)
    return value


def _published_instances(redis_url: str) -> set[str]:
    """The instance ids whose epoch key is live in the prefix index."""
    import redis

    client = redis.Redis.from_url(redis_url)
    try:
        return {key.decode().rsplit(":epoch:", 1)[1] for key in client.scan_iter(match="vc:*:epoch:*")}
    finally:
        client.close()


def _blocks_in_use(state: ClusterState, lost_node: str) -> dict[str, int]:
    """KV blocks held per surviving instance (none once idle, unless some leaked)."""
    import grpc

    from vllm_cluster.proto import cluster_pb2 as pb
    from vllm_cluster.proto import cluster_pb2_grpc as pb_grpc
    from vllm_cluster.worker.rpc import make_channel

    stubs: dict[str, Any] = {"prefill": pb_grpc.PrefillWorkerStub, "decode": pb_grpc.DecodeWorkerStub}
    held = {}
    for record in state.processes:
        if record.role in stubs and record.node_ip != lost_node:
            channel = make_channel(record.address, state.token)
            try:
                stats = stubs[record.role](channel).Stats(pb.StatsRequest(), timeout=5.0)
            except grpc.RpcError:
                held[record.name] = -1  # no answer from a survivor
                continue
            finally:
                channel.close()
            busy = stats.num_running or stats.num_waiting or stats.num_transferring
            if busy or stats.num_free_blocks != stats.num_total_blocks:
                held[record.name] = stats.num_total_blocks - stats.num_free_blocks
    return held
