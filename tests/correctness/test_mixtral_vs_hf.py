"""A tiny random Mixtral (HF transformers, `save_pretrained`) loaded through our HF loader:
the per-expert checkpoint names (`block_sparse_moe.experts.{e}.w1/w2/w3`, `gate`) are
stacked into our expert tensors, and greedy tokens equal HF's `generate`, token for token,
with every position's logits close (fp32). Prompts run batched; the longest is chunked."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tests.correctness.mixtral_checkpoint import (
    MAX_NEW_TOKENS,
    PROMPTS,
    hf_greedy,
    hf_logits,
    prefill_logits,
    save_hf_mixtral,
)
from vllm_cluster.engine import LLM, SamplingParams
from vllm_cluster.engine.models.mixtral import SparseMoeBlock


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any]:
    path = tmp_path_factory.mktemp("tiny_mixtral")
    return path, save_hf_mixtral(path)


@pytest.fixture(scope="module")
def llm(checkpoint: tuple[Path, Any]) -> LLM:
    path, _ = checkpoint
    return LLM(
        str(path), device="cpu", dtype="float32", num_blocks=64, block_size=4, max_model_len=256,
        max_num_batched_tokens=16,
    )


def test_checkpoint_loads_as_moe(llm: LLM) -> None:
    config = llm.core.model.config
    assert (config.architecture, config.num_experts, config.num_experts_per_tok) == ("MixtralForCausalLM", 4, 2)
    blocks = [layer.mlp for layer in llm.core.model.model.layers]
    assert all(isinstance(b, SparseMoeBlock) and b.num_local_experts == 4 for b in blocks)


def test_greedy_tokens_match_hf_generate(checkpoint: tuple[Path, Any], llm: LLM) -> None:
    _, hf_model = checkpoint
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW_TOKENS, ignore_eos=True)
    outputs = llm.generate(PROMPTS, params, use_tqdm=False)
    for prompt, output in zip(PROMPTS, outputs, strict=True):
        assert output.outputs[0].token_ids == hf_greedy(hf_model, prompt), f"prompt of {len(prompt)} tokens"


def test_logits_close_to_hf_at_every_position(checkpoint: tuple[Path, Any], llm: LLM) -> None:
    _, hf_model = checkpoint
    ours = prefill_logits(llm.core.model, PROMPTS)
    for prompt, logits in zip(PROMPTS, ours, strict=True):
        # fp32 with a different summation order (experts grouped, k summed per token):
        # differences are rounding-sized (about 6e-6 seen, logits up to about 6.5); dropping
        # the top-k renormalisation moves them by about 1.8.
        torch.testing.assert_close(logits, hf_logits(hf_model, prompt), atol=1e-4, rtol=1e-4)


def test_hf_reference_is_not_degenerate(checkpoint: tuple[Path, Any]) -> None:
    # Guards the comparisons above: one repeated token, or a router that sends every
    # token to the same experts, would let a broken MoE pass.
    _, hf_model = checkpoint
    generated = [tuple(hf_greedy(hf_model, p)) for p in PROMPTS]
    assert len(set(generated)) == len(PROMPTS)
    assert all(len(set(tokens)) > 1 for tokens in generated)
    hidden = hf_model.model.embed_tokens(torch.tensor(PROMPTS[-1]))
    with torch.no_grad():
        chosen = hf_model.model.layers[0].mlp.gate(hidden)[2]  # [S, top_k] expert ids
    assert len(set(chosen.flatten().tolist())) == 4


def test_dummy_preset_runs_through_the_engine() -> None:
    llm = LLM("mixtral-tiny", load_format="dummy", device="cpu", dtype="float32", num_blocks=32, block_size=4,
              max_model_len=64)
    blocks = [layer.mlp for layer in llm.core.model.model.layers]
    assert all(isinstance(b, SparseMoeBlock) and (b.num_experts, b.top_k) == (8, 2) for b in blocks)
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    batched = llm.generate(PROMPTS[:3], params, use_tqdm=False)
    # The same prompt alone must get the same tokens as inside the batch (routing is per token).
    alone = llm.generate(PROMPTS[1:2], params, use_tqdm=False)
    assert batched[1].outputs[0].token_ids == alone[0].outputs[0].token_ids
    assert all(len(o.outputs[0].token_ids) == 4 for o in batched)
