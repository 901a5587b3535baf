"""GGUF checkpoints (llama.cpp's format): metadata to an HF-style config, tensors
dequantized with the `gguf` package and renamed to HF names."""

from __future__ import annotations

import functools
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from vllm_cluster.engine.errors import ModelLoadError

_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}

_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_RE = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")


def _reader(path: Path) -> Any:
    """The file's GGUFReader, parsed once per process while the file is unchanged: the config
    (`gguf_hf_config`) and the weights (`gguf_weights`) read the same one, and every engine
    of a process (tests, several LLMs) too. A parse reads every metadata field; the bundled
    model's 49k-token vocabulary and merges make that seconds."""
    stat = path.stat()
    return _parsed(str(path), stat.st_mtime_ns, stat.st_size)


@functools.lru_cache(maxsize=2)
def _parsed(path: str, mtime_ns: int, size: int) -> Any:
    import gguf

    try:
        return gguf.GGUFReader(path)
    except Exception as e:  # gguf raises bare ValueError/struct errors on damaged files
        raise ModelLoadError(f"{path} is not a readable GGUF file ({e}); re-download or re-install it") from e


def _field(reader: Any, key: str, default: Any = None) -> Any:
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def gguf_hf_config(path: Path) -> dict[str, Any]:
    reader = _reader(path)
    arch = _field(reader, "general.architecture")
    if arch not in _ARCHITECTURES:
        raise ModelLoadError(
            f"{path}: GGUF architecture {arch!r} is not supported; supported: {sorted(_ARCHITECTURES)}"
        )
    names = {t.name for t in reader.tensors}
    num_heads = _field(reader, f"{arch}.attention.head_count")
    hidden = _field(reader, f"{arch}.embedding_length")
    vocab = _field(reader, f"{arch}.vocab_size") or len(_field(reader, "tokenizer.ggml.tokens", []))
    return {
        "architectures": [_ARCHITECTURES[arch]],
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": _field(reader, f"{arch}.feed_forward_length"),
        "num_hidden_layers": _field(reader, f"{arch}.block_count"),
        "num_attention_heads": num_heads,
        "num_key_value_heads": _field(reader, f"{arch}.attention.head_count_kv", num_heads),
        "head_dim": _field(reader, f"{arch}.attention.key_length", hidden // num_heads),
        "rms_norm_eps": _field(reader, f"{arch}.attention.layer_norm_rms_epsilon", 1e-6),
        "rope_theta": _field(reader, f"{arch}.rope.freq_base", 10000.0),
        "rope_scaling": _rope_scaling(reader, arch, path, names),
        "max_position_embeddings": _field(reader, f"{arch}.context_length", 4096),
        "tie_word_embeddings": "output.weight" not in names,
        "attention_bias": "blk.0.attn_q.bias" in names,
        "bos_token_id": _field(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": _field(reader, "tokenizer.ggml.eos_token_id"),
    }


def _rope_scaling(reader: Any, arch: str, path: Path, names: set[str]) -> dict[str, Any] | None:
    """llama.cpp's rope scaling keys as HF rope parameters; ModelArchConfig refuses a type
    the engine does not run."""
    if "rope_freqs.weight" in names:
        raise ModelLoadError(
            f"{path}: per-dimension rope frequencies (rope_freqs, llama.cpp's form of llama3 scaling) "
            "are not supported; load the model's HF checkpoint instead"
        )
    kind = _field(reader, f"{arch}.rope.scaling.type")
    factor = _field(reader, f"{arch}.rope.scaling.factor")
    if kind is None:  # older files state only a linear scale
        kind, factor = "linear", _field(reader, f"{arch}.rope.scale_linear")
    if kind == "none" or factor in (None, 1.0):
        return None
    scaling: dict[str, Any] = {"rope_type": kind, "factor": float(factor)}
    original = _field(reader, f"{arch}.rope.scaling.original_context_length")
    if original:
        scaling["original_max_position_embeddings"] = int(original)
    return scaling


def _undo_llama_permute(w: np.ndarray, num_heads: int) -> np.ndarray:
    # llama.cpp's converter interleaves each head's rotary halves for q and k; undo it to
    # get back HF's rotate-half layout.
    return w.reshape(num_heads, w.shape[0] // num_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def gguf_weights(path: Path, config: dict[str, Any]) -> Iterator[tuple[str, torch.Tensor]]:
    from gguf import dequantize

    reader = _reader(path)
    is_llama = config["architectures"][0] == "LlamaForCausalLM"
    for tensor in reader.tensors:
        name = _hf_name(tensor.name)
        try:
            w = dequantize(tensor.data, tensor.tensor_type)
        except Exception as e:
            raise ModelLoadError(
                f"{path}: tensor {tensor.name} cannot be dequantized ({e}); the file may be truncated"
            ) from e
        if is_llama and name.endswith("q_proj.weight"):
            w = _undo_llama_permute(w, config["num_attention_heads"])
        elif is_llama and name.endswith("k_proj.weight"):
            w = _undo_llama_permute(w, config["num_key_value_heads"])
        yield name, torch.from_numpy(np.array(w, dtype=np.float32))


def _hf_name(name: str) -> str:
    if name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[name]
    m = _LAYER_RE.fullmatch(name)
    if m is None or m.group(2) not in _LAYER_NAMES:
        raise ModelLoadError(f"GGUF tensor {name} is not supported")
    layer, part, kind = m.groups()
    return f"model.layers.{layer}.{_LAYER_NAMES[part]}.{kind}"
