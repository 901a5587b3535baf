"""The client library and the `vllm-cluster chat` / `generate` commands against a real
cluster (1 prefill + 1 decode over UCX, a router that demands an API key): streaming and
whole completions, every status code the client documents, cancellation freeing the blocks
on both instances, and the CLI as a user runs it."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from vllm_cluster.client import Client, ClientError, Completion
from vllm_cluster.cluster.local import LocalCluster
from vllm_cluster.proto import cluster_pb2 as pb
from vllm_cluster.proto import cluster_pb2_grpc as pb_grpc
from vllm_cluster.worker.rpc import API_KEY_ENV, make_channel

pytestmark = pytest.mark.slow

CONFIG = Path(__file__).with_name("cluster.yaml")  # max_model_len 2048, 512 blocks of 16
API_KEY = "test-api-key"
LONG: dict[str, Any] = {"max_tokens": 400, "ignore_eos": True, "temperature": 0.0}  # seconds of decoding on CPU


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    pytest.importorskip("ucxx")
    local = LocalCluster.from_yaml(CONFIG, num_prefill=1, num_decode=1)
    local.api_key = API_KEY
    local.log_dir = tmp_path_factory.mktemp("grpc-client-cluster")
    with local:
        yield local


@pytest.fixture(scope="module")
def client(cluster: LocalCluster) -> Iterator[Client]:
    with Client(cluster.router_address, api_key=API_KEY, timeout_s=300) as c:
        yield c


def _stats(cluster: LocalCluster) -> dict[str, pb.WorkerStats]:
    stubs: dict[str, Any] = {}
    for i, address in enumerate(cluster.prefill_addresses):
        stubs[f"prefill-{i}"] = pb_grpc.PrefillWorkerStub(make_channel(address, cluster.token))
    for i, address in enumerate(cluster.decode_addresses):
        stubs[f"decode-{i}"] = pb_grpc.DecodeWorkerStub(make_channel(address, cluster.token))
    return {name: stub.Stats(pb.StatsRequest(), timeout=5) for name, stub in stubs.items()}


def _assert_blocks_return(cluster: LocalCluster, timeout_s: float = 20.0) -> None:
    """Every instance's pool back to all-free (cached blocks count as free), nothing queued."""
    deadline = time.monotonic() + timeout_s
    while True:
        busy = {name: s for name, s in _stats(cluster).items()
                if s.num_free_blocks != s.num_total_blocks or s.num_running or s.num_waiting or s.num_transferring}
        if not busy:
            return
        assert time.monotonic() < deadline, f"blocks not returned: {busy}"
        time.sleep(0.2)


def _error(call: Callable[[], object]) -> ClientError:
    with pytest.raises(ClientError) as info:
        call()
    return info.value


# ---- the library


def test_stream_and_generate_agree_and_greedy_is_deterministic(client: Client) -> None:
    chat = [{"role": "user", "content": "Name three colours of the rainbow."}]
    with client.stream(chat=chat, max_tokens=24, temperature=0) as stream:
        pieces = list(stream)
    assert len(pieces) > 1, "tokens arrive as they are generated"
    last = pieces[-1]
    assert last.finish_reason in ("stop", "length") and all(not p.finish_reason for p in pieces[:-1])
    assert last.usage.completion_tokens == sum(len(p.token_ids) for p in pieces)
    assert {p.request_id for p in pieces} == {stream.request_id}
    first, second = (client.generate(chat=chat, max_tokens=24, temperature=0) for _ in range(2))
    assert first.token_ids == second.token_ids == [t for p in pieces for t in p.token_ids]
    assert first.text == "".join(p.text for p in pieces) and first.text
    assert first.usage is not None and first.usage.prompt_tokens == last.usage.prompt_tokens
    assert [m.id for m in client.list_models()] == ["smollm2-135m-instruct"]


def test_unauthenticated_without_the_right_key(cluster: LocalCluster) -> None:
    for key in (None, "wrong-key"):
        with Client(cluster.router_address, api_key=key, timeout_s=30) as c:
            e = _error(lambda: c.generate("Hello", max_tokens=2))
            assert e.code == grpc.StatusCode.UNAUTHENTICATED and "API key" in e.message
            assert _error(c.list_models).code == grpc.StatusCode.UNAUTHENTICATED


def test_invalid_argument_and_not_found(client: Client) -> None:
    e = _error(lambda: client.generate("Hello", max_tokens=4, temperature=-1.0))
    assert e.code == grpc.StatusCode.INVALID_ARGUMENT and "temperature" in e.message
    assert str(e).startswith("INVALID_ARGUMENT: ")
    e = _error(lambda: client.generate(token_ids=[1] * 3000, max_tokens=4))
    assert e.code == grpc.StatusCode.INVALID_ARGUMENT and "max_model_len" in e.message
    e = _error(lambda: client.generate("Hello", model="no-such-model", max_tokens=4))
    assert e.code == grpc.StatusCode.NOT_FOUND and "smollm2-135m-instruct" in e.message
    with pytest.raises(TypeError, match="no_such_param"):
        client.stream("Hello", no_such_param=1)


def test_deadlines(cluster: LocalCluster, client: Client) -> None:
    # The call's gRPC deadline: the client gives up, the router sees the hang-up.
    e = _error(lambda: client.generate("Tell me a story.", timeout_s=1.0, **LONG))
    assert e.code == grpc.StatusCode.DEADLINE_EXCEEDED
    # The request's own deadline: the router aborts both legs and says why.
    started = time.monotonic()
    e = _error(lambda: client.generate("Tell me another story.", deadline_s=1.0, **LONG))
    assert e.code == grpc.StatusCode.DEADLINE_EXCEEDED and "deadline" in e.message
    assert time.monotonic() - started < 30
    _assert_blocks_return(cluster)


def test_resource_exhausted_when_decode_is_full(cluster: LocalCluster, client: Client) -> None:
    """Reservations held straight on the decode instance fill its KV cache."""
    decode = pb_grpc.DecodeWorkerStub(make_channel(cluster.decode_addresses[0], cluster.token))
    num_tokens = 2000  # 125 blocks; 4 fit in 512
    held: list[str] = []
    try:
        for i in range(8):
            request = pb.WorkerRequest(
                request_id=f"hold-{i}", prompt_token_ids=range(1 + i * num_tokens, 1 + (i + 1) * num_tokens)
            )
            try:
                decode.Reserve(pb.ReserveRequest(request=request, lease_s=120), timeout=30)
            except grpc.RpcError as rpc_error:
                assert rpc_error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
                break
            held.append(request.request_id)
        assert held and len(held) < 8
        prompt = list(range(20_001, 20_001 + num_tokens))
        start = time.monotonic()
        e = _error(lambda: client.generate(token_ids=prompt, max_tokens=4))
        waited = time.monotonic() - start
        assert e.code == grpc.StatusCode.RESOURCE_EXHAUSTED and e.retry_after_s is not None
        assert f"retry in {e.retry_after_s} s" in e.message  # from the router's admission queue
        assert 1.5 <= waited < 20, f"queued for router.queue_timeout_s (2 s), then shed: {waited:.1f}s"
        # Queued, then admitted: room appears while it waits.
        threading.Timer(0.5, decode.Release, args=(pb.ReleaseRequest(request_id=held.pop()),),
                        kwargs={"timeout": 10}).start()
        admitted = client.generate(token_ids=prompt, max_tokens=2, ignore_eos=True)
        assert admitted.usage is not None and admitted.usage.completion_tokens == 2
    finally:
        for request_id in held:
            decode.Release(pb.ReleaseRequest(request_id=request_id), timeout=10)
    assert client.generate(token_ids=prompt, max_tokens=2, ignore_eos=True).usage.completion_tokens == 2  # type: ignore[union-attr]
    _assert_blocks_return(cluster)


def test_cancelled_stream_frees_blocks_on_both_instances(cluster: LocalCluster, client: Client) -> None:
    # Mid-decode: after two pieces.
    stream = client.stream("Tell me a very long story.", **LONG)
    pieces = []
    for piece in stream:
        pieces.append(piece)
        if len(pieces) == 2:
            stream.cancel()
    assert len(pieces) == 2 and stream.cancelled  # the iteration just ends: no error
    # Mid-prefill: a long prompt, cancelled while the prefill instance computes it.
    prefill = pb_grpc.PrefillWorkerStub(make_channel(cluster.prefill_addresses[0], cluster.token))
    stream = client.stream("Describe the water cycle in detail. " * 200, max_tokens=4)
    consumer = threading.Thread(target=lambda: list(stream))
    consumer.start()
    deadline = time.monotonic() + 60
    while not prefill.Stats(pb.StatsRequest(), timeout=5).num_running and time.monotonic() < deadline:
        time.sleep(0.01)
    stream.cancel()
    consumer.join(timeout=30)
    assert not consumer.is_alive()
    _assert_blocks_return(cluster)


def test_abort_by_request_id_ends_the_stream_with_cancelled(cluster: LocalCluster, client: Client) -> None:
    stream = client.stream("Write a long poem.", request_id="abort-from-elsewhere", **LONG)
    received: list[Completion] = [Completion(stream.request_id)]
    errors: list[ClientError] = []

    def consume() -> None:
        try:
            for piece in stream:
                received[0].add(piece)
        except ClientError as e:
            errors.append(e)

    consumer = threading.Thread(target=consume)
    consumer.start()
    deadline = time.monotonic() + 60
    while not received[0].token_ids and time.monotonic() < deadline:
        time.sleep(0.05)
    assert client.abort("abort-from-elsewhere")
    consumer.join(timeout=30)
    assert [e.code for e in errors] == [grpc.StatusCode.CANCELLED]
    assert not client.abort("abort-from-elsewhere")
    _assert_blocks_return(cluster)



def _abort_from_another_process(cluster: LocalCluster, request_id: str) -> str:
    """`Client.abort` in a process of its own, with the same API key: "True" or "False"."""
    code = ("import sys; from vllm_cluster.client import Client; "
            "print(Client(sys.argv[1], api_key=sys.argv[2], timeout_s=30).abort(sys.argv[3]))")
    run = subprocess.run([sys.executable, "-c", code, cluster.router_address, API_KEY, request_id],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    return run.stdout.strip()


def test_a_chosen_request_id_is_aborted_only_over_the_connection_that_started_it(
    cluster: LocalCluster, client: Client
) -> None:
    """Every client holds the same API key; another client (a process of its own: gRPC pools
    one process's channels onto one connection) that knows or guesses the id cannot abort
    the request, and is told nothing is in flight."""
    stream = client.stream("Write a long poem.", request_id="chosen-by-its-client", **LONG)
    errors: list[ClientError] = []
    first_token = threading.Event()

    def consume() -> None:
        try:
            for piece in stream:
                if piece.token_ids:
                    first_token.set()
        except ClientError as e:
            errors.append(e)

    consumer = threading.Thread(target=consume)
    consumer.start()
    assert first_token.wait(60)
    assert _abort_from_another_process(cluster, "chosen-by-its-client") == "False"
    assert consumer.is_alive() and not errors
    assert client.abort("chosen-by-its-client")
    consumer.join(timeout=30)
    assert [e.code for e in errors] == [grpc.StatusCode.CANCELLED]
    _assert_blocks_return(cluster)


def test_a_router_made_request_id_is_aborted_by_whoever_holds_it(cluster: LocalCluster) -> None:
    stub = pb_grpc.GenerationStub(make_channel(cluster.router_address))
    metadata = (("authorization", f"Bearer {API_KEY}"),)
    request = pb.GenerateRequest(  # no request_id: the router makes one
        text="Write a long poem.", sampling_params=pb.SamplingParams(max_tokens=400, ignore_eos=True)
    )
    call = stub.Generate(request, metadata=metadata, timeout=300)
    request_id = next(call).request_id
    assert len(request_id) == 32 and int(request_id, 16) >= 0
    assert _abort_from_another_process(cluster, request_id) == "True"
    with pytest.raises(grpc.RpcError) as ended:
        list(call)
    assert ended.value.code() == grpc.StatusCode.CANCELLED
    _assert_blocks_return(cluster)


# ---- the command line


def _cli(*args: str, stdin: str = "", api_key: str | None = API_KEY) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != API_KEY_ENV}
    if api_key is not None:
        env[API_KEY_ENV] = api_key
    return subprocess.run([sys.executable, "-m", "vllm_cluster.cluster.cli", *args], input=stdin, capture_output=True,
                          text=True, env=env, timeout=300)


def _prompt_tokens(stderr: str) -> list[int]:
    return [int(n) for n in re.findall(r"prompt (\d+) tokens", stderr)]


def test_chat_keeps_history_and_clear_forgets_it(cluster: LocalCluster, client: Client) -> None:
    q1, q2 = "What is the capital of France?", "And of Italy?"
    run = _cli("chat", "--address", cluster.router_address, "--temperature", "0", "--max-tokens", "24",
               stdin=f"{q1}\n{q2}\n/clear\n{q1}\n")
    assert run.returncode == 0, run.stderr
    a1 = client.generate(chat=[{"role": "user", "content": q1}], max_tokens=24, temperature=0).text
    history = [{"role": "user", "content": q1}, {"role": "assistant", "content": a1}, {"role": "user", "content": q2}]
    a2 = client.generate(chat=history, max_tokens=24, temperature=0).text
    assert run.stdout == f"{a1}\n{a2}\n{a1}\n"
    p1, p2, p3 = _prompt_tokens(run.stderr)
    assert p2 > p1 + 5 and p3 == p1
    assert "history cleared" in run.stderr


def test_chat_without_the_api_key_says_so(cluster: LocalCluster) -> None:
    run = _cli("chat", "--address", cluster.router_address, stdin="Hello\n", api_key=None)
    assert run.returncode == 1
    assert "error: UNAUTHENTICATED: " in run.stderr


def test_chat_ctrl_c_cancels_the_reply_and_chat_goes_on(cluster: LocalCluster) -> None:
    chat = subprocess.Popen(
        [sys.executable, "-m", "vllm_cluster.cluster.cli", "chat", "--address", cluster.router_address,
         "--api-key", API_KEY, "--temperature", "0", "--max-tokens", "400"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        # A shell's background job (CI under `&`) starts with SIGINT ignored, and Python keeps
        # an ignored SIGINT: give the chat a terminal's default, as a user's would have.
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    assert chat.stdin is not None and chat.stdout is not None
    try:
        chat.stdin.write("Count from 1 to 500, separated by commas.\n")
        chat.stdin.flush()
        assert chat.stdout.read(1), "the reply starts streaming"
        chat.send_signal(signal.SIGINT)
        _assert_blocks_return(cluster)
        out, err = chat.communicate("Say hello.\n", timeout=120)
    finally:
        if chat.poll() is None:  # a failed step leaves no chat process behind
            chat.kill()
            chat.wait()
    assert chat.returncode == 0, err
    assert "[cancelled]" in err
    assert len(_prompt_tokens(err)) == 1  # the second message was answered (the first was not)


def test_generate_streams_text_and_fails_clearly(cluster: LocalCluster, client: Client) -> None:
    prompt = "The capital of France is"
    run = _cli("generate", prompt, "--address", cluster.router_address, "--max-tokens", "8")
    assert run.returncode == 0, run.stderr
    assert run.stdout == client.generate(prompt, max_tokens=8, temperature=0).text + "\n"
    run = _cli("generate", prompt, "--address", cluster.router_address, "--temperature", "-1")
    assert run.returncode == 1 and run.stderr.startswith("error: INVALID_ARGUMENT: ") and "temperature" in run.stderr
    run = _cli("generate", prompt, "--address", "127.0.0.1:9")
    assert run.returncode == 1 and run.stderr.startswith("error: UNAVAILABLE: "), run.stderr


# ---- fuzz: whatever a client sends, INVALID_ARGUMENT or an answer, and the cluster stays well

_INT32 = st.integers(min_value=-(2**31), max_value=2**31 - 1)
_FLOAT = st.floats(allow_nan=True, allow_infinity=True, width=64)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    sampling=st.fixed_dictionaries({}, optional={
        "temperature": _FLOAT, "top_p": _FLOAT, "top_k": _INT32, "min_p": _FLOAT,
        "seed": st.integers(-(2**63), 2**63 - 1),
        "min_tokens": _INT32, "logprobs": _INT32, "presence_penalty": _FLOAT, "frequency_penalty": _FLOAT,
        "repetition_penalty": _FLOAT, "stop": st.lists(st.text(max_size=3), max_size=3),
        "stop_token_ids": st.lists(st.integers(min_value=-5, max_value=2**31 - 1), max_size=3),
        "ignore_eos": st.booleans(),
    }),
    max_tokens=st.integers(min_value=-(2**31), max_value=3),
    prompt=st.one_of(st.text(max_size=50), st.lists(st.integers(min_value=-(2**31), max_value=2**31 - 1), max_size=20),
                     st.just(list(range(1, 10_001)))),
)
def test_fuzzed_requests_get_invalid_argument_or_an_answer(
    client: Client, sampling: dict[str, Any], max_tokens: int, prompt: Any
) -> None:
    kwargs = {"text": prompt} if isinstance(prompt, str) else {"token_ids": prompt}
    start = time.monotonic()
    try:
        result = client.generate(**kwargs, max_tokens=max_tokens, **sampling)
    except ClientError as e:
        assert e.code == grpc.StatusCode.INVALID_ARGUMENT, (sampling, max_tokens, e)
        assert "Traceback" not in e.message and "0x" not in e.message
    else:
        assert result.finish_reason in ("stop", "length")
    assert time.monotonic() - start < 60


def test_cluster_is_well_after_the_fuzz(cluster: LocalCluster, client: Client) -> None:
    assert client.generate("The capital of France is", max_tokens=2, ignore_eos=True).usage.completion_tokens == 2  # type: ignore[union-attr]
    _assert_blocks_return(cluster)
    assert all(p.popen.poll() is None for p in cluster.processes)


def test_router_sigterm_drains(cluster: LocalCluster, client: Client) -> None:
    """Last in this module: SIGTERM the router mid-stream; the stream finishes, HTTP /health
    says 503 while it drains, new calls are refused, and the router exits 0."""
    router = cluster.process("router")
    with client.stream("Tell me a story.", max_tokens=30, ignore_eos=True, temperature=0.0) as stream:
        pieces = iter(stream)
        next(pieces)
        router.popen.send_signal(signal.SIGTERM)
        time.sleep(0.3)
        with pytest.raises(urllib.error.URLError):  # 503 (HTTPError) while draining, or refused after
            urllib.request.urlopen(cluster.http_address + "/health", timeout=5)
        with Client(cluster.router_address, api_key=API_KEY, timeout_s=10) as late, pytest.raises(ClientError):
            late.generate("Hi", max_tokens=2)
        rest = list(pieces)
    assert rest[-1].finish_reason == "length" and rest[-1].usage.completion_tokens == 30
    assert router.popen.wait(timeout=60) == 0
