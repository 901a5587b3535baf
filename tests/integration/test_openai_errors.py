"""The OpenAI-compatible HTTP API's refusals against a real local cluster: the API key,
bad parameters, oversized and malformed bodies, disconnects, overload, fuzzed bodies and a
decode instance dying mid-stream. Every refusal is the error envelope with the right
status, and every KV block comes back.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.integration.openai_support import (
    CHAT,
    KEY,
    MODEL,
    assert_blocks_return,
    assert_envelope,
    http,
    post_huge_body,
    post_partial_body,
    rss_mb,
    send_and_wait,
    start_cluster,
    start_front,
)
from vllm_cluster.cluster.local import LocalCluster

openai = pytest.importorskip("openai")
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    yield from start_cluster(tmp_path_factory, "openai-errors-cluster")


@pytest.fixture(scope="module")
def client(cluster: LocalCluster) -> Any:
    return openai.OpenAI(base_url=cluster.http_address + "/v1", api_key=KEY, max_retries=0, timeout=120)


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
        status, _, error = http(cluster, method, path, body, key=key)
        assert status == 401, (path, key)
        assert_envelope(error, 401)
    status, _, _ = http(cluster, method, path, body)
    assert status == 200, path


def test_request_id_echoed(cluster: LocalCluster) -> None:
    _, headers, _ = http(cluster, "GET", "/v1/models", headers={"X-Request-Id": "my-id-42"})
    assert headers.get("x-request-id") == "my-id-42"
    _, headers, _ = http(cluster, "GET", "/v1/models")
    assert len(headers.get("x-request-id", "")) >= 16
    _, headers, _ = http(cluster, "POST", "/v1/chat/completions", {"messages": []}, headers={"X-Request-Id": "bad-1"})
    assert headers.get("x-request-id") == "bad-1"


@pytest.mark.parametrize(("body", "param"), [
    ({"messages": CHAT, "temperature": -1}, "temperature"),
    ({"messages": CHAT, "top_p": 0}, "top_p"),
    ({"messages": CHAT, "top_p": 1.5}, "top_p"),
    ({"messages": CHAT, "top_k": -2}, "top_k"),
    ({"messages": CHAT, "min_p": 1.5}, "min_p"),
    ({"messages": CHAT, "presence_penalty": 2.5}, "presence_penalty"),
    ({"messages": CHAT, "frequency_penalty": -3}, "frequency_penalty"),
    ({"messages": CHAT, "repetition_penalty": 0}, "repetition_penalty"),
    ({"messages": CHAT, "repetition_penalty": 3}, "repetition_penalty"),
    ({"messages": CHAT, "n": 0}, "n"),
    ({"messages": CHAT, "n": 10_000}, "n"),
    ({"messages": CHAT, "max_tokens": 0}, "max_tokens"),
    ({"messages": CHAT, "max_tokens": 4, "min_tokens": 8}, "min_tokens"),
    ({"messages": CHAT, "logprobs": True, "top_logprobs": 50}, "top_logprobs"),
    ({"messages": CHAT, "logprobs": True, "top_logprobs": -1}, "top_logprobs"),
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
    status, _, error = http(cluster, "POST", "/v1/chat/completions", body)
    assert status == 400, error
    assert_envelope(error, 400, param)
    assert error["error"]["type"] == "BadRequestError"


def test_context_too_long_and_unknown_model(cluster: LocalCluster) -> None:
    status, _, error = http(cluster, "POST", "/v1/completions", {"prompt": "hello " * 1100, "max_tokens": 1})
    assert status == 400 and "maximum context length is 1024" in error["error"]["message"]
    status, _, error = http(cluster, "POST", "/v1/completions", {"prompt": "hi", "model": "nope"})
    assert status == 404
    assert_envelope(error, 404, "model")
    status, _, error = http(cluster, "POST", "/v1/nothing-here", {})
    assert status == 404
    assert_envelope(error, 404)


def test_body_too_large_and_malformed(cluster: LocalCluster) -> None:
    status, _, error = http(cluster, "POST", "/v1/completions", {"prompt": "x" * 100_000})
    assert status == 413
    assert_envelope(error, 413)
    status, _, error = http(cluster, "POST", "/v1/completions", raw=b"{not json")
    assert status == 400
    assert_envelope(error, 400)
    status, _, error = http(cluster, "POST", "/v1/completions", raw=b'{"prompt": "\xff\xfe"}')
    assert status == 400
    assert http(cluster, "GET", "/health", key=None)[0] == 200  # still serving


@pytest.mark.parametrize("content_type", ["text/plain", "application/x-www-form-urlencoded"])
def test_body_that_is_not_json_says_to_send_json(cluster: LocalCluster, content_type: str) -> None:
    raw = json.dumps({"prompt": "hi", "max_tokens": 1}).encode()
    status, _, error = http(cluster, "POST", "/v1/completions", raw=raw, headers={"Content-Type": content_type})
    assert status == 400, error
    assert_envelope(error, 400)
    assert "JSON object" in error["error"]["message"] and "application/json" in error["error"]["message"]
    assert "valid dictionary" not in error["error"]["message"]
    status, _, error = http(cluster, "POST", "/v1/completions", raw=b'["hi"]')
    assert status == 400 and "JSON object" in error["error"]["message"], error


_SURROGATES = [  # raw JSON: a lone surrogate escape where the API takes text, and the param named
    ("/v1/completions", rb'{"prompt": "hi \ud800", "max_tokens": 1}', "prompt"),
    ("/v1/completions", rb'{"prompt": ["ok", "hi \udc00"], "max_tokens": 1}', "prompt.1"),
    ("/v1/completions", rb'{"prompt": "hi", "max_tokens": 1, "stop": ["\ud83d"]}', "stop.0"),
    ("/v1/chat/completions", rb'{"messages": [{"role": "user", "content": "hi \ud800"}]}', "messages.0.content"),
    ("/v1/chat/completions", rb'{"messages": [{"role": "user", "content": [{"type": "text", "text": "\udfff"}]}]}',
     "messages.0.content.0.text"),
    ("/v1/chat/completions", rb'{"messages": [{"role": "user", "content": "hi"}], "user": "\ud800"}', "user"),
    ("/v1/responses", rb'{"input": "hi \ud800", "max_output_tokens": 1}', "input"),
    ("/v1/responses", rb'{"input": [{"role": "user", "content": "\ud800 hi"}]}', "input.0.content"),
    ("/tokenize", rb'{"prompt": "hi \ud800"}', "prompt"),
    ("/tokenize", rb'{"messages": [{"role": "user", "content": "hi \ud800"}]}', "messages.0.content"),
]


@pytest.mark.parametrize(("path", "raw", "param"), _SURROGATES)
def test_lone_surrogate_is_a_400_naming_the_field(cluster: LocalCluster, path: str, raw: bytes, param: str) -> None:
    status, _, error = http(cluster, "POST", path, raw=raw)
    assert status == 400, error
    assert_envelope(error, 400, param)
    message = error["error"]["message"]
    assert "UTF-8" in message and "surrogate" in message and param in message


def test_surrogate_pair_is_text(cluster: LocalCluster) -> None:
    status, _, body = http(cluster, "POST", "/tokenize", raw=rb'{"prompt": "smile \ud83d\ude00"}')
    assert status == 200 and body["count"] > 1
    status, _, same = http(cluster, "POST", "/tokenize", {"prompt": "smile \U0001f600"})
    assert same["tokens"] == body["tokens"]


def test_auth_scheme_is_case_insensitive_and_the_key_exact(cluster: LocalCluster) -> None:
    for scheme in ("bearer", "BEARER", "bEaReR"):
        status, _, body = http(cluster, "GET", "/v1/models", key=None, headers={"Authorization": f"{scheme} {KEY}"})
        assert status == 200, (scheme, body)
    for value in (f"bearer {KEY.upper()}", f"bearer {KEY}x", f"Basic {KEY}", f"bearer{KEY}", KEY):
        status, _, error = http(cluster, "GET", "/v1/models", key=None, headers={"Authorization": value})
        assert status == 401, value
        assert_envelope(error, 401)


def test_wrong_method_is_405_with_allow(cluster: LocalCluster) -> None:
    for method, path, allowed in (("GET", "/v1/chat/completions", "POST"), ("DELETE", "/v1/models", "GET")):
        status, headers, error = http(cluster, method, path)
        assert status == 405, error
        assert_envelope(error, 405)
        assert error["error"]["type"] == "MethodNotAllowedError"
        assert allowed in [m.strip() for m in headers["allow"].split(",")]


def test_openapi_document_agrees_with_the_server(cluster: LocalCluster) -> None:
    status, _, doc = http(cluster, "GET", "/openapi.json")
    assert status == 200
    envelope = doc["components"]["schemas"]["ErrorResponse"]
    assert set(envelope["properties"]) == {"error"}
    paths = doc["paths"]
    status, headers, body = http(cluster, "GET", "/health", key=None)
    assert status == 200 and not body and "content-type" not in {k.lower() for k in headers}
    assert "content" not in paths["/health"]["get"]["responses"]["200"]
    assert "503" in paths["/health"]["get"]["responses"]
    status, headers, _ = http(cluster, "GET", "/metrics")
    assert headers["content-type"].startswith("text/plain")
    assert list(paths["/metrics"]["get"]["responses"]["200"]["content"]) == ["text/plain"]
    for path, operations in paths.items():
        for method, operation in operations.items():
            responses = operation["responses"]
            assert "422" not in responses, (path, method)  # validation failures are 400s
            if path != "/health":
                assert "401" in responses, (path, method)
            if method == "post":
                assert {"400", "408", "413"} <= set(responses), (path, method)
            for code, response in responses.items():
                if code.startswith(("4", "5")) and path != "/health":
                    schema = response["content"]["application/json"]["schema"]
                    body = "AnthropicErrorResponse" if path.startswith("/v1/messages") else "ErrorResponse"
                    assert schema == {"$ref": f"#/components/schemas/{body}"}, (path, method, code)
    for path in ("/v1/completions", "/v1/chat/completions", "/v1/responses"):
        assert {"404", "429", "503"} <= set(paths[path]["post"]["responses"]), path


def test_slow_body_is_cut_off_with_408(cluster: LocalCluster) -> None:
    """A second front on the same router with a short body timeout: a body that stops
    arriving gets 408 and a closed connection; an answer that takes longer than the
    timeout (the body was whole) is not cut off."""
    with start_front(cluster.router_address, body_timeout_s=1.0) as front:
        answer, closed = post_partial_body(front, 1000, b'{"prompt":')
        assert answer.startswith(b"HTTP/1.1 408"), answer
        assert closed, "the connection stayed open after the 408"
        assert b'"code":408' in answer
        status, _, body = http(front, "POST", "/v1/completions",
                               {"prompt": [1, 2, 3], "max_tokens": 96, "ignore_eos": True, "temperature": 0})
        assert status == 200 and body["usage"]["completion_tokens"] == 96, body
    assert_blocks_return(cluster)


def test_slow_headers_are_cut_off_with_408(cluster: LocalCluster) -> None:
    """A front with a 1 s header timeout: headers that trickle in, or never come, get 408
    and a closed connection; a whole request on the next connection is served."""
    with start_front(cluster.router_address, header_timeout_s=1.0) as front:
        for sent in (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: app", b""):
            started = time.monotonic()
            answer, closed = send_and_wait(front, sent)
            assert answer.startswith(b"HTTP/1.1 408") and closed, (sent, answer)
            assert time.monotonic() - started < 10
        status, _, body = http(front, "POST", "/v1/completions", {"prompt": [1, 2, 3], "max_tokens": 2})
        assert status == 200, body


def test_stream_error_before_first_token_is_plain_http_error(cluster: LocalCluster) -> None:
    status, headers, error = http(cluster, "POST", "/v1/chat/completions",
                                   {"messages": CHAT, "stream": True, "stop_token_ids": [10**8]})
    assert status == 400, error
    assert headers.get("content-type", "").startswith("application/json")
    assert_envelope(error, 400)


def test_disconnect_mid_stream_frees_blocks(cluster: LocalCluster, client: Any) -> None:
    # 900 tokens take far longer than the 5 s allowed: only the hang-up can free the blocks.
    stream = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=900, stream=True,
                                            extra_body={"ignore_eos": True})
    for i, _ in enumerate(stream):
        if i == 3:
            break
    stream.close()
    assert_blocks_return(cluster, timeout_s=5)


def test_overload_gives_429_with_retry_after(cluster: LocalCluster, client: Any) -> None:
    """Decode holds 96 blocks: one 900-token prompt in flight leaves no room for another."""
    long_a = "alpha beta gamma delta " * 220
    long_b = "one two three four five " * 180
    holder = client.completions.create(model=MODEL, prompt=long_a, max_tokens=100, temperature=0, stream=True,
                                       extra_body={"ignore_eos": True})
    first = next(iter(holder))  # the first token: its blocks are reserved on decode
    assert first.choices
    status, headers, error = http(cluster, "POST", "/v1/completions", {"prompt": long_b, "max_tokens": 8})
    holder.close()
    assert status == 429, error
    assert int(headers["retry-after"]) >= 1
    assert_envelope(error, 429)
    assert_blocks_return(cluster)
    # Once the holder is gone, the same request is served.
    status, _, body = http(cluster, "POST", "/v1/completions", {"prompt": long_b, "max_tokens": 2})
    assert status == 200 and body["choices"][0]["text"]


_ANY = st.one_of(
    st.none(), st.booleans(), st.integers(min_value=-(2**63), max_value=2**63), st.floats(allow_nan=True),
    st.text(max_size=20), st.lists(st.integers(min_value=-5, max_value=10**9), max_size=5),
    st.dictionaries(st.text(max_size=5), st.integers(), max_size=2),
)
_FIELDS = ["model", "n", "temperature", "top_p", "top_k", "min_p", "seed", "stop", "logprobs", "top_logprobs",
           "presence_penalty", "frequency_penalty", "repetition_penalty", "min_tokens", "ignore_eos",
           "stop_token_ids", "stream", "stream_options", "best_of", "echo", "logit_bias", "prompt", "messages",
           "prompt_logprobs"]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(route=st.sampled_from(["/v1/completions", "/v1/chat/completions"]),
       fields=st.dictionaries(st.sampled_from(_FIELDS), _ANY, max_size=5),
       max_tokens=st.one_of(st.integers(min_value=-3, max_value=4), st.just(10**12), st.just(float("nan"))))
def test_fuzzed_bodies_get_4xx_or_a_short_answer(cluster: LocalCluster, route: str, fields: dict[str, Any],
                                                 max_tokens: Any) -> None:
    body = {"prompt": "Hi", "messages": CHAT, **fields, "max_tokens": max_tokens}
    raw = json.dumps(body, allow_nan=True).encode()
    start = time.monotonic()
    status, _, reply = http(cluster, "POST", route, raw=raw)
    assert status in (200, 400, 404), (body, status, reply)
    if status != 200:
        assert_envelope(reply, status)
        assert "Traceback" not in reply["error"]["message"]
    assert time.monotonic() - start < 60


def test_advisory_inputs_are_refused_and_the_server_stays_well(cluster: LocalCluster) -> None:
    router_pid = cluster.process("router").popen.pid
    rss_before = rss_mb(router_pid)
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
        status, _, error = http(cluster, "POST", route, raw=json.dumps(body, allow_nan=True).encode())
        assert 400 <= status < 500, (body, status, error)
        assert_envelope(error, status)
    assert post_huge_body(cluster, 100 << 20).startswith(b"HTTP/1.1 413")  # 100 MB: refused unread
    assert rss_mb(router_pid) - rss_before < 300, "router memory grew by more than 300 MB"
    assert http(cluster, "GET", "/health", key=None)[0] == 200
    status, _, body = http(cluster, "POST", "/v1/completions", {"prompt": "The capital of France is", "max_tokens": 2})
    assert status == 200 and body["usage"]["completion_tokens"] == 2
    assert_blocks_return(cluster)


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
    while http(cluster, "GET", "/health", key=None)[0] != 503:
        assert time.monotonic() < deadline, "/health still 200 after the decode instance died"
        time.sleep(0.2)
    status, headers, error = http(cluster, "POST", "/v1/completions", {"prompt": "hi", "max_tokens": 2})
    assert status == 503, error
    assert int(headers["retry-after"]) >= 1
    assert_envelope(error, 503)
