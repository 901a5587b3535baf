"""Placement rules (`cluster.<pool>.placement`), `cluster.host: node`, `status`'s reading
of a lost node, and what `repair` refuses: no Ray."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from vllm_cluster.cluster.argv import worker_argv
from vllm_cluster.cluster.cli import main
from vllm_cluster.cluster.config_file import load_deployment
from vllm_cluster.cluster.layout import Resources, check_layout
from vllm_cluster.cluster.procs import ProcessRef
from vllm_cluster.cluster.state import ClusterState
from vllm_cluster.cluster.status import InstanceStatus, nodes_gone
from vllm_cluster.engine.errors import ConfigError

TWO_NODES = """\
engine:
  model:
    model: smollm2-135m-instruct
  device: cpu
cluster:
  name: two-nodes
  ray_address: 10.0.0.1:6379
  host: node
  num_prefill: 2
  num_decode: 1
  prefill:
    placement: [{node_a: 1}, {node_b: 0.5}]
  decode:
    placement: [{node_b: 1}]
"""
NODES = Resources(4.0, (0, 0), {"node_a": 100.0, "node_b": 100.0})


def _load(tmp_path: Path, text: str, *overrides: str):  # type: ignore[no-untyped-def]
    path = tmp_path / "cluster.yaml"
    path.write_text(text)
    return load_deployment(path, overrides)


def test_instance_i_takes_rule_i_modulo_the_list(tmp_path: Path) -> None:
    deployment = _load(tmp_path, TWO_NODES, "cluster.num_prefill=3")
    plans = check_layout(deployment, NODES)
    assert [(p.name, p.bundles) for p in plans] == [
        ("prefill-0", ({"CPU": 0.5, "node_a": 1},)),
        ("prefill-1", ({"CPU": 0.5, "node_b": 0.5},)),
        ("prefill-2", ({"CPU": 0.5, "node_a": 1},)),
        ("decode-0", ({"CPU": 0.5, "node_b": 1},)),
    ]
    again = tmp_path / "resolved.yaml"  # the resolved file every process reads keeps the rules
    again.write_text(deployment.process_yaml("prefill"))
    assert load_deployment(again).cluster.prefill.placement == deployment.cluster.prefill.placement


def test_every_rank_of_an_instance_asks_for_the_rule(tmp_path: Path) -> None:
    deployment = _load(tmp_path, TWO_NODES, "cluster.num_prefill=1", "cluster.prefill.pipeline_parallel_size=2")
    prefill = check_layout(deployment, NODES)[0]
    assert prefill.bundles == ({"CPU": 0.5, "node_a": 1}, {"CPU": 0.5, "node_a": 1})


@pytest.mark.parametrize(("rule", "words"), [
    ("[{CPU: 1}]", r"cluster\.prefill\.placement\[0\]: 'CPU' must name a custom Ray resource"),
    ("[node_a]", r"cluster\.prefill\.placement\[0\]: 'node_a' must be a mapping"),
    ("[{}]", r"cluster\.prefill\.placement\[0\]: \{\} must be a mapping"),
    ("[{node_a: 1}, {node_b: 0}]", r"cluster\.prefill\.placement\[1\]\.node_b: 0 must be a number > 0"),
    ("[{node_a: yes}]", r"cluster\.prefill\.placement\[0\]\.node_a: True must be a number > 0"),
])
def test_bad_rules_are_refused_at_their_key(tmp_path: Path, rule: str, words: str) -> None:
    with pytest.raises(ConfigError, match=words):
        _load(tmp_path, TWO_NODES.replace("[{node_a: 1}, {node_b: 0.5}]", rule))


def test_a_rule_no_node_can_meet_is_refused_before_placing(tmp_path: Path) -> None:
    deployment = _load(tmp_path, TWO_NODES)
    with pytest.raises(ConfigError, match=r"cluster\.yaml:12: cluster\.prefill\.placement: prefill-1 asks for the Ray "
                                          r"resource 'node_b', but no Ray node offers it .*--resources"):
        check_layout(deployment, Resources(4.0, (0,), {"node_a": 100.0}))
    with pytest.raises(ConfigError, match=r"cluster\.prefill\.placement: prefill-0 needs 1 of the Ray resource "
                                          r"'node_a' on one node, but the largest offer is 0\.5"):
        check_layout(deployment, Resources(4.0, (0, 0), {"node_a": 0.5, "node_b": 100.0}))
    with pytest.raises(ConfigError, match="no Ray node offers it"):  # a Ray `up` starts has no custom resources
        check_layout(deployment, Resources(4.0, (0,)))


def test_host_node_binds_each_server_to_its_node(tmp_path: Path) -> None:
    deployment = _load(tmp_path, TWO_NODES)
    argv = worker_argv(deployment, check_layout(deployment, NODES)[0])
    assert argv[argv.index("--host") + 1] == "{node_ip}"  # filled in on the node (cluster/process_host.py)
    assert argv[argv.index("--kv-host") + 1] == "{node_ip}"
    loopback = _load(tmp_path, TWO_NODES.replace("  host: node\n", ""))
    argv = worker_argv(loopback, check_layout(loopback, NODES)[0])
    assert argv[argv.index("--host") + 1] == argv[argv.index("--kv-host") + 1] == "127.0.0.1"


def _status(name: str, node: str, up: bool) -> InstanceStatus:
    return InstanceStatus(name, name.split("-")[0], f"{node}:1", 1, alive=up, healthy=up, node=node)


def test_a_node_is_gone_when_none_of_its_processes_answers() -> None:
    statuses = [_status("router", "10.0.0.1", True), _status("prefill-0", "10.0.0.1", True),
                _status("prefill-1", "10.0.0.2", False), _status("decode-0", "10.0.0.2", False),
                _status("decode-1", "10.0.0.3", False), _status("prefill-2", "10.0.0.3", True)]
    assert nodes_gone(statuses) == {"10.0.0.2": ["prefill-1", "decode-0"]}  # 10.0.0.3: one crash, not a node
    assert nodes_gone([_status("prefill-0", "127.0.0.1", False)]) == {}  # one machine: crashes only


def test_repair_refuses_a_cluster_a_foreground_up_owns(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = tmp_path / "cluster.yaml"
    config.write_text(TWO_NODES)
    me = ProcessRef.of(os.getpid())
    ClusterState(
        name="two-nodes", config_file=str(config), token="t", api_key="", router_address="127.0.0.1:1",
        http_address="http://127.0.0.1:2", redis_url="", log_dir=str(tmp_path), ray_address="10.0.0.1:6379",
        ray_namespace="vllm-cluster.two-nodes", ray_head=None, owner=me,
    ).save(tmp_path / "state" / "two-nodes.json")
    assert main(["repair", "-f", str(config), "--state-dir", str(tmp_path / "state")]) == 1
    assert "belongs to a foreground `vllm-cluster up`" in capsys.readouterr().err
