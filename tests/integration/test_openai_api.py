"""The OpenAI-compatible HTTP API against a real local cluster (router + 1 prefill + 1
decode), driven by the official `openai` package where it can be, and by raw HTTP for
the envelope, status codes and headers it hides. Greedy answers equal the offline engine's.
"""

from __future__ import annotations

import contextlib
import json
import socket
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from vllm_cluster.cluster.local import LocalCluster
from vllm_cluster.engine import LLM, SamplingParams
from vllm_cluster.proto import cluster_pb2 as pb
from vllm_cluster.proto import cluster_pb2_grpc as pb_grpc
from vllm_cluster.proto.rpc import make_channel

openai = pytest.importorskip("openai")
pytestmark = pytest.mark.slow

CONFIG = Path(__file__).with_name("openai_cluster.yaml")
KEY = "test-key-1"
MODEL = "smollm2-135m-instruct"
CHAT = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    pytest.importorskip("ucxx")
    local = LocalCluster.from_yaml(CONFIG)
    local.api_key = KEY
    local.log_dir = tmp_path_factory.mktemp("openai-cluster")
    with local:
        yield local


@pytest.fixture(scope="module")
def client(cluster: LocalCluster) -> Any:
    return openai.OpenAI(base_url=cluster.http_address + "/v1", api_key=KEY, max_retries=0, timeout=120)


def _http(cluster: LocalCluster, method: str, path: str, body: Any = None, key: str | None = KEY,
          headers: dict[str, str] | None = None, raw: bytes | None = None) -> tuple[int, dict[str, str], Any]:
    data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
    request = urllib.request.Request(cluster.http_address + path, data=data, method=method)
    request.add_header("Content-Type", "application/json")
    if key is not None:
        request.add_header("Authorization", f"Bearer {key}")
    for name, value in (headers or {}).items():
        request.add_header(name, value)
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            status, got_headers, payload = response.status, dict(response.headers), response.read()
    except urllib.error.HTTPError as e:
        status, got_headers, payload = e.code, dict(e.headers), e.read()
    try:
        return status, got_headers, json.loads(payload) if payload else None
    except json.JSONDecodeError:
        return status, got_headers, payload.decode()


def _assert_envelope(body: Any, status: int, param: str | None = None) -> None:
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["code"] == status and error["message"]
    if param is not None:
        assert error["param"] == param


def _assert_blocks_return(cluster: LocalCluster, timeout_s: float = 20.0) -> None:
    stubs = [pb_grpc.PrefillWorkerStub(make_channel(a, cluster.token)) for a in cluster.prefill_addresses]
    stubs += [pb_grpc.DecodeWorkerStub(make_channel(a, cluster.token)) for a in cluster.decode_addresses]
    deadline = time.monotonic() + timeout_s
    while True:
        stats = [s.Stats(pb.StatsRequest(), timeout=5) for s in stubs]  # type: ignore[attr-defined]
        busy = [(s.role, s.num_free_blocks, s.num_total_blocks, s.num_running, s.num_waiting, s.num_transferring)
                for s in stats if s.num_free_blocks != s.num_total_blocks or s.num_running or s.num_waiting or s.num_transferring]
        if not busy:
            return
        assert time.monotonic() < deadline, f"blocks not returned (role, free, total, running, waiting, transferring): {busy}"
        time.sleep(0.2)


# ---- the openai package


def test_chat_greedy_equals_offline_engine(client: Any, smollm2: LLM) -> None:
    reply = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=12, temperature=0)
    expected = smollm2.chat(CHAT, SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)[0].outputs[0]
    assert reply.choices[0].message.content == expected.text
    assert reply.choices[0].message.role == "assistant"
    assert reply.choices[0].finish_reason in ("stop", "length")
    assert reply.usage.completion_tokens == len(expected.token_ids)
    assert reply.usage.total_tokens == reply.usage.prompt_tokens + reply.usage.completion_tokens
    assert reply.object == "chat.completion" and reply.model == MODEL


def test_completion_greedy_equals_offline_engine(client: Any, smollm2: LLM) -> None:
    prompt = "The capital of France is"
    reply = client.completions.create(model=MODEL, prompt=prompt, max_tokens=10, temperature=0)
    expected = smollm2.generate(prompt, SamplingParams(temperature=0, max_tokens=10), use_tqdm=False)[0].outputs[0]
    assert reply.choices[0].text == expected.text
    assert reply.usage.prompt_tokens == len(smollm2.get_tokenizer().encode(prompt))


def test_streaming_chat_equals_whole_and_reports_usage(client: Any) -> None:
    whole = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=12, temperature=0)
    chunks = list(client.chat.completions.create(
        model=MODEL, messages=CHAT, max_tokens=12, temperature=0, stream=True, stream_options={"include_usage": True},
    ))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == [whole.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert all(c.usage is None for c in chunks[:-1])


def test_streaming_completion(client: Any) -> None:
    chunks = list(client.completions.create(model=MODEL, prompt="1, 2, 3,", max_tokens=8, temperature=0, stream=True))
    whole = client.completions.create(model=MODEL, prompt="1, 2, 3,", max_tokens=8, temperature=0)
    assert "".join(c.choices[0].text for c in chunks) == whole.choices[0].text
    assert chunks[-1].choices[0].finish_reason == "length"


def test_n_choices_and_seed_reproducibility(client: Any) -> None:
    kwargs = dict(model=MODEL, messages=[{"role": "user", "content": "Tell me a story."}], max_tokens=16,
                  temperature=1.0, seed=1234, n=3)
    first = client.chat.completions.create(**kwargs)
    second = client.chat.completions.create(**kwargs)
    assert [c.index for c in first.choices] == [0, 1, 2]
    assert [c.message.content for c in first.choices] == [c.message.content for c in second.choices]
    assert len({c.message.content for c in first.choices}) > 1, "n samples with one seed must differ from each other"
    assert 3 <= first.usage.completion_tokens <= 3 * 16


def test_n_choices_streamed(client: Any) -> None:
    chunks = list(client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=6, temperature=0.8,
                                            seed=7, n=2, stream=True))
    texts = {0: "", 1: ""}
    for chunk in chunks:
        for choice in chunk.choices:
            texts[choice.index] += choice.text
    whole = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=6, temperature=0.8, seed=7, n=2)
    assert texts == {c.index: c.text for c in whole.choices}


def test_batched_prompts(client: Any) -> None:
    prompts = ["The capital of France is", "1, 2, 3,"]
    reply = client.completions.create(model=MODEL, prompt=prompts, max_tokens=4, temperature=0)
    singles = [client.completions.create(model=MODEL, prompt=p, max_tokens=4, temperature=0).choices[0].text for p in prompts]
    assert [c.text for c in sorted(reply.choices, key=lambda c: c.index)] == singles


def test_chat_logprobs(client: Any) -> None:
    reply = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=5, temperature=0,
                                           logprobs=True, top_logprobs=3)
    content = reply.choices[0].logprobs.content
    assert len(content) == reply.usage.completion_tokens
    assert "".join(t.token for t in content) == reply.choices[0].message.content
    for token in content:
        assert token.logprob <= 0 and len(token.top_logprobs) == 3
        assert token.top_logprobs[0].logprob == pytest.approx(token.logprob, abs=1e-4)  # greedy: the top one
        assert token.bytes == list(token.token.encode())


def test_completion_logprobs(client: Any) -> None:
    reply = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=4, temperature=0, logprobs=2)
    lp = reply.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 4
    assert "".join(lp.tokens) == reply.choices[0].text
    assert lp.text_offset[0] == 0 and all(len(top) == 2 for top in lp.top_logprobs)


def test_stop_string_and_stop_reason(client: Any) -> None:
    reply = client.completions.create(model=MODEL, prompt="1, 2, 3, 4,", max_tokens=20, temperature=0, stop=[" 7"])
    choice = reply.choices[0]
    assert choice.finish_reason == "stop" and " 7" not in choice.text and "6" in choice.text
    assert choice.model_extra.get("stop_reason") == " 7"


def test_cached_tokens_reported(client: Any) -> None:
    messages = [{"role": "system", "content": "You are a helpful assistant who answers in French. " * 4}, *CHAT]
    client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2, temperature=0)
    again = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2, temperature=0)
    cached = again.usage.prompt_tokens_details.cached_tokens
    assert cached >= 16 and cached % 16 == 0 and cached < again.usage.prompt_tokens


def test_responses_api(client: Any) -> None:
    reply = client.responses.create(model=MODEL, input="What is the capital of France?", max_output_tokens=12, temperature=0)
    chat = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=12, temperature=0)
    assert reply.output_text == chat.choices[0].message.content
    assert reply.usage.output_tokens == chat.usage.completion_tokens
    with client.responses.stream(model=MODEL, input="What is the capital of France?", max_output_tokens=12,
                                 temperature=0) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_response()
    assert kinds[0] == "response.created" and kinds[-1] == "response.completed"
    assert "response.output_text.delta" in kinds
    assert final.output_text == reply.output_text


def test_models(client: Any) -> None:
    models = client.models.list().data
    assert [m.id for m in models] == [MODEL]
    assert models[0].model_extra["max_model_len"] == 1024


def test_sdk_raises_typed_errors(client: Any) -> None:
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-4", messages=CHAT)
    with pytest.raises(openai.BadRequestError, match="temperature"):
        client.chat.completions.create(model=MODEL, messages=CHAT, temperature=-1)
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=client.base_url, api_key="wrong", max_retries=0).models.list()


# ---- raw HTTP: routes, envelope, statuses, headers


def test_tokenize_detokenize(cluster: LocalCluster, smollm2: LLM) -> None:
    status, _, body = _http(cluster, "POST", "/tokenize", {"prompt": "hello world"})
    assert status == 200 and body["tokens"] == list(smollm2.get_tokenizer().encode("hello world"))
    assert body["count"] == len(body["tokens"]) and body["max_model_len"] == 1024
    status, _, back = _http(cluster, "POST", "/detokenize", {"tokens": body["tokens"]})
    assert status == 200 and back["prompt"] == "hello world"
    status, _, chat = _http(cluster, "POST", "/tokenize", {"messages": CHAT})
    assert status == 200 and chat["count"] > body["count"]
    status, _, error = _http(cluster, "POST", "/detokenize", {"tokens": [10**9]})
    assert status == 400
    _assert_envelope(error, 400, "tokens")


def test_health_version_metrics(cluster: LocalCluster) -> None:
    assert _http(cluster, "GET", "/health", key=None)[0] == 200
    status, _, body = _http(cluster, "GET", "/version")
    assert status == 200 and body["version"]
    status, headers, text = _http(cluster, "GET", "/metrics")
    assert status == 200 and "vllm:time_to_first_token_seconds" in text


@pytest.mark.parametrize(("method", "path", "body"), [
    ("GET", "/v1/models", None),
    ("POST", "/v1/completions", {"prompt": "hi", "max_tokens": 1}),
    ("POST", "/v1/chat/completions", {"messages": CHAT, "max_tokens": 1}),
    ("POST", "/v1/responses", {"input": "hi", "max_output_tokens": 1}),
    ("POST", "/tokenize", {"prompt": "hi"}),
    ("POST", "/detokenize", {"tokens": [1]}),
    ("GET", "/metrics", None),
    ("GET", "/version", None),
])
def test_api_key_matrix(cluster: LocalCluster, method: str, path: str, body: Any) -> None:
    for key in (None, "wrong", KEY + "x", ""):
        status, _, error = _http(cluster, method, path, body, key=key)
        assert status == 401, (path, key)
        _assert_envelope(error, 401)
    status, _, _ = _http(cluster, method, path, body)
    assert status == 200, path


def test_request_id_echoed(cluster: LocalCluster) -> None:
    _, headers, _ = _http(cluster, "GET", "/v1/models", headers={"X-Request-Id": "my-id-42"})
    assert headers.get("x-request-id") == "my-id-42"
    _, headers, _ = _http(cluster, "GET", "/v1/models")
    assert len(headers.get("x-request-id", "")) >= 16
    _, headers, _ = _http(cluster, "POST", "/v1/chat/completions", {"messages": []}, headers={"X-Request-Id": "bad-1"})
    assert headers.get("x-request-id") == "bad-1"


@pytest.mark.parametrize(("body", "param"), [
    ({"messages": CHAT, "temperature": -1}, None),
    ({"messages": CHAT, "top_p": 0}, None),
    ({"messages": CHAT, "n": 0}, "n"),
    ({"messages": CHAT, "n": 10_000}, "n"),
    ({"messages": CHAT, "max_tokens": 0}, "max_tokens"),
    ({"messages": CHAT, "max_tokens": 4, "min_tokens": 8}, "min_tokens"),
    ({"messages": CHAT, "logprobs": True, "top_logprobs": 50}, "logprobs"),
    ({"messages": CHAT, "top_logprobs": 2}, "top_logprobs"),
    ({"messages": CHAT, "max_tokens": 5000}, "max_tokens"),
    ({"messages": CHAT, "tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
    ({"messages": CHAT, "temperature": "hot"}, "temperature"),
    ({"messages": []}, "messages"),
    ({"messages": "hello"}, "messages"),
    ({}, "messages"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}, "messages"),
])
def test_bad_chat_parameters_get_400(cluster: LocalCluster, body: dict[str, Any], param: str | None) -> None:
    status, _, error = _http(cluster, "POST", "/v1/chat/completions", body)
    assert status == 400, error
    _assert_envelope(error, 400, param)
    assert error["error"]["type"] == "BadRequestError"


def test_context_too_long_and_unknown_model(cluster: LocalCluster) -> None:
    status, _, error = _http(cluster, "POST", "/v1/completions", {"prompt": "hello " * 1100, "max_tokens": 1})
    assert status == 400 and "maximum context length is 1024" in error["error"]["message"]
    status, _, error = _http(cluster, "POST", "/v1/completions", {"prompt": "hi", "model": "nope"})
    assert status == 404
    _assert_envelope(error, 404, "model")
    status, _, error = _http(cluster, "POST", "/v1/nothing-here", {})
    assert status == 404
    _assert_envelope(error, 404)


def test_body_too_large_and_malformed(cluster: LocalCluster) -> None:
    status, _, error = _http(cluster, "POST", "/v1/completions", {"prompt": "x" * 100_000})
    assert status == 413
    _assert_envelope(error, 413)
    status, _, error = _http(cluster, "POST", "/v1/completions", raw=b"{not json")
    assert status == 400
    _assert_envelope(error, 400)
    status, _, error = _http(cluster, "POST", "/v1/completions", raw=b'{"prompt": "\xff\xfe"}')
    assert status == 400
    assert _http(cluster, "GET", "/health", key=None)[0] == 200  # still serving


def test_stream_error_before_first_token_is_plain_http_error(cluster: LocalCluster) -> None:
    status, headers, error = _http(cluster, "POST", "/v1/chat/completions",
                                   {"messages": CHAT, "stream": True, "stop_token_ids": [10**8]})
    assert status == 400, error
    assert headers.get("content-type", "").startswith("application/json")
    _assert_envelope(error, 400)


def test_disconnect_mid_stream_frees_blocks(cluster: LocalCluster, client: Any) -> None:
    # 900 tokens take far longer than the 5 s allowed: only the hang-up can free the blocks.
    stream = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=900, stream=True,
                                            extra_body={"ignore_eos": True})
    for i, _ in enumerate(stream):
        if i == 3:
            break
    stream.close()
    _assert_blocks_return(cluster, timeout_s=5)


def test_overload_gives_429_with_retry_after(cluster: LocalCluster, client: Any) -> None:
    """Decode holds 96 blocks: one 900-token prompt in flight leaves no room for another."""
    long_a = "alpha beta gamma delta " * 220
    long_b = "one two three four five " * 180
    holder = client.completions.create(model=MODEL, prompt=long_a, max_tokens=100, temperature=0, stream=True,
                                       extra_body={"ignore_eos": True})
    first = next(iter(holder))  # the first token: its blocks are reserved on decode
    assert first.choices
    status, headers, error = _http(cluster, "POST", "/v1/completions", {"prompt": long_b, "max_tokens": 8})
    holder.close()
    assert status == 429, error
    assert int(headers["retry-after"]) >= 1
    _assert_envelope(error, 429)
    _assert_blocks_return(cluster)
    # Once the holder is gone, the same request is served.
    status, _, body = _http(cluster, "POST", "/v1/completions", {"prompt": long_b, "max_tokens": 2})
    assert status == 200 and body["choices"][0]["text"]


def _post_huge_body(cluster: LocalCluster, size: int) -> bytes:
    """Announce `size` bytes, send the first MiB, read the answer (the server answers and
    closes without reading the rest)."""
    host, port = cluster.http_address.removeprefix("http://").rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        sock.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n"
                     f"Content-Type: application/json\r\nContent-Length: {size}\r\n\r\n".encode())
        with contextlib.suppress(OSError):
            sock.sendall(b"x" * (1 << 20))
        return sock.recv(4096)


def _rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


_ANY = st.one_of(
    st.none(), st.booleans(), st.integers(min_value=-(2**63), max_value=2**63), st.floats(allow_nan=True),
    st.text(max_size=20), st.lists(st.integers(min_value=-5, max_value=10**9), max_size=5),
    st.dictionaries(st.text(max_size=5), st.integers(), max_size=2),
)
_FIELDS = ["model", "n", "temperature", "top_p", "top_k", "min_p", "seed", "stop", "logprobs", "top_logprobs",
           "presence_penalty", "frequency_penalty", "repetition_penalty", "min_tokens", "ignore_eos",
           "stop_token_ids", "stream", "stream_options", "best_of", "echo", "logit_bias", "prompt", "messages"]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(route=st.sampled_from(["/v1/completions", "/v1/chat/completions"]),
       fields=st.dictionaries(st.sampled_from(_FIELDS), _ANY, max_size=5),
       max_tokens=st.one_of(st.integers(min_value=-3, max_value=4), st.just(10**12), st.just(float("nan"))))
def test_fuzzed_bodies_get_4xx_or_a_short_answer(cluster: LocalCluster, route: str, fields: dict[str, Any],
                                                 max_tokens: Any) -> None:
    body = {"prompt": "Hi", "messages": CHAT, **fields, "max_tokens": max_tokens}
    raw = json.dumps(body, allow_nan=True).encode()
    start = time.monotonic()
    status, _, reply = _http(cluster, "POST", route, raw=raw)
    assert status in (200, 400, 404), (body, status, reply)
    if status != 200:
        _assert_envelope(reply, status)
        assert "Traceback" not in reply["error"]["message"]
    assert time.monotonic() - start < 60


def test_advisory_inputs_are_refused_and_the_server_stays_well(cluster: LocalCluster) -> None:
    router_pid = cluster.process("router").popen.pid
    rss_before = _rss_mb(router_pid)
    cases = [
        ("/v1/completions", {"prompt": "hi", "n": 10**9}),
        ("/v1/completions", {"prompt": "hi", "max_tokens": 10**6}),
        ("/v1/completions", {"prompt": "hi", "logprobs": 10**4}),
        ("/v1/completions", {"prompt": ["hi"] * 10_000, "max_tokens": 1}),
        ("/v1/completions", {"prompt": [10**9, -1], "max_tokens": 1}),
        ("/v1/chat/completions", {"messages": CHAT, "temperature": float("nan")}),
        ("/v1/chat/completions", {"messages": CHAT, "top_p": -0.5}),
        ("/v1/chat/completions", {"messages": CHAT, "max_tokens": 2, "min_tokens": 5}),
        ("/v1/chat/completions", {"messages": CHAT, "model": "../../etc/passwd"}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": 42}]}),
    ]
    for route, body in cases:
        status, _, error = _http(cluster, "POST", route, raw=json.dumps(body, allow_nan=True).encode())
        assert 400 <= status < 500, (body, status, error)
        _assert_envelope(error, status)
    assert _post_huge_body(cluster, 100 << 20).startswith(b"HTTP/1.1 413")  # 100 MB: refused unread
    assert _rss_mb(router_pid) - rss_before < 300, "router memory grew by more than 300 MB"
    assert _http(cluster, "GET", "/health", key=None)[0] == 200
    status, _, body = _http(cluster, "POST", "/v1/completions", {"prompt": "The capital of France is", "max_tokens": 2})
    assert status == 200 and body["usage"]["completion_tokens"] == 2
    _assert_blocks_return(cluster)


def test_dead_decode_mid_stream_error_frame_then_503(cluster: LocalCluster, client: Any) -> None:
    """Last in this module: it kills the decode instance."""
    stream = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=900, stream=True,
                                            extra_body={"ignore_eos": True})
    chunks = iter(stream)
    next(chunks)
    cluster.kill("decode-0")
    with pytest.raises(openai.APIError, match="decode"):  # the `data: {"error": ...}` frame
        for _ in chunks:
            pass
    deadline = time.monotonic() + 10
    while _http(cluster, "GET", "/health", key=None)[0] != 503:
        assert time.monotonic() < deadline, "/health still 200 after the decode instance died"
        time.sleep(0.2)
    status, headers, error = _http(cluster, "POST", "/v1/completions", {"prompt": "hi", "max_tokens": 2})
    assert status == 503, error
    assert int(headers["retry-after"]) >= 1
    _assert_envelope(error, 503)
