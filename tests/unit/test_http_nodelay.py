"""The HTTP front's connections send without Nagle's delay (TCP_NODELAY): uvicorn writes a
response's head and body apart, and on a kept-alive connection the body would otherwise wait
for the client's delayed ACK on every request."""

from __future__ import annotations

import socket
from typing import Any

from vllm_cluster.router.openai.app import HttpServer


async def _ok(scope: dict[str, Any], receive: Any, send: Any) -> None:
    if scope["type"] != "http":
        return
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
    await send({"type": "http.response.body", "body": b"ok"})


def test_each_connection_is_tcp_nodelay() -> None:
    server = HttpServer(_ok, "127.0.0.1", 0).start()  # type: ignore[arg-type]
    try:
        with socket.create_connection(("127.0.0.1", server.port)) as client:
            client.sendall(b"GET / HTTP/1.1\r\nhost: x\r\n\r\n")
            assert client.recv(1024).startswith(b"HTTP/1.1 200")
            connections = list(server._server.server_state.connections)
            assert connections
            for protocol in connections:
                sock = protocol.transport.get_extra_info("socket")
                assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) != 0
    finally:
        server.stop()
