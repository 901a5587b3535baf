"""What the OpenAI HTTP API tests share: the cluster they start, raw HTTP with the API key,
and checks of the error envelope and of every KV block coming back."""

from __future__ import annotations

import contextlib
import json
import socket
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NamedTuple

import pytest

from vllm_cluster.cluster.local import LocalCluster
from vllm_cluster.proto import cluster_pb2 as pb
from vllm_cluster.proto import cluster_pb2_grpc as pb_grpc
from vllm_cluster.router.openai.app import HttpServer, build_app
from vllm_cluster.router.openai.backend import RouterBackend
from vllm_cluster.router.openai.serving import OpenAIServing
from vllm_cluster.worker.rpc import make_channel

CONFIG = Path(__file__).with_name("openai_cluster.yaml")
KEY = "test-key-1"
MODEL = "smollm2-135m-instruct"
CHAT = [{"role": "user", "content": "What is the capital of France?"}]


def start_cluster(tmp_path_factory: pytest.TempPathFactory, name: str) -> Iterator[LocalCluster]:
    """Router + 1 prefill + 1 decode on the bundled model, the API key set (a module fixture)."""
    pytest.importorskip("ucxx")
    local = LocalCluster.from_yaml(CONFIG)
    local.api_key = KEY
    local.log_dir = tmp_path_factory.mktemp(name)
    with local:
        yield local


class Front(NamedTuple):
    """An HTTP front a test starts in its own process."""

    http_address: str


@contextlib.contextmanager
def start_front(
    router_address: str, tokenizer: Any = None, header_timeout_s: float = 10.0, reasoning_parser: str = "",
    **options: Any,
) -> Iterator[Front]:
    """The real HTTP front (build_app on uvicorn, on loopback) over the router's gRPC API at
    `router_address`. Without a tokenizer, prompts are token ids."""
    serving = OpenAIServing(RouterBackend(router_address, KEY), tokenizer, MODEL, 1024, reasoning_parser)
    server = HttpServer(build_app(serving, KEY, **options), "127.0.0.1", 0, header_timeout_s=header_timeout_s).start()
    try:
        yield Front(f"http://127.0.0.1:{server.port}")
    finally:
        server.stop()


@contextlib.contextmanager
def refusing_address() -> Iterator[str]:
    """A loopback address that refuses connections (a bound socket that never listens), as
    a router that is gone or draining does."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        yield f"127.0.0.1:{sock.getsockname()[1]}"


def http(cluster: LocalCluster | Front, method: str, path: str, body: Any = None, key: str | None = KEY,
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


def assert_envelope(body: Any, status: int, param: str | None = None) -> None:
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["code"] == status and error["message"]
    if param is not None:
        assert error["param"] == param


def assert_blocks_return(cluster: LocalCluster, timeout_s: float = 20.0) -> None:
    stubs = [pb_grpc.PrefillWorkerStub(make_channel(a, cluster.token)) for a in cluster.prefill_addresses]
    stubs += [pb_grpc.DecodeWorkerStub(make_channel(a, cluster.token)) for a in cluster.decode_addresses]
    deadline = time.monotonic() + timeout_s
    while True:
        stats = [s.Stats(pb.StatsRequest(), timeout=5) for s in stubs]  # type: ignore[attr-defined]
        busy = [
            (s.role, s.num_free_blocks, s.num_total_blocks, s.num_running, s.num_waiting, s.num_transferring)
            for s in stats
            if s.num_free_blocks != s.num_total_blocks or s.num_running or s.num_waiting or s.num_transferring
        ]
        if not busy:
            return
        assert time.monotonic() < deadline, (
            f"blocks not returned (role, free, total, running, waiting, transferring): {busy}"
        )
        time.sleep(0.2)


def _connect(front: LocalCluster | Front) -> socket.socket:
    host, port = front.http_address.removeprefix("http://").rsplit(":", 1)
    return socket.create_connection((host, int(port)), timeout=30)


def post_partial_body(front: LocalCluster | Front, declared: int, sent: bytes) -> tuple[bytes, bool]:
    """Announce `declared` body bytes, send only `sent`, then wait: what the server answers,
    and whether it then closed the connection (a read of b"" before the socket timeout)."""
    return send_and_wait(front, f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n"
                                f"Content-Type: application/json\r\nContent-Length: {declared}\r\n\r\n".encode() + sent)


def send_and_wait(front: LocalCluster | Front, sent: bytes) -> tuple[bytes, bool]:
    """Send `sent` (a request's start, or nothing) and wait: what the server answers, and
    whether it then closed the connection."""
    with _connect(front) as sock:
        sock.settimeout(15)
        sock.sendall(sent)
        answer = b""
        try:
            while chunk := sock.recv(4096):
                answer += chunk
        except TimeoutError:
            return answer, False
        return answer, True


def post_huge_body(cluster: LocalCluster, size: int) -> bytes:
    """Announce `size` bytes, send the first MiB, read the answer (the server answers and
    closes without reading the rest)."""
    with _connect(cluster) as sock:
        sock.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n"
                     f"Content-Type: application/json\r\nContent-Length: {size}\r\n\r\n".encode())
        with contextlib.suppress(OSError):
            sock.sendall(b"x" * (1 << 20))
        return sock.recv(4096)


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")
