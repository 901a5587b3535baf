"""`LLM(..., tensor_parallel_size=2, enable_expert_parallel=True)`, as in vLLM: a random HF
Mixtral shaped like the `mixtral-tiny` preset (8 experts, top-2, GQA) saved with
`save_pretrained` and loaded through our HF loader. Under expert parallelism each of the
two ranks (real processes, gloo on 127.0.0.1) holds 4 of every layer's 8 experts, while
attention and the vocabulary are tensor-parallel; greedy tokens equal one process and HF
transformers on the same weights, token for token. The prompts run batched under a small
token budget, so the longest is prefilled in chunks.

Expert parallelism on a model without experts, or with experts the ranks cannot share
evenly, is refused before any process starts.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from tests.correctness.mixtral_checkpoint import MAX_NEW_TOKENS, PROMPTS, hf_greedy, save_hf_mixtral
from vllm_cluster.engine import LLM, ConfigError, SamplingParams
from vllm_cluster.engine.loader.presets import PRESETS
from vllm_cluster.engine.parallel.expert import moe_blocks

pytestmark = pytest.mark.slow

MIXTRAL_TINY = {k: v for k, v in PRESETS["mixtral-tiny"].items() if k != "architectures"}
PARAMS = SamplingParams(temperature=0.0, max_tokens=MAX_NEW_TOKENS, ignore_eos=True)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[list[int]]]:
    """The checkpoint's path and HF's greedy tokens for PROMPTS."""
    path = tmp_path_factory.mktemp("mixtral_tiny")
    hf_model = save_hf_mixtral(path, **MIXTRAL_TINY)
    return path, [hf_greedy(hf_model, p) for p in PROMPTS]


@pytest.fixture(scope="module")
def single(checkpoint: tuple[Path, list[list[int]]]) -> LLM:
    path, _ = checkpoint
    return LLM(str(path), device="cpu", dtype="float32", num_threads=1, num_blocks=64, block_size=4,
               max_model_len=256, max_num_batched_tokens=16)


@pytest.fixture(scope="module")
def expert_parallel(single: LLM) -> Iterator[LLM]:
    llm = single.derive(tensor_parallel_size=2, enable_expert_parallel=True)  # rank 1 gets these weights
    yield llm
    llm.core.shutdown()
    torch.set_num_threads(2)


def _tokens(llm: LLM) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, PARAMS, use_tqdm=False)]


def test_expert_parallel_equals_one_process_and_hf(
    checkpoint: tuple[Path, list[list[int]]], single: LLM, expert_parallel: LLM
) -> None:
    _, hf_tokens = checkpoint
    assert len({t for tokens in hf_tokens for t in tokens}) > 8  # the random model's tokens vary
    assert _tokens(single) == hf_tokens
    assert _tokens(expert_parallel) == hf_tokens
    assert not expert_parallel.core.has_unfinished()
    assert expert_parallel.core.kv.pool.num_free_blocks == expert_parallel.core.kv.pool.num_blocks


def test_rank_zero_holds_half_the_experts_and_heads(expert_parallel: LLM) -> None:
    model = expert_parallel.core.model
    blocks = moe_blocks(model)
    assert len(blocks) == 2
    assert [(b.expert_start, b.num_local_experts, b.intermediate_size) for b in blocks] == [(0, 4, 256)] * 2
    assert tuple(blocks[0].stack.w13_weight.shape) == (4, 2 * 256, 128)  # whole experts, not slices of each
    attn = model.model.layers[0].self_attn
    assert (attn.num_heads, attn.num_kv_heads) == (2, 1)


def test_expert_parallel_on_a_dense_model_is_refused() -> None:
    with pytest.raises(ConfigError, match="enable_expert_parallel needs a MoE model"):
        LLM("llama-3.2-1b", load_format="dummy", device="cpu", tensor_parallel_size=2, enable_expert_parallel=True)


def test_experts_the_ranks_cannot_share_evenly_are_refused() -> None:
    message = r"the model's 6 experts over tensor_parallel_size 4 ranks, which must divide them: .*\[1, 2, 3, 6\]"
    with pytest.raises(ConfigError, match=message):
        LLM("mixtral-tiny", load_format="dummy", hf_overrides={"num_local_experts": 6}, device="cpu",
            tensor_parallel_size=4, enable_expert_parallel=True)


def test_qwen2_moe_expert_parallel_equals_hf(tmp_path: Path) -> None:
    """Qwen2-MoE reuses Mixtral's experts: the routed experts split over the ranks, while
    its shared expert and its dense layer (decoder_sparse_step 2) are tensor-parallel MLPs."""
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

    config = Qwen2MoeConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
        shared_expert_intermediate_size=48, decoder_sparse_step=2, max_position_embeddings=512,
        bos_token_id=1, eos_token_id=2, tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    hf_model = Qwen2MoeForCausalLM(config).eval()
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, param in hf_model.named_parameters():
            noise = torch.randn(param.shape, generator=generator)
            param.copy_(1.0 + 0.1 * noise if name.endswith("norm.weight") else 0.2 * noise)
    hf_model.save_pretrained(str(tmp_path), safe_serialization=True)
    hf_tokens = [hf_greedy(hf_model, p) for p in PROMPTS]
    llm = LLM(str(tmp_path), device="cpu", dtype="float32", num_threads=1, num_blocks=64, block_size=4,
              max_model_len=256, max_num_batched_tokens=16, tensor_parallel_size=2, enable_expert_parallel=True)
    try:
        blocks = moe_blocks(llm.core.model)
        assert [(b.expert_start, b.num_local_experts) for b in blocks] == [(0, 2)]  # layer 1 only
        layers = llm.core.model.model.layers
        assert (layers[0].mlp.intermediate_size, layers[1].mlp.shared_expert.intermediate_size) == (64, 24)
        assert _tokens(llm) == hf_tokens
    finally:
        llm.core.shutdown()
        torch.set_num_threads(2)
