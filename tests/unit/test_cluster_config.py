"""The cluster YAML (cluster/config_file.py, cluster/layout.py): defaults, every refusal at
its file:line, overrides, the placement plan, and `vllm-cluster up` refusing a bad file
before it starts anything."""

from __future__ import annotations

import os
import socket
import stat
from pathlib import Path

import pytest
import yaml

from vllm_cluster.cluster.argv import redis_env, router_argv, worker_argv
from vllm_cluster.cluster.cli import main
from vllm_cluster.cluster.config_file import load_deployment
from vllm_cluster.cluster.layout import (
    Resources,
    check_engine_roles,
    check_layout,
    check_ports_free,
    listen_ports,
    plan_instances,
)
from vllm_cluster.cluster.procs import ProcessRef
from vllm_cluster.cluster.state import ClusterState, ProcessRecord
from vllm_cluster.engine.config import EngineConfig
from vllm_cluster.engine.errors import ConfigError
from vllm_cluster.worker.router_config import RouterConfig
from vllm_cluster.worker.rpc import REDIS_URL_ENV

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
SMALL = """\
engine:
  model:
    model: smollm2-135m-instruct
  device: cpu
cluster:
  name: small
  num_prefill: 1
  num_decode: 1
router:
  port: 0
  http_port: 0
"""
TWO_CPUS = Resources(2.0, (0,))


def _file(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "cluster.yaml"
    path.write_text(text)
    return path


def _refused(tmp_path: Path, text: str, *overrides: str) -> str:
    with pytest.raises(ConfigError) as e:
        load_deployment(_file(tmp_path, text), overrides)
    return str(e.value)


def test_local_yaml_loads_with_defaults() -> None:
    deployment = load_deployment(CONFIGS / "local.yaml")
    assert deployment.cluster.name == "local"
    assert deployment.cluster.ray_address == ""
    assert deployment.parallel_of("prefill") == (1, 1)
    assert deployment.pool("decode").num_cpus_per_rank == 0.5
    assert deployment.router.port == 50051
    assert deployment.engine.cache.num_blocks == 1024


@pytest.mark.parametrize(("text", "line", "words"), [
    (SMALL + "extra: 1\n", 12, "unknown key 'extra'"),
    (SMALL.replace("  device: cpu\n", "  device: cpu\n  cache:\n    blok_size: 16\n"), 6, "blok_size"),
    (SMALL.replace("  name: small\n", "  name: small\n  num_gpus: 3\n"), 7, "unknown key cluster.num_gpus"),
    (SMALL.replace("  http_port: 0\n", "  http_port: 0\n  polcy: x\n"), 12, "unknown key router.polcy"),
    (SMALL.replace("  num_decode: 1", "  num_decode: 0"), 8, "cluster.num_decode: 0 must be >= 1"),
    (SMALL.replace("  port: 0", "  port: 70000"), 10, "router.port"),
    (SMALL.replace("  port: 0", "  port: fifty"), 10, "router.port: 'fifty' has type str"),
    (SMALL.replace("  device: cpu", "  device: tpu"), 4, "device: 'tpu'"),
    (SMALL.replace("    model: smollm2-135m-instruct", "    model: smollm2-135m-instruct\n    dtype: fp8"), 4, "dtype"),
    (SMALL + "  policy: fastest\n", 12, "router.policy: 'fastest' is not one of"),
    (SMALL.replace("  num_decode: 1\n", "  num_decode: 1\n  transport: carrier-pigeon\n"), 9, "cluster.transport"),
    (SMALL.replace("  num_decode: 1\n", "  num_decode: 1\n  decode:\n    port: -1\n"), 10, "cluster.decode.port"),
    (SMALL.replace("  name: small", "  name: a/b"), 6, "cluster.name"),
    (SMALL + "  port: 1\n", 12, "router.port is given twice"),
])
def test_refusals_name_file_line_and_key(tmp_path: Path, text: str, line: int, words: str) -> None:
    message = _refused(tmp_path, text)
    assert message.startswith(f"{tmp_path / 'cluster.yaml'}:{line}: "), message
    assert words in message


def test_kv_cache_dtype_reaches_both_pools_and_cannot_differ(tmp_path: Path) -> None:
    """engine.cache.kv_cache_dtype is every instance's: both pools' resolved files carry it
    (prefill and decode must agree: their KV moves as raw bytes), and no pool key sets its own."""
    text = SMALL.replace("  device: cpu\n", "  device: cpu\n  cache:\n    kv_cache_dtype: fp8\n")
    deployment = load_deployment(_file(tmp_path, text))
    for role in ("prefill", "decode"):
        resolved = tmp_path / f"{role}.yaml"
        resolved.write_text(deployment.process_yaml(role))
        assert EngineConfig.from_yaml(resolved).cache.kv_cache_dtype == "fp8"
    bad = SMALL.replace("  device: cpu\n", "  device: cpu\n  cache:\n    kv_cache_dtype: fp4\n")
    message = _refused(tmp_path, bad)
    assert message.startswith(f"{tmp_path / 'cluster.yaml'}:6: ") and "'fp4' is not one of" in message
    per_pool = SMALL.replace("  num_decode: 1\n", "  num_decode: 1\n  prefill:\n    kv_cache_dtype: fp8\n")
    assert "unknown key cluster.prefill.kv_cache_dtype" in _refused(tmp_path, per_pool)


def test_not_yaml_and_missing_file(tmp_path: Path) -> None:
    assert ":3: not valid YAML" in _refused(tmp_path, "engine:\n  device: cpu\n\tcache: {}\n")
    with pytest.raises(ConfigError, match="cannot read the config file"):
        load_deployment(tmp_path / "nope.yaml")


def test_overrides_replace_keys_and_name_the_flag(tmp_path: Path) -> None:
    path = _file(tmp_path, SMALL)
    deployment = load_deployment(path, ["router.port=9000", "cluster.num_decode=2",
                                        "cluster.prefill.port=7000", "engine.cache.num_blocks=64"])
    assert deployment.router.port == 9000
    assert deployment.cluster.num_decode == 2
    assert deployment.pool("prefill").port == 7000
    assert deployment.engine.cache.num_blocks == 64
    assert _refused(tmp_path, SMALL, "router.policy=fastest").startswith("--set router.policy=fastest: ")
    assert "write it as section.key=value" in _refused(tmp_path, SMALL, "router.port")
    assert "engine.model is not a section" not in _refused(tmp_path, SMALL, "cluster.num_decode=zero")


def test_cli_flags_override_the_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = _file(tmp_path, SMALL)
    argv = ["up", "-f", str(path), "--dry-run", "--state-dir", str(tmp_path / "state"), "--port", "9123",
            "--num-decode", "2", "--name", "other", "--set", "cluster.decode.port=9200"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "cluster 'other'" in out and "127.0.0.1:9123" in out
    assert "decode-1" in out and "port 9201" in out
    assert not (tmp_path / "state").exists()


def test_plan_and_process_yaml(tmp_path: Path) -> None:
    text = SMALL.replace(
        "  num_decode: 1\n", "  num_decode: 2\n  decode:\n    port: 7100\n    num_cpus_per_rank: 0.25\n"
    )
    deployment = load_deployment(_file(tmp_path, text))
    plans = check_layout(deployment, TWO_CPUS)
    assert [(p.name, p.port, p.bundles) for p in plans] == [
        ("prefill-0", 0, ({"CPU": 0.5},)), ("decode-0", 7100, ({"CPU": 0.25},)), ("decode-1", 7101, ({"CPU": 0.25},)),
    ]
    resolved = tmp_path / "resolved.yaml"
    resolved.write_text(deployment.process_yaml("decode"))
    assert EngineConfig.from_yaml(resolved) == deployment.engine
    assert RouterConfig.from_dict(yaml.safe_load(resolved.read_text())["router"]) == deployment.router


def test_prod_yaml_plans_eight_gpus() -> None:
    deployment = load_deployment(CONFIGS / "prod.yaml")
    plans = check_layout(deployment, Resources(64.0, (8,)))
    assert [(p.name, len(p.bundles)) for p in plans] == [
        ("prefill-0", 2), ("prefill-1", 2), ("decode-0", 1), ("decode-1", 1), ("decode-2", 1), ("decode-3", 1),
    ]
    assert all(b == {"GPU": 1.0} for p in plans for b in p.bundles)
    assert [p.port for p in plans] == [50100, 50101, 50200, 50201, 50202, 50203]
    assert deployment.engine_for("prefill").parallel.tensor_parallel_size == 2
    assert deployment.redis_url and deployment.cluster.ray_address == "auto"
    with pytest.raises(
        ConfigError, match=r"prod\.yaml:\d+: cluster\.prefill\.tensor_parallel_size: .* largest node has 1"
    ):
        check_layout(deployment, Resources(64.0, (1,) * 8))
    with pytest.raises(ConfigError, match="the pools need 8 GPUs"):
        check_layout(deployment, Resources(64.0, (4,)))


def test_layouts_that_cannot_fit_are_refused_at_their_line(tmp_path: Path) -> None:
    text = SMALL.replace(
        "  num_decode: 1\n", "  num_decode: 1\n  prefill:\n    tensor_parallel_size: 3\n    num_cpus_per_rank: 1\n"
    )
    with pytest.raises(
        ConfigError, match=r"cluster\.yaml:10: cluster\.prefill\.tensor_parallel_size: prefill instances need 3"
    ):
        check_layout(load_deployment(_file(tmp_path, text)), TWO_CPUS)
    # SmolLM2-135M has 9 query heads and 3 KV heads: tp 2 cannot split them.
    text = SMALL.replace("  num_decode: 1\n", "  num_decode: 1\n  decode:\n    tensor_parallel_size: 2\n")
    with pytest.raises(ConfigError, match=r":10: cluster\.decode\.tensor_parallel_size: .*num_attention_heads \(9\)"):
        check_layout(load_deployment(_file(tmp_path, text)), Resources(8.0, (0,)))
    with pytest.raises(ConfigError, match=r":4: engine\.device: 'cuda' but there is no GPU here"):
        check_layout(load_deployment(_file(tmp_path, SMALL.replace("device: cpu", "device: cuda"))), TWO_CPUS)
    with pytest.raises(ConfigError, match="the pools and the router need 2.25 CPUs"):
        check_layout(load_deployment(_file(tmp_path, SMALL), ["cluster.num_decode=3"]), TWO_CPUS)


def test_what_the_engine_refuses_for_a_pool_is_refused_at_its_line(tmp_path: Path) -> None:
    text = SMALL.replace("  num_decode: 1\n", "  num_decode: 1\n  prefill:\n    tensor_parallel_size: 3\n")
    deployment = load_deployment(_file(tmp_path, text))
    try:  # today the prefill role runs on one process; this follows the engine when it grows
        deployment.engine_for("prefill").with_overrides(role="prefill")
    except ConfigError as e:
        with pytest.raises(ConfigError) as refused:
            check_engine_roles(deployment)
        assert str(refused.value) == f"{tmp_path / 'cluster.yaml'}:10: cluster.prefill: {e}"
    else:
        check_engine_roles(deployment)


def test_ports_in_use_or_shared_are_refused(tmp_path: Path) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        deployment = load_deployment(_file(tmp_path, SMALL.replace("  port: 0", f"  port: {port}")))
        with pytest.raises(ConfigError, match=rf"cluster\.yaml:10: router\.port: port {port} is in use"):
            check_ports_free(deployment, listen_ports(deployment, []), "127.0.0.1")
    deployment = load_deployment(_file(tmp_path, SMALL), ["cluster.decode.port=7000", "cluster.decode.kv_port=7000"])
    with pytest.raises(ConfigError, match="is also cluster.decode.port's"):
        listen_ports(deployment, check_layout(deployment, TWO_CPUS))


def test_up_with_a_bad_file_starts_nothing(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    state_dir = tmp_path / "state"
    path = _file(tmp_path, SMALL.replace("  num_decode: 1", "  num_decode: 1\n  num_gpu: 1"))
    assert main(["up", "-f", str(path), "--detach", "--state-dir", str(state_dir)]) == 2
    assert f"error: {path}:9: unknown key cluster.num_gpu" in capsys.readouterr().err
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        assert main(["up", "-f", str(_file(tmp_path, SMALL)), "--detach", "--state-dir", str(state_dir),
                     "--http-port", str(port)]) == 2
    assert f"--set router.http_port={port}: router.http_port: port {port} is in use" in capsys.readouterr().err
    assert not state_dir.exists()


def test_state_file_is_private_and_round_trips(tmp_path: Path) -> None:
    me = ProcessRef.of(os.getpid())
    state = ClusterState(
        name="x", config_file="c.yaml", token="secret", api_key="", router_address="127.0.0.1:1",
        http_address="http://127.0.0.1:2", redis_url="", log_dir=str(tmp_path), ray_address="127.0.0.1:3",
        ray_namespace="vllm-cluster.x", ray_head=None, owner=me,
        processes=[ProcessRecord("decode-0", "decode", "127.0.0.1:4", me, "d.log", actor_names=["decode-0.rank0"])],
    )
    path = tmp_path / "state" / "x.json"
    state.save(path)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    assert ClusterState.load(path) == state
    assert me.alive() and not ProcessRef(me.pid, me.start_ticks + 1).alive()


def test_resolved_yaml_holds_no_api_key(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """What `up` and `vllm-cluster worker` write next to the logs: the router takes the key
    from its environment instead."""
    key = "sk-never-on-disk"
    deployment = load_deployment(_file(tmp_path, SMALL), [f"router.api_key={key}"])
    assert deployment.router.api_key == key
    for role in ("prefill", "decode"):
        assert key not in deployment.process_yaml(role)
    resolved = tmp_path / "prefill-0.yaml"
    assert main(["worker", "prefill", "-f", str(tmp_path / "cluster.yaml"), "--set", f"router.api_key={key}",
                 "--resolved-config", str(resolved), "--dry-run"]) == 0
    assert "vllm_cluster.prefill_service" in capsys.readouterr().out
    assert resolved.exists() and key not in resolved.read_text()


def test_a_redis_password_is_in_no_command_line_and_no_resolved_yaml(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`ps` shows every process's arguments to every user, and the resolved YAML lies next
    to the logs: the Redis URL reaches workers and the router in their environment."""
    url = "redis://:s3cret-pass@10.0.0.5:6379"
    deployment = load_deployment(_file(tmp_path, SMALL), [f"cluster.redis_url={url}"])
    assert deployment.redis_url == url
    for role in ("prefill", "decode"):
        assert "s3cret-pass" not in deployment.process_yaml(role)
    plans = plan_instances(deployment, use_gpus=False)
    assert not any("s3cret-pass" in " ".join(worker_argv(deployment, p)) for p in plans)
    assert "s3cret-pass" not in " ".join(router_argv(deployment, ["a:1"], ["b:2"]))
    assert redis_env(deployment, deployment.redis_url) == {REDIS_URL_ENV: url}
    resolved = tmp_path / "decode-0.yaml"
    assert main(["worker", "decode", "-f", str(tmp_path / "cluster.yaml"), "--set", f"cluster.redis_url={url}",
                 "--resolved-config", str(resolved), "--dry-run"]) == 0
    assert capsys.readouterr().out.startswith(f"{REDIS_URL_ENV}={url} ")  # the command for a container, in full
    assert "s3cret-pass" not in resolved.read_text()
