"""EngineConfig: loading from YAML, rejecting unknown keys and bad values, flat options."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from vllm_cluster.engine.config import EngineConfig
from vllm_cluster.engine.errors import ConfigError

LOCAL_YAML = Path(__file__).resolve().parents[2] / "configs" / "local.yaml"


def _yaml(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "engine.yaml"
    path.write_text(text)
    return path


def test_local_yaml_loads() -> None:
    config = EngineConfig.from_yaml(LOCAL_YAML)
    assert config.model.model == "smollm2-135m-instruct"
    assert config.model.dtype == "float32"
    assert config.cache.block_size == 16
    assert config.cache.num_blocks == 1024
    assert config.cache.enable_prefix_caching is True
    assert config.scheduler.max_num_seqs == 32
    assert config.scheduler.max_num_batched_tokens == 512
    assert config.scheduler.max_model_len == 8192
    assert config.device == "cpu"
    assert config.num_threads == 1
    assert config.role == "colocated"


def test_yaml_without_engine_section_is_read_at_the_top_level(tmp_path: Path) -> None:
    config = EngineConfig.from_yaml(_yaml(tmp_path, "cache:\n  block_size: 32\nrole: prefill\n"))
    assert config.cache.block_size == 32
    assert config.role == "prefill"


@pytest.mark.parametrize("text", ["", "engine:\n", "cache:\n"])
def test_empty_sections_take_the_defaults(tmp_path: Path, text: str) -> None:
    assert EngineConfig.from_yaml(_yaml(tmp_path, text)) == EngineConfig()


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("engine: [1, 2]\n", "engine must be a mapping"),
        ("- 1\n- 2\n", "must hold a mapping"),
        ("engine: {cache: 16}\n", "cache: must be a mapping"),
        ("engine: {cache: [\n", "not valid YAML"),
    ],
)
def test_malformed_yaml_raises_config_error(tmp_path: Path, text: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        EngineConfig.from_yaml(_yaml(tmp_path, text))


def test_missing_file_raises_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        EngineConfig.from_yaml(tmp_path / "nope.yaml")


def test_unknown_top_level_key_is_named(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="unknown key 'max_batch'"):
        EngineConfig.from_yaml(_yaml(tmp_path, "engine:\n  max_batch: 8\n"))


def test_unknown_section_key_is_named(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"unknown key cache\.blocksize"):
        EngineConfig.from_yaml(_yaml(tmp_path, "engine:\n  cache:\n    blocksize: 16\n"))


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({"cache": {"block_size": 3}}, r"cache\.block_size: 3"),
        ({"cache": {"num_blocks": 0}}, r"cache\.num_blocks: 0"),
        ({"cache": {"memory_fraction": 1.5}}, r"cache\.memory_fraction: 1\.5"),
        ({"cache": {"memory_fraction": 0.0}}, r"cache\.memory_fraction: 0\.0"),
        ({"cache": {"gpu_memory_utilization": 1.2}}, r"cache\.gpu_memory_utilization: 1\.2 must be in \(0, 1\]"),
        (
            {"cache": {"gpu_memory_utilization": 0.5, "memory_fraction": 0.5}},
            "gpu_memory_utilization and cache.memory_fraction are both set: keep one",
        ),
        ({"scheduler": {"max_num_seqs": 0}}, r"scheduler\.max_num_seqs: 0"),
        ({"scheduler": {"max_num_batched_tokens": 0}}, r"scheduler\.max_num_batched_tokens: 0"),
        ({"scheduler": {"max_model_len": 0}}, r"scheduler\.max_model_len: 0"),
        ({"model": {"dtype": "fp64"}}, r"model\.dtype: 'fp64'"),
        ({"model": {"load_format": "onnx"}}, r"model\.load_format: 'onnx'"),
        ({"model": {"model": ""}}, "model: must name a model"),
        ({"role": "x"}, "role: 'x'"),
        ({"device": "tpu"}, "device: 'tpu'"),
        ({"num_threads": 0}, "num_threads: 0"),
        (
            {"cache": {"kv_cache_dtype": "int8"}},
            r"cache\.kv_cache_dtype: 'int8' is not one of \('auto', 'fp8', 'fp8_e4m3'\)",
        ),
        ({"cache": {"kv_cache_dtype": "fp8_e5m2"}}, r"cache\.kv_cache_dtype: 'fp8_e5m2' is not one of"),
        ({"cache": {"kv_cache_dtype": 8}}, r"cache\.kv_cache_dtype: 8 has type int; expected str"),
    ],
)
def test_bad_values_raise_config_error(data: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        EngineConfig.from_dict(data)


def test_valid_edge_values_pass() -> None:
    config = EngineConfig.from_dict(
        {"cache": {"block_size": 1, "memory_fraction": 0.95}, "device": "cuda:1", "role": "decode"}
    )
    assert (config.cache.block_size, config.cache.memory_fraction) == (1, 0.95)
    assert (config.device, config.role) == ("cuda:1", "decode")


def test_from_kwargs_routes_flat_options_to_their_sections() -> None:
    config = EngineConfig.from_kwargs(
        "llama-tiny",
        load_format="dummy",
        dtype="bfloat16",
        block_size=32,
        num_blocks=100,
        max_num_seqs=4,
        max_model_len=256,
        device="cpu",
        role="prefill",
        num_threads=1,
    )
    assert (config.model.model, config.model.load_format, config.model.dtype) == (
        "llama-tiny", "dummy", "bfloat16"
    )
    assert (config.cache.block_size, config.cache.num_blocks) == (32, 100)
    assert (config.scheduler.max_num_seqs, config.scheduler.max_model_len) == (4, 256)
    assert (config.device, config.role, config.num_threads) == ("cpu", "prefill", 1)
    assert config.scheduler.max_num_batched_tokens is None  # left to the device's default


def test_from_kwargs_rejects_unknown_and_bad_options() -> None:
    with pytest.raises(ConfigError, match="unknown key 'max_batch'"):
        EngineConfig.from_kwargs("m", max_batch=8)
    with pytest.raises(ConfigError, match=r"cache\.block_size: 3"):
        EngineConfig.from_kwargs("m", block_size=3)


def test_with_overrides_changes_only_the_named_options() -> None:
    base = EngineConfig.from_yaml(LOCAL_YAML)
    derived = base.with_overrides(num_blocks=64, max_num_batched_tokens=32, role="decode")
    assert (derived.cache.num_blocks, derived.scheduler.max_num_batched_tokens) == (64, 32)
    assert derived.role == "decode"
    assert derived.cache.block_size == 16
    assert derived.scheduler.max_num_seqs == 32
    assert derived.model == base.model
    assert derived.device == "cpu"
    # The original is untouched.
    assert (base.cache.num_blocks, base.scheduler.max_num_batched_tokens) == (1024, 512)
    assert base.role == "colocated"


def test_with_overrides_validates() -> None:
    with pytest.raises(ConfigError, match=r"scheduler\.max_num_seqs: 0"):
        EngineConfig().with_overrides(max_num_seqs=0)


@pytest.mark.parametrize("name", ["auto", "fp8", "fp8_e4m3"])
def test_kv_cache_dtype_values_and_what_they_resolve_to(name: str) -> None:
    import torch

    from vllm_cluster.engine.resolve import resolve_kv_cache_dtype

    config = EngineConfig.from_kwargs("smollm2-135m-instruct", kv_cache_dtype=name)  # LLM(..., kv_cache_dtype=)
    assert config.cache.kv_cache_dtype == name
    expected = torch.bfloat16 if name == "auto" else torch.float8_e4m3fn
    assert resolve_kv_cache_dtype(name, torch.bfloat16) == expected
    assert EngineConfig().cache.kv_cache_dtype == "auto"
