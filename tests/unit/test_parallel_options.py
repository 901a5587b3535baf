"""The parallel options vLLM users know, checked before anything starts:
`enable_expert_parallel` (a MoE model whose experts the ranks share evenly) and
`distributed_executor_backend` ("mp" or "ray"), in the engine config and in a cluster YAML."""

from __future__ import annotations

from pathlib import Path

import pytest

from vllm_cluster.cluster.config_file import load_deployment
from vllm_cluster.cluster.layout import Resources, check_engine_roles, check_layout
from vllm_cluster.engine.config import EngineConfig, ParallelConfig
from vllm_cluster.engine.errors import ConfigError
from vllm_cluster.engine.loader.presets import PRESETS
from vllm_cluster.engine.models import ModelArchConfig
from vllm_cluster.engine.parallel import ProcessLauncher, check_model
from vllm_cluster.engine.parallel.launch import make_launcher

MIXTRAL = ModelArchConfig.from_hf_dict(PRESETS["mixtral-tiny"])  # 8 experts, 4 heads, 2 KV heads
LLAMA = ModelArchConfig.from_hf_dict(PRESETS["llama-3.2-1b"])
SMALL = """\
engine:
  model:
    model: llama-3.2-1b
    load_format: dummy
  device: cpu
  parallel:
    {option}
cluster:
  num_prefill: 1
  num_decode: 1
router:
  port: 0
  http_port: 0
"""


def test_expert_parallel_needs_experts_the_ranks_share_evenly() -> None:
    check_model(MIXTRAL, 2, 1, enable_expert_parallel=True)
    check_model(MIXTRAL, 4, 2, enable_expert_parallel=True)
    with pytest.raises(ConfigError, match=r"needs a MoE model \(e\.g\. Mixtral\); LlamaForCausalLM has no experts"):
        check_model(LLAMA, 2, 1, enable_expert_parallel=True)
    check_model(LLAMA, 2, 1)  # off: nothing to check
    six = ModelArchConfig.from_hf_dict(PRESETS["mixtral-tiny"] | {"num_local_experts": 6})
    with pytest.raises(ConfigError, match=r"6 experts over tensor_parallel_size 4 ranks.*\[1, 2, 3, 6\]"):
        check_model(six, 4, 1, enable_expert_parallel=True)


def test_executor_backend_is_mp_or_ray() -> None:
    config = EngineConfig.from_kwargs("smollm2-135m-instruct", tensor_parallel_size=3, enable_expert_parallel=True,
                                      distributed_executor_backend="ray", ray_address="auto")
    assert config.parallel == ParallelConfig(3, 1, 300.0, True, "ray", "auto")
    with pytest.raises(ConfigError, match=r"distributed_executor_backend: 'slurm' is not one of \('mp', 'ray'\)"):
        EngineConfig.from_kwargs("smollm2-135m-instruct", distributed_executor_backend="slurm")
    assert isinstance(make_launcher(ParallelConfig()), ProcessLauncher)


def test_cluster_yaml_refuses_expert_parallel_on_a_dense_model_at_its_line(tmp_path: Path) -> None:
    path = tmp_path / "cluster.yaml"
    path.write_text(SMALL.format(option="enable_expert_parallel: true"))
    with pytest.raises(ConfigError, match=r"cluster\.yaml:7: engine\.parallel\.enable_expert_parallel: .*needs a MoE"):
        check_layout(load_deployment(path), Resources(8.0, (0,)))


def test_cluster_yaml_refuses_the_ray_executor_backend(tmp_path: Path) -> None:
    path = tmp_path / "cluster.yaml"
    path.write_text(SMALL.format(option="distributed_executor_backend: ray"))
    with pytest.raises(ConfigError, match=r"cluster\.yaml:7: engine\.parallel\.distributed_executor_backend: 'ray' is"):
        check_engine_roles(load_deployment(path))
