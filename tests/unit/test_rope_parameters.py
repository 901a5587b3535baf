"""RoPE settings read from HF configs and GGUF metadata (engine/models/rope_parameters.py,
engine/loader/gguf_file.py): transformers' precedence rules, the context a scaled rope
serves, and refusals that name what to change."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import gguf
import pytest

from vllm_cluster.engine.errors import ModelLoadError
from vllm_cluster.engine.loader.gguf_file import gguf_hf_config
from vllm_cluster.engine.models.rope_parameters import read_rope, rope_context_length


def test_plain_rope_from_either_spelling() -> None:
    assert read_rope({"rope_theta": 500000.0}) == (500000.0, None)
    assert read_rope({"rope_parameters": {"rope_type": "default", "rope_theta": 1e6}}) == (1e6, None)
    assert read_rope({}) == (10000.0, None)


def test_transformers_precedence() -> None:
    # rope_scaling over rope_parameters; a theta inside the dict over the top-level one.
    d = {
        "rope_theta": 1.0,
        "rope_scaling": {"type": "linear", "factor": 2.0, "rope_theta": 5000.0},
        "rope_parameters": {"rope_type": "dynamic", "factor": 8.0},
    }
    theta, scaling = read_rope(d)
    assert theta == 5000.0
    assert scaling is not None and scaling["rope_type"] == "linear" and "type" not in scaling
    # Phi-3: a top-level original_max_position_embeddings wins over the dict's.
    phi3 = {
        "max_position_embeddings": 131072, "original_max_position_embeddings": 4096,
        "rope_scaling": {"type": "longrope", "short_factor": [1.0], "long_factor": [2.0],
                         "original_max_position_embeddings": 131072},
    }
    _, scaling = read_rope(phi3)
    assert scaling is not None
    assert scaling["original_max_position_embeddings"] == 4096
    assert scaling["factor"] == 32.0  # inferred as transformers does: 131072 / 4096


def test_older_longrope_spellings() -> None:
    factors = {"short_factor": [1.0], "long_factor": [2.0], "original_max_position_embeddings": 8}
    for d in (
        {"rope_scaling": {"type": "su", **factors}},
        {"architectures": ["Phi3ForCausalLM"], "rope_scaling": {"type": "yarn", **factors}},
    ):
        _, scaling = read_rope(d)
        assert scaling is not None and scaling["rope_type"] == "longrope"


def test_original_context_of_each_type() -> None:
    def original(rope: dict[str, Any], max_position: int = 4096) -> int:
        _, scaling = read_rope({"max_position_embeddings": max_position, "rope_parameters": rope})
        assert scaling is not None
        return int(scaling["original_max_position_embeddings"])

    # dynamic: transformers grows the base past max_position_embeddings, whatever the dict says.
    assert original({"rope_type": "dynamic", "factor": 2.0, "original_max_position_embeddings": 99}) == 4096
    assert original({"rope_type": "yarn", "factor": 4.0}) == 4096  # defaults to max_position_embeddings
    assert original({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024}) == 1024


@pytest.mark.parametrize(
    ("rope", "max_position", "context"),
    [
        (None, 4096, 4096),
        ({"rope_type": "linear", "factor": 2.0}, 4096, 8192),
        ({"rope_type": "dynamic", "factor": 4.0}, 2048, 8192),
        ({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}, 32768, 131072),
        ({"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 1024}, 4096, 4096),
        ({"rope_type": "longrope", "short_factor": [1.0], "long_factor": [2.0],
          "original_max_position_embeddings": 4096}, 131072, 131072),
        ({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 8192}, 131072, 131072),
    ],
)
def test_context_length(rope: dict[str, Any] | None, max_position: int, context: int) -> None:
    _, scaling = read_rope({"max_position_embeddings": max_position, "rope_parameters": rope})
    assert rope_context_length(max_position, scaling) == context


@pytest.mark.parametrize(
    ("rope", "message"),
    [
        ({"rope_type": "mrope"}, "rope type 'mrope'"),
        ({"rope_type": "longrope", "short_factor": [1.0]}, r"needs \['long_factor'\]"),
        ({"rope_type": "llama3", "factor": 8.0}, r"needs \['low_freq_factor', 'high_freq_factor'\]"),
    ],
)
def test_refusals_name_the_problem(rope: dict[str, Any], message: str) -> None:
    with pytest.raises(ModelLoadError, match=message):
        read_rope({"rope_parameters": rope})


def _gguf(path: Path, fields: dict[str, Any]) -> Path:
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_uint32("llama.attention.head_count", 4)
    writer.add_uint32("llama.embedding_length", 64)
    writer.add_uint32("llama.context_length", 4096)
    for key, value in fields.items():
        if isinstance(value, str):
            writer.add_string(key, value)
        elif isinstance(value, float):
            writer.add_float32(key, value)
        else:
            writer.add_uint32(key, value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.mark.parametrize(
    ("fields", "expected"),
    [
        ({}, None),
        ({"llama.rope.scaling.type": "none"}, None),
        ({"llama.rope.scaling.type": "linear", "llama.rope.scaling.factor": 4.0},
         {"rope_type": "linear", "factor": 4.0}),
        ({"llama.rope.scale_linear": 2.0}, {"rope_type": "linear", "factor": 2.0}),
        ({"llama.rope.scaling.type": "yarn", "llama.rope.scaling.factor": 4.0,
          "llama.rope.scaling.original_context_length": 1024},
         {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024}),
    ],
)
def test_gguf_rope_scaling(tmp_path: Path, fields: dict[str, Any], expected: dict[str, Any] | None) -> None:
    assert gguf_hf_config(_gguf(tmp_path / "m.gguf", fields))["rope_scaling"] == expected
