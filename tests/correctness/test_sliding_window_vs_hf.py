"""A tiny random Mistral checkpoint with a sliding window of 8 tokens generates HF
transformers' greedy tokens (and logprobs) far past its window: prompts shorter and longer
than the window in one batch, one longer than the step's token budget (a chunked prefill
whose second chunk sees only the window), and 32 new tokens each.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tests.correctness.handoff import run_disaggregated
from tests.correctness.hf_reference import hf_greedy, randomise
from tests.correctness.test_dummy_models_vs_hf import _TINY
from vllm_cluster.engine import LLM, SamplingParams
from vllm_cluster.engine.request import RequestId

WINDOW = 8
BLOCK_SIZE = 4
MAX_NEW_TOKENS = 32
MAX_NUM_BATCHED_TOKENS = 16
PROMPTS = [
    [3, 141, 59, 26, 5],
    [200, 17, 88, 4, 250, 31, 9, 160, 72, 11, 2],
    [(37 * i + 11) % 256 for i in range(29)],  # > MAX_NUM_BATCHED_TOKENS: chunked prefill
]


def _mistral(sliding_window: int | None) -> Any:
    from transformers import MistralConfig

    tiny: dict[str, Any] = dict(_TINY)
    return MistralConfig(**tiny, head_dim=16, sliding_window=sliding_window, tie_word_embeddings=False)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any]:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(_mistral(WINDOW), dtype=torch.float32).eval()
    randomise(model)
    path = tmp_path_factory.mktemp("mistral_window")
    model.save_pretrained(str(path), safe_serialization=True)
    return path, model


def make_llm(path: Path, **overrides: Any) -> LLM:
    return LLM(
        str(path), device="cpu", dtype="float32", num_blocks=96, block_size=BLOCK_SIZE, max_model_len=128,
        max_num_batched_tokens=MAX_NUM_BATCHED_TOKENS, **overrides,
    )  # fmt: skip


def test_greedy_tokens_and_logprobs_match_hf_past_the_window(checkpoint: tuple[Path, Any]) -> None:
    path, hf_model = checkpoint
    llm = make_llm(path)
    assert llm.core.model.config.sliding_window == WINDOW
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW_TOKENS, ignore_eos=True, logprobs=1)
    outputs = llm.generate(PROMPTS, params, use_tqdm=False)
    for prompt, output in zip(PROMPTS, outputs, strict=True):
        hf_tokens, hf_logprobs = hf_greedy(hf_model, prompt, MAX_NEW_TOKENS)
        completion = output.outputs[0]
        assert completion.token_ids == hf_tokens, f"prompt of {len(prompt)} tokens"
        assert completion.logprobs is not None
        ours = [step[token].logprob for step, token in zip(completion.logprobs, completion.token_ids, strict=True)]
        torch.testing.assert_close(torch.tensor(ours), torch.tensor(hf_logprobs), atol=2e-3, rtol=0)


def test_the_window_changes_hf_outputs(checkpoint: tuple[Path, Any]) -> None:
    """Guards the comparison above: the same weights attending over everything score the
    long prompt differently, so an engine that ignored the window would fail it."""
    from transformers import AutoModelForCausalLM

    _, hf_model = checkpoint
    full = AutoModelForCausalLM.from_config(_mistral(None), dtype=torch.float32).eval()
    full.load_state_dict(hf_model.state_dict())
    ids = torch.tensor([PROMPTS[-1]])
    with torch.no_grad():
        assert (hf_model(ids).logits - full(ids).logits).abs().max() > 1e-2
    assert hf_greedy(hf_model, PROMPTS[-1], MAX_NEW_TOKENS)[0] != hf_greedy(full, PROMPTS[-1], MAX_NEW_TOKENS)[0]


def _run_holding(llm: LLM, request_id: str, prompt: list[int]) -> tuple[list[int], list[int]]:
    """Step one greedy request to its end alone: (its tokens, the KV blocks it held after
    each step's allocation, while it ran)."""
    core = llm.core
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW_TOKENS, ignore_eos=True)
    core.add_request(core.make_request(request_id, prompt, params))
    held: list[int] = []
    tokens: list[int] = []
    while core.has_unfinished():
        for update in core.step():
            tokens += update.new_token_ids
        if core.has_unfinished():
            held.append(core.kv.num_held_blocks(RequestId(request_id)))
            assert core.stats().num_free_blocks == 96 - held[-1]
    assert core.stats().num_free_blocks == 96
    return tokens, held


def test_blocks_behind_the_window_are_released(checkpoint: tuple[Path, Any]) -> None:
    """29 prompt tokens in chunks of 16, then decoding: blocks of 4 wholly before the next
    token's window of 8 go back to the pool, so the request holds at most 3 blocks while it
    decodes, where a global model holds one per 4 tokens (16 by the end); a repeat of the
    prompt takes from the prefix cache only the blocks inside its window."""
    path, hf_model = checkpoint
    llm = make_llm(path)
    assert llm.core.kv.sliding_window == WINDOW
    prompt = PROMPTS[-1]
    hf_tokens = hf_greedy(hf_model, prompt, MAX_NEW_TOKENS)[0]
    tokens, held = _run_holding(llm, "first", prompt)
    assert tokens == hf_tokens
    # Chunk 1: positions 0-15 (4 blocks); chunk 2: 16-28 reads from 9 on (blocks 2-7);
    # decoding at 29: reads from 22 on (blocks 5-7), at 31 from 24 on (blocks 6-7), ...
    assert held[:6] == [4, 6, 3, 3, 2, 3]
    assert max(held[2:]) == 3 and len(held) == MAX_NEW_TOKENS

    # The repeat hits 7 cached blocks (28 tokens) but takes only blocks 5 and 6 (its first
    # step computes position 28, which reads from 21 on), then as the first run from 29 on.
    tokens, held = _run_holding(llm, "repeat", prompt)
    assert tokens == hf_tokens
    assert llm.core.kv.prefix_stats.num_hits == 28
    assert held[:4] == [3, 3, 3, 2]


def test_disaggregated_roles_hold_every_block_and_match_hf(checkpoint: tuple[Path, Any]) -> None:
    """Prefill pushes the prompt's blocks whole and decode reserves them whole, so neither
    role releases blocks; the hand-off past the window still gives HF's tokens."""
    path, hf_model = checkpoint
    llm = make_llm(path)
    prefill = llm.derive(role="prefill").core
    decode = llm.derive(role="decode").core
    assert prefill.kv.sliding_window is None and decode.kv.sliding_window is None
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW_TOKENS, ignore_eos=True)
    got, _ = run_disaggregated(prefill, decode, PROMPTS[1:], params)
    assert got == [hf_greedy(hf_model, p, MAX_NEW_TOKENS)[0] for p in PROMPTS[1:]]
    for core in (prefill, decode):
        assert core.kv.pool.num_free_blocks == core.kv.pool.num_blocks
