"""Which instances `vllm-cluster scale` (and the autoscaler) adds and removes: the lowest
free indices with the pool's ports + index, the newest removed first; sizes refused with
what to give."""

from __future__ import annotations

from pathlib import Path

import pytest

from vllm_cluster.cluster.config_file import load_deployment
from vllm_cluster.cluster.scale_plan import PoolSizes, plan_change
from vllm_cluster.engine.errors import ConfigError

CONFIG = """\
engine:
  model:
    model: smollm2-135m-instruct
  device: cpu
cluster:
  num_prefill: 1
  num_decode: 1
  decode:
    port: 50200
    metrics_port: 9200
    num_cpus_per_rank: 0.25
"""


@pytest.fixture
def deployment(tmp_path: Path):  # type: ignore[no-untyped-def]
    path = tmp_path / "cluster.yaml"
    path.write_text(CONFIG)
    return load_deployment(str(path), [])


def test_growing_takes_the_lowest_free_indices_and_their_ports(deployment) -> None:  # type: ignore[no-untyped-def]
    change = plan_change(deployment, ["prefill-0", "decode-0", "decode-2"], PoolSizes(1, 4), use_gpus=False)
    assert change.remove == ()
    assert [(p.name, p.port, p.metrics_port, p.bundles) for p in change.add] == [
        ("decode-1", 50201, 9201, ({"CPU": 0.25},)),
        ("decode-3", 50203, 9203, ({"CPU": 0.25},)),
    ]
    change = plan_change(deployment, ["decode-0"], PoolSizes(2, 1), use_gpus=False)
    assert [(p.name, p.role, p.port) for p in change.add] == [("prefill-0", "prefill", 0), ("prefill-1", "prefill", 0)]


def test_shrinking_removes_the_newest_first(deployment) -> None:  # type: ignore[no-untyped-def]
    names = ["prefill-0", "prefill-1", "decode-0", "decode-3", "decode-1"]
    change = plan_change(deployment, names, PoolSizes(0, 1), use_gpus=False)
    assert change.add == () and change.remove == ("prefill-1", "prefill-0", "decode-3", "decode-1")
    assert plan_change(deployment, names, PoolSizes(2, 3), use_gpus=False).empty


def test_sizes_a_cluster_cannot_have_are_refused(deployment) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ConfigError, match="at least 1 decode"):
        plan_change(deployment, ["decode-0"], PoolSizes(1, 0), use_gpus=False)
    with pytest.raises(ConfigError, match="give 0 or more"):
        plan_change(deployment, ["decode-0"], PoolSizes(-1, 1), use_gpus=False)
