"""The HTTP front when the router behind it cannot be reached (gone, restarting, or draining:
a draining router's gRPC port refuses new connections): the real front on uvicorn, in this
process, over a loopback address that refuses connections. No cluster is needed.
"""

from __future__ import annotations

import socket
from typing import Any

import pytest

from tests.integration.openai_support import KEY, assert_envelope, http, refusing_address, start_front

_LEAKS = ("127.0.0.1", "ipv4", "failed to connect", "Connection refused", "<internal>", "UNKNOWN")


@pytest.mark.parametrize(("method", "path", "body"), [
    ("GET", "/v1/models", None),
    ("POST", "/v1/completions", {"prompt": [1, 2, 3], "max_tokens": 2}),
    ("POST", "/v1/completions", {"prompt": [1, 2, 3], "max_tokens": 2, "stream": True}),
    ("POST", "/v1/load_lora_adapter", {"lora_name": "a", "lora_path": "/nowhere"}),
])
def test_unreachable_router_is_a_clean_503_with_retry_after(method: str, path: str, body: Any) -> None:
    with refusing_address() as target, start_front(target) as front:
        for _ in range(2):  # the first call finds the port shut; the next finds the channel backing off
            status, headers, error = http(front, method, path, body)
            assert status == 503, error
            assert int(headers["retry-after"]) >= 1
            assert_envelope(error, 503)
            assert error["error"]["type"] == "ServiceUnavailableError"
            message = error["error"]["message"]
            assert not [leak for leak in _LEAKS if leak in message], message
            assert "retry" in message


def test_chunked_body_over_the_limit_is_413_and_closed() -> None:
    """No Content-Length to refuse up front: the body is counted as it arrives. The client
    still sending after the answer gets the answer and a clean end of stream, not a reset
    (the server drops the rest of the body until the client closes, or LINGER_S passes)."""
    with refusing_address() as target, start_front(target, max_request_bytes=1000) as front:
        host, port = front.http_address.removeprefix("http://").rsplit(":", 1)
        with socket.create_connection((host, int(port)), timeout=15) as sock:
            sock.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n"
                         "Content-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n".encode())
            chunk = b"x" * 600
            for _ in range(3):
                sock.sendall(f"{len(chunk):x}\r\n".encode() + chunk + b"\r\n")
            big = b"y" * 65536
            for _ in range(32):  # 2 MiB: far more than the server reads before it answers
                sock.sendall(f"{len(big):x}\r\n".encode() + big + b"\r\n")
            answer = b""
            while data := sock.recv(4096):  # ends when the server closes the connection
                answer += data
    assert answer.startswith(b"HTTP/1.1 413"), answer
    assert b'"code":413' in answer
