"""TLS on the router's client listeners: a router process started with a self-signed
certificate answers gRPC and HTTPS clients that trust it, and refuses plaintext."""

from __future__ import annotations

import json
import shutil
import ssl
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from vllm_cluster.client import Client, ClientError
from vllm_cluster.engine.errors import ConfigError
from vllm_cluster.worker.router_config import RouterConfig

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def cert(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    if shutil.which("openssl") is None:
        pytest.skip("needs the openssl command")
    out = tmp_path_factory.mktemp("tls")
    cert, key = out / "cert.pem", out / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=localhost",
                    "-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1", "-keyout", str(key), "-out", str(cert)],
                   check=True, capture_output=True)
    return cert, key


@pytest.fixture(scope="module")
def router(cert: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, int]]:
    """The router alone (its decode instance is absent: only model listing is served)."""
    out = tmp_path_factory.mktemp("tls-router")
    config = yaml.safe_load(Path(__file__).with_name("openai_cluster.yaml").read_text())
    config["router"] = {"tls_certfile": str(cert[0]), "tls_keyfile": str(cert[1])}
    path = out / "router.yaml"
    path.write_text(yaml.safe_dump(config))
    ready = out / "ready.json"
    process = subprocess.Popen(
        [sys.executable, "-m", "vllm_cluster.router", "--config", str(path), "--decode", "127.0.0.1:9",
         "--port", "0", "--http-port", "0", "--ready-file", str(ready)],
        stdout=subprocess.DEVNULL, stderr=(out / "router.log").open("wb"),
    )
    deadline = time.monotonic() + 120
    while not ready.exists():
        assert process.poll() is None, (out / "router.log").read_text()[-2000:]
        assert time.monotonic() < deadline, "the router did not start"
        time.sleep(0.1)
    yield json.loads(ready.read_text())
    process.terminate()
    process.wait(timeout=30)


def test_grpc_over_tls(router: dict[str, int], cert: tuple[Path, Path]) -> None:
    with Client(f"localhost:{router['port']}", tls_ca=cert[0], timeout_s=10) as client:
        assert [m.id for m in client.list_models()] == ["smollm2-135m-instruct"]
    with Client(f"127.0.0.1:{router['port']}", timeout_s=5) as plain, pytest.raises(ClientError) as error:
        plain.list_models()
    assert error.value.code.name == "UNAVAILABLE"


def test_https(router: dict[str, int], cert: tuple[Path, Path]) -> None:
    context = ssl.create_default_context(cafile=str(cert[0]))
    with urllib.request.urlopen(f"https://localhost:{router['http_port']}/v1/models", context=context, timeout=10) as r:
        assert json.loads(r.read())["data"][0]["id"] == "smollm2-135m-instruct"
    with pytest.raises((urllib.error.URLError, ConnectionError)):
        urllib.request.urlopen(f"http://127.0.0.1:{router['http_port']}/v1/models", timeout=10)


def test_half_a_tls_config_is_refused(cert: tuple[Path, Path]) -> None:
    with pytest.raises(ConfigError, match="go together"):
        RouterConfig.from_dict({"tls_certfile": str(cert[0])})
    with pytest.raises(ConfigError, match="is not a file"):
        RouterConfig.from_dict({"tls_certfile": "/nonexistent.pem", "tls_keyfile": str(cert[1])})
