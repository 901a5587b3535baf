"""Our GGUF loader (dequantize, rename, undo llama.cpp's q/k permutation, fuse) gives the
bundled SmolLM2 exactly the weights HF transformers' own GGUF loading gives it."""

from __future__ import annotations

from typing import Any

import torch

from vllm_cluster.engine import LLM


def _our_view(ours: dict[str, torch.Tensor], hf_name: str, llm: LLM) -> torch.Tensor:
    """The slice of our (fused) parameter that holds HF's parameter `hf_name`."""
    c = llm.core.model.config
    q, kv, inter = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim, c.intermediate_size
    fused = {
        ".q_proj.": (".qkv_proj.", 0, q),
        ".k_proj.": (".qkv_proj.", q, kv),
        ".v_proj.": (".qkv_proj.", q + kv, kv),
        ".gate_proj.": (".gate_up_proj.", 0, inter),
        ".up_proj.": (".gate_up_proj.", inter, inter),
    }
    for part, (fused_part, offset, size) in fused.items():
        if part in hf_name:
            return ours[hf_name.replace(part, fused_part)].narrow(0, offset, size)
    return ours[hf_name]


def test_config_matches_hf(smollm2: LLM, hf_smollm2: Any) -> None:
    ours, hf = smollm2.core.model.config, hf_smollm2.config
    assert ours.architecture == "LlamaForCausalLM"
    assert (ours.vocab_size, ours.hidden_size, ours.intermediate_size) == (
        hf.vocab_size, hf.hidden_size, hf.intermediate_size,
    )
    assert (ours.num_hidden_layers, ours.num_attention_heads, ours.num_key_value_heads, ours.head_dim) == (
        hf.num_hidden_layers, hf.num_attention_heads, hf.num_key_value_heads, hf.head_dim,
    )
    assert ours.rms_norm_eps == hf.rms_norm_eps
    assert ours.rope_theta == hf.rope_parameters["rope_theta"]
    assert ours.tie_word_embeddings == hf.tie_word_embeddings


def test_every_weight_equals_hf(smollm2: LLM, hf_smollm2: Any) -> None:
    ours = dict(smollm2.core.model.state_dict())
    hf = {name: t for name, t in hf_smollm2.state_dict().items() if "rotary_emb" not in name}
    assert len(hf) == 3 + 9 * hf_smollm2.config.num_hidden_layers  # embed, norm, lm_head + 9 per layer

    mismatched = []
    covered = 0
    for name, expected in hf.items():
        actual = _our_view(ours, name, smollm2)
        covered += actual.numel()
        if actual.shape != expected.shape or not torch.equal(actual, expected.to(actual.dtype)):
            mismatched.append(name)
    assert mismatched == []
    # Every element of ours came from somewhere: the slices tile our parameters exactly
    # (lm_head shares the embedding, so it is counted once on each side).
    assert covered == sum(t.numel() for t in ours.values())
