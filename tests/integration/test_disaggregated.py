"""The real cluster on loopback: 2 prefill + 2 decode processes and a router, over UCX and
over torch.distributed (gloo). Disaggregated greedy output equals colocated output, which
the correctness tests hold equal to HF; aborts, disconnects, leases and failed hand-offs
leave every instance's block pool as it was."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest

from vllm_cluster.client import Client, ClientError
from vllm_cluster.cluster.local import LocalCluster
from vllm_cluster.engine import LLM, SamplingParams
from vllm_cluster.proto import cluster_pb2 as pb
from vllm_cluster.proto import cluster_pb2_grpc as pb_grpc
from vllm_cluster.worker.rpc import TOKEN_ENV, make_channel

pytestmark = pytest.mark.slow

CONFIG = Path(__file__).with_name("cluster.yaml")

PROMPTS = [
    "The capital of France is",
    "def quicksort(arr):",
    "Write a haiku about the sea.",
    "1, 2, 3, 4,",
    "Explain what a paged KV cache is. " * 6,
    "Once upon a time in a land far away, there lived a " * 12,
    "The quick brown fox",
    "Translate to French: I love programming and long walks on the beach. " * 3,
    "Q: What is 17 * 3? A:",
    "Here is a list of fruits: apple, banana, " * 20,
    "In 1492,",
    "The mitochondria is",
    "import numpy as np\n" * 30,
    "Dear hiring manager,",
    "Roses are red, violets are blue,",
    "Summarize: The engine schedules requests under a token budget. " * 9,
]


@pytest.fixture(scope="module", params=["ucx", "nccl"])
def cluster(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    if request.param == "ucx":
        pytest.importorskip("ucxx")
    local = LocalCluster.from_yaml(CONFIG, transport=request.param)
    local.log_dir = tmp_path_factory.mktemp(f"cluster-{request.param}")
    with local:
        yield local


@pytest.fixture(scope="module")
def client(cluster: LocalCluster) -> Iterator[Client]:
    c = Client(cluster.router_address)
    yield c
    c.close()


def _worker_stubs(cluster: LocalCluster) -> list[tuple[str, object]]:
    stubs: list[tuple[str, object]] = []
    for i, address in enumerate(cluster.prefill_addresses):
        stubs.append((f"prefill-{i}", pb_grpc.PrefillWorkerStub(make_channel(address, cluster.token))))
    for i, address in enumerate(cluster.decode_addresses):
        stubs.append((f"decode-{i}", pb_grpc.DecodeWorkerStub(make_channel(address, cluster.token))))
    return stubs


def _assert_blocks_return(cluster: LocalCluster, timeout_s: float = 20.0) -> None:
    """Every instance's pool back to all-free (cached blocks count as free), nothing queued."""
    deadline = time.monotonic() + timeout_s
    while True:
        busy = {}
        for name, stub in _worker_stubs(cluster):
            s = stub.Stats(pb.StatsRequest(), timeout=5)  # type: ignore[attr-defined]
            if s.num_free_blocks != s.num_total_blocks or s.num_running or s.num_waiting or s.num_transferring:
                busy[name] = (s.num_free_blocks, s.num_total_blocks, s.num_running, s.num_waiting, s.num_transferring)
        if not busy:
            return
        assert time.monotonic() < deadline, f"blocks not returned (free, total, running, waiting, transferring): {busy}"
        time.sleep(0.2)


def _colocated(smollm2: LLM, prompts: list[str], max_tokens: int) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    return [o.outputs[0].token_ids for o in smollm2.generate(prompts, params, use_tqdm=False)]


def test_concurrent_requests_equal_colocated(cluster: LocalCluster, client: Client, smollm2: LLM) -> None:
    max_tokens = 12
    expected = _colocated(smollm2, PROMPTS, max_tokens)
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        results = list(pool.map(
            lambda p: client.generate(text=p, max_tokens=max_tokens, temperature=0, ignore_eos=True, timeout_s=300),
            PROMPTS,
        ))
    assert [r.token_ids for r in results] == expected
    for result in results:
        assert result.finish_reason == "length"
        assert result.timings is not None and not result.timings.recomputed
        assert result.timings.num_kv_blocks_sent > 0
        assert result.usage is not None and result.usage.completion_tokens == max_tokens
    # Text arrives streamed and whole: it decodes to what the tokens say.
    tokenizer = smollm2.get_tokenizer()
    assert results[0].text == tokenizer.decode(results[0].token_ids, skip_special_tokens=True)
    _assert_blocks_return(cluster)


def test_the_prefills_first_token_goes_out_ahead(cluster: LocalCluster, client: Client, smollm2: LLM) -> None:
    """The router streams the prefill's first token as the prefill answers and drops the
    decode instance's copy: the stream is still offline's, token for token and in text."""
    prompt = PROMPTS[1]
    for max_tokens in (12, 1):  # 1: the decode instance's only message then holds just the end
        expected = smollm2.generate([prompt], SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True),
                                    use_tqdm=False)[0].outputs[0]
        with client.stream(text=prompt, max_tokens=max_tokens, temperature=0, ignore_eos=True, timeout_s=300) as s:
            pieces = list(s)
        assert list(pieces[0].token_ids) == expected.token_ids[:1] and pieces[0].text
        assert [t for p in pieces for t in p.token_ids] == expected.token_ids
        assert "".join(p.text for p in pieces) == expected.text
        last = pieces[-1]
        assert last.timings.first_token_early and last.usage.completion_tokens == max_tokens
    # A stop string might begin in that token's text: the decode instance sends it, as before.
    result = client.generate(text=prompt, max_tokens=4, temperature=0, ignore_eos=True, stop=["\n\n\n\n"],
                             timeout_s=300)
    assert result.timings is not None and not result.timings.first_token_early
    assert result.token_ids == _colocated(smollm2, [prompt], 4)[0]
    _assert_blocks_return(cluster)


def test_chat_and_stop_string(cluster: LocalCluster, client: Client, smollm2: LLM) -> None:
    chat = [{"role": "user", "content": "Count from one to ten in words, separated by commas."}]
    params = SamplingParams(temperature=0, max_tokens=40, stop=["five"])
    expected = smollm2.chat(chat, params, use_tqdm=False)[0].outputs[0]
    result = client.generate(chat=chat, max_tokens=40, temperature=0, stop=["five"], timeout_s=300)
    assert result.text == expected.text
    assert result.finish_reason == expected.finish_reason


def test_decode_prefix_hit_sends_only_missing_blocks(cluster: LocalCluster, client: Client, smollm2: LLM) -> None:
    shared = "You are a careful assistant who answers in full sentences. " * 8
    prompts = [shared + "Question: what is a cat?", shared + "Question: what is a dog?"]
    expected = _colocated(smollm2, prompts, 8)
    # Two runs of the same prompt pair: the second finds the prefix on whichever decode took it.
    first = [client.generate(text=p, max_tokens=8, temperature=0, ignore_eos=True) for p in prompts]
    second = [client.generate(text=p, max_tokens=8, temperature=0, ignore_eos=True) for p in prompts]
    assert [r.token_ids for r in first] == expected
    assert [r.token_ids for r in second] == expected
    hits = [r for r in second if r.timings.decode_cached_tokens > 0]  # type: ignore[union-attr]
    assert hits, "no request found its prefix cached on the decode side"
    for r in hits:
        t, usage = r.timings, r.usage
        assert t is not None and usage is not None
        assert t.num_kv_blocks_sent == -(-usage.prompt_tokens // 16) - t.decode_cached_tokens // 16
        assert usage.cached_tokens >= t.decode_cached_tokens


def test_abort_and_disconnect_free_blocks(cluster: LocalCluster, client: Client) -> None:
    # Client disconnect: cancel the stream after two pieces.
    stream = client.stream(text="Tell me a very long story.", max_tokens=400, ignore_eos=True, temperature=0)
    for i, _ in enumerate(stream):
        if i == 1:
            stream.cancel()  # type: ignore[attr-defined]
            break
    # Abort RPC from another call.
    pieces: list[pb.GenerateResponse] = []
    errors: list[ClientError] = []

    def consume() -> None:
        try:
            pieces.extend(
                client.stream(text="Another long story.", request_id="abort-me", max_tokens=400, ignore_eos=True)
            )
        except ClientError as e:
            errors.append(e)

    thread = threading.Thread(target=consume)
    thread.start()
    deadline = time.monotonic() + 60
    while not pieces and time.monotonic() < deadline:
        time.sleep(0.05)
    assert client.abort("abort-me")
    thread.join(timeout=30)
    assert not thread.is_alive()
    ended = errors or [p for p in pieces if p.finish_reason == "abort"]
    assert ended, "an aborted stream must end"
    assert not client.abort("abort-me")  # idempotent: it is gone
    _assert_blocks_return(cluster)


def test_lease_expiry_frees_blocks(cluster: LocalCluster) -> None:
    stub = pb_grpc.DecodeWorkerStub(make_channel(cluster.decode_addresses[0], cluster.token))
    request = pb.WorkerRequest(request_id="lease", prompt_token_ids=list(range(1, 200)))
    reservation = stub.Reserve(pb.ReserveRequest(request=request, lease_s=0.5), timeout=10)
    assert len(reservation.block_ids) == -(-199 // 16)
    _assert_blocks_return(cluster)
    with pytest.raises(grpc.RpcError) as info:
        _decode_directly(stub, pb.DecodeRequest(request_id="lease"))
    assert info.value.code() == grpc.StatusCode.NOT_FOUND


def _decode_directly(stub: pb_grpc.DecodeWorkerStub, msg: pb.DecodeRequest) -> list[pb.GenerateResponse]:
    """What the router does: open an Outputs stream, Decode on it, read the request's outputs
    up to its finish."""
    msg.subscriber_id = f"test-{msg.request_id}"
    outputs = stub.Outputs(pb.OutputsRequest(subscriber_id=msg.subscriber_id), timeout=60)
    try:
        assert not next(outputs).outputs  # the stream is open
        stub.Decode(msg, timeout=60)
        pieces: list[pb.GenerateResponse] = []
        for message in outputs:
            assert [o.response.request_id for o in message.outputs] == [msg.request_id] * len(message.outputs)
            pieces += [o.response for o in message.outputs]
            if pieces[-1].finish_reason:
                return pieces
        raise AssertionError("the Outputs stream ended before the request finished")
    finally:
        outputs.cancel()


def test_decode_without_an_outputs_stream_is_refused(cluster: LocalCluster) -> None:
    stub = pb_grpc.DecodeWorkerStub(make_channel(cluster.decode_addresses[0], cluster.token))
    request = pb.WorkerRequest(request_id="no-stream", prompt_token_ids=list(range(1, 40)))
    stub.Reserve(pb.ReserveRequest(request=request), timeout=10)
    with pytest.raises(grpc.RpcError) as info:
        stub.Decode(pb.DecodeRequest(request_id="no-stream", subscriber_id="nobody"), timeout=10)
    assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "Outputs" in (info.value.details() or "")
    _assert_blocks_return(cluster)


def test_worker_rejects_calls_without_the_cluster_token(cluster: LocalCluster) -> None:
    stub = pb_grpc.DecodeWorkerStub(make_channel(cluster.decode_addresses[0], token="wrong"))
    with pytest.raises(grpc.RpcError) as info:
        stub.Stats(pb.StatsRequest(), timeout=5)
    assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED


def test_layout_mismatch_is_named_and_decode_recomputes(cluster: LocalCluster, client: Client, smollm2: LLM) -> None:
    decode = pb_grpc.DecodeWorkerStub(make_channel(cluster.decode_addresses[0], cluster.token))
    prefill = pb_grpc.PrefillWorkerStub(make_channel(cluster.prefill_addresses[0], cluster.token))
    prompt = smollm2.get_tokenizer().encode("The largest planet in the solar system is")
    params = pb.SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    request = pb.WorkerRequest(request_id="mismatch", prompt_token_ids=prompt, sampling_params=params)
    reservation = decode.Reserve(pb.ReserveRequest(request=request), timeout=10)
    reservation.layout.block_size = 32
    reply = prefill.Prefill(pb.PrefillRequest(request=request, reservation=reservation), timeout=60)
    assert reply.transfer_status == pb.TRANSFER_FAILED
    assert "block_size" in reply.transfer_error and "16" in reply.transfer_error and "32" in reply.transfer_error
    # Decode was told nothing arrived: it computes the prompt itself, same tokens.
    pieces = _decode_directly(decode, pb.DecodeRequest(request_id="mismatch"))
    tokens = [t for p in pieces for t in p.token_ids]
    assert tokens == _colocated(smollm2, ["The largest planet in the solar system is"], 6)[0]
    _assert_blocks_return(cluster)


def test_kv_that_never_lands_is_recomputed(cluster: LocalCluster, smollm2: LLM) -> None:
    decode = pb_grpc.DecodeWorkerStub(make_channel(cluster.decode_addresses[1], cluster.token))
    text = "A short poem about autumn:"
    prompt = smollm2.get_tokenizer().encode(text)
    request = pb.WorkerRequest(
        request_id="never-lands", prompt_token_ids=prompt,
        sampling_params=pb.SamplingParams(temperature=0, max_tokens=6, ignore_eos=True),
    )
    decode.Reserve(pb.ReserveRequest(request=request), timeout=10)
    # Prefill "reported" a first token, but no KV ever arrives.
    pieces = _decode_directly(decode, pb.DecodeRequest(
        request_id="never-lands", first_token=pb.TokenLogprob(token_id=5), transfer_timeout_s=0.5))
    assert pieces[0].timings.recomputed
    assert [t for p in pieces for t in p.token_ids] == _colocated(smollm2, [text], 6)[0]
    _assert_blocks_return(cluster)


def test_bad_request_fails_alone(cluster: LocalCluster, client: Client) -> None:
    with pytest.raises(ClientError) as info:
        client.generate(text="hi", max_tokens=8, top_p=0.0)
    assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT and "top_p" in info.value.message
    with pytest.raises(ClientError) as info:
        client.generate(token_ids=[1] * 5000, max_tokens=8)
    assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT and "max_model_len" in info.value.message
    still = client.generate(text="Still serving?", max_tokens=2, temperature=0, ignore_eos=True)
    assert still.usage is not None and still.usage.completion_tokens == 2
    assert [m.id for m in client.list_models()] == ["smollm2-135m-instruct"]


def test_policy_fail_fails_cleanly_without_prefill(cluster: LocalCluster, tmp_path: Path) -> None:
    """A second router whose only prefill instance is unreachable, under policy `fail`."""
    config = tmp_path / "fail.yaml"
    config.write_text(CONFIG.read_text().replace("router:", "router:\n  on_transfer_failure: fail", 1))
    ready = tmp_path / "router.json"
    env = {**os.environ, TOKEN_ENV: cluster.token}
    router = subprocess.Popen(
        [sys.executable, "-m", "vllm_cluster.router", "--config", str(config), "--port", "0",
         "--ready-file", str(ready), "--prefill", "127.0.0.1:9", "--decode", cluster.decode_addresses[0]],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 120
        while not ready.exists():
            assert router.poll() is None and time.monotonic() < deadline, "the router did not start"
            time.sleep(0.1)
        client = Client(f"127.0.0.1:{json.loads(ready.read_text())['port']}")
        with pytest.raises(ClientError) as info:
            client.generate(text="Hello there, how are you today?", max_tokens=4)
        assert info.value.code == grpc.StatusCode.UNAVAILABLE
        assert "prefill" in info.value.message
        client.close()
    finally:
        router.terminate()
        router.wait(timeout=30)
    _assert_blocks_return(cluster)


def test_dead_prefill_leads_to_recompute(cluster: LocalCluster, client: Client, smollm2: LLM) -> None:
    """Runs last in the module: it kills both prefill processes mid-request. The prompt takes
    5 chunked steps (~1100 tokens at 256 a step), so the kill lands while the prefill is
    still computing even when its first `num_running` is seen a step late (a 2-step prompt
    let the KV land before the kill in two CI runs)."""
    text = "Describe the water cycle in detail. " * 150
    expected = _colocated(smollm2, [text], 8)[0]
    result: list[object] = []
    thread = threading.Thread(target=lambda: result.append(
        client.generate(text=text, max_tokens=8, temperature=0, ignore_eos=True, timeout_s=300)))
    thread.start()
    stubs = [s for n, s in _worker_stubs(cluster) if n.startswith("prefill")]
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if any(s.Stats(pb.StatsRequest(), timeout=5).num_running for s in stubs):  # type: ignore[attr-defined]
            break
        time.sleep(0.01)
    for i in range(len(cluster.prefill_addresses)):
        cluster.kill(f"prefill-{i}")
    thread.join(timeout=300)
    completion = result[0]
    assert completion.token_ids == expected  # type: ignore[attr-defined]
    assert completion.timings.recomputed  # type: ignore[attr-defined]


def test_health_and_reflection_on_every_server(cluster: LocalCluster) -> None:
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    from vllm_cluster.worker.rpc import check_health

    servers = [(cluster.router_address, "vllm_cluster.Generation")]
    servers += [(a, "vllm_cluster.DecodeWorker") for a in cluster.decode_addresses]
    for address, service in servers:
        channel = grpc.insecure_channel(address)  # health and reflection need no token
        assert check_health(channel, service, timeout_s=5)
        stub = reflection_pb2_grpc.ServerReflectionStub(channel)
        replies = stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=5)
        names = {s.name for reply in replies for s in reply.list_services_response.service}
        assert {service, "grpc.health.v1.Health"} <= names
        channel.close()
