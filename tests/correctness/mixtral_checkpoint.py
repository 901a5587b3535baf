"""A tiny random HF Mixtral checkpoint, HF's greedy reference on it, and a direct forward of
our model over a batch of prompts (every position's logits, which the engine never returns).
Shared by test_mixtral_vs_hf.py and test_expert_parallel.py."""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

import torch

from vllm_cluster.engine.layers.attention import Attention
from vllm_cluster.engine.models import CausalLM
from vllm_cluster.kernels.attention.metadata import AttentionMetadata, make_plan

MAX_NEW_TOKENS = 8
PROMPTS = [
    [7],
    [3, 141, 59, 26, 5],
    [200, 17, 88, 4, 250, 31, 9, 160, 72, 11, 2],
    [(37 * i + 11) % 256 for i in range(29)],
]


def build_hf_mixtral(**overrides: Any) -> Any:
    """4 experts, top-2, GQA (4 heads, 2 KV heads), seeded; `overrides`: other config.json
    values (e.g. a preset's from engine/loader/presets.py)."""
    from transformers import MixtralConfig, MixtralForCausalLM

    values: dict[str, Any] = dict(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
        max_position_embeddings=512, rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2,
        tie_word_embeddings=False,
    )
    config = MixtralConfig(**(values | overrides))
    torch.manual_seed(0)
    model = MixtralForCausalLM(config).eval()  # fp32
    # The default init (std 0.02) gives nearly uniform logits and router scores, where
    # argmax and top-k ties would hide bugs.
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=generator)
            param.copy_(1.0 + 0.1 * noise if name.endswith("norm.weight") else 0.2 * noise)
    return model


def save_hf_mixtral(path: Path, **overrides: Any) -> Any:
    model = build_hf_mixtral(**overrides)
    model.save_pretrained(str(path), safe_serialization=True)
    return model


def hf_greedy(model: Any, prompt: list[int], max_new_tokens: int = MAX_NEW_TOKENS) -> list[int]:
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens,
            do_sample=False, pad_token_id=0,
        )
    return [int(t) for t in out[0, len(prompt):]]


def hf_logits(model: Any, prompt: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([prompt])).logits[0].float()  # [S, V]


def prefill_logits(
    model: CausalLM, prompts: list[list[int]], block_size: int = 4, kv_cache_dtype: torch.dtype | None = None
) -> list[torch.Tensor]:
    """Every prompt in one varlen prefill batch through our model; each prompt's logits [S, V]
    (under tensor parallelism: on the group's first rank; [S, V / tp] elsewhere). On CPU.
    `kv_cache_dtype`: the cache's (fp8: kernels/fp8_kv.py); None, the model's. MLA models
    (DeepSeek) get their latent cache."""
    c = model.config
    device = model.model.embed_tokens.weight.device
    attention = model.model.layers[0].self_attn
    # this rank's share under tensor parallelism; MLA caches one latent per token
    num_kv_heads = attention.num_kv_heads if isinstance(attention, Attention) else None
    lens = [len(p) for p in prompts]
    num_blocks = [-(-n // block_size) for n in lens]
    firsts = [0, *itertools.accumulate(num_blocks)]
    width = max(num_blocks)
    block_tables = torch.tensor(
        [list(range(f, f + n)) + [0] * (width - n) for f, n in zip(firsts[:-1], num_blocks, strict=True)],
        dtype=torch.int32,
    )
    positions = torch.cat([torch.arange(n) for n in lens])
    seq_index = torch.repeat_interleave(torch.arange(len(prompts)), torch.tensor(lens))
    slot_mapping = block_tables[seq_index, positions // block_size].long() * block_size + positions % block_size
    query_start_loc = [0, *itertools.accumulate(lens)]
    meta = AttentionMetadata(
        slot_mapping=slot_mapping.to(device),
        block_tables=block_tables.to(device),
        seq_lens=torch.tensor(lens, dtype=torch.int32, device=device),
        query_start_loc=torch.tensor(query_start_loc, dtype=torch.int32, device=device),
        max_query_len=max(lens),
        max_seq_len=max(lens),
        cpu_plan=make_plan(query_start_loc, lens) if device.type == "cpu" else None,
    )
    shape = c.kv_cache_shape(firsts[-1], block_size, num_kv_heads)
    dtype = kv_cache_dtype or model.model.embed_tokens.weight.dtype
    kv_caches = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(c.num_hidden_layers)]
    input_ids = torch.tensor([t for p in prompts for t in p], device=device)
    with torch.inference_mode():
        hidden = model(input_ids, positions.to(device), kv_caches, meta)  # [T, D]
        return list(model.compute_logits(hidden).float().cpu().split(lens))
