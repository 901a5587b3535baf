"""Tensor and pipeline parallelism over real processes (gloo on 127.0.0.1) give the same
greedy tokens as one process, through the LLM API.

- SmolLM2-135M (9 query heads, 3 KV heads, 30 layers, tied embeddings): tp=3 (one KV head
  per rank) and pp=2 (15 layers per stage), both derived from the session's model, so
  the weights are loaded once and broadcast to the new ranks.
- A tiny random Llama with 4 query heads and 1 KV head at tp=2 x pp=2: the KV head is
  replicated on both tensor ranks of each stage.
The prompts run as one batch under a small token budget: one is prefilled in chunks,
and one shares its first blocks with it (a prefix-cache hit). A bad parallel config is
refused before any process starts; a worker that dies fails the next step clearly.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator

import pytest
import torch

from vllm_cluster.engine import LLM, ConfigError, SamplingParams
from vllm_cluster.engine.errors import WorkerDiedError
from vllm_cluster.engine.outputs import RequestOutput
from vllm_cluster.engine.parallel.launch import ProcessLauncher

pytestmark = pytest.mark.slow

BUDGET = 32  # max_num_batched_tokens: the long prompt below takes several steps
LONG = (
    "The history of the printing press begins in the fifteenth century, when Johannes "
    "Gutenberg combined movable metal type, oil-based ink and a wooden screw press. "
    "Within a few decades printing shops had spread across Europe, books became cheaper, "
    "and ideas travelled faster than ever before. Scholars, merchants and reformers "
    "all used the new technology to reach readers far beyond their own towns, and"
)
PROMPTS = [
    LONG,
    "The capital of France is",
    "def fibonacci(n):",
    LONG[:200] + " Meanwhile, in the kitchen,",  # shares LONG's first blocks
]
PARAMS = SamplingParams(temperature=0.0, max_tokens=8)

TINY = dict(
    vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
    num_attention_heads=4, num_key_value_heads=1, head_dim=16, max_position_embeddings=512,
    tie_word_embeddings=False,
)
TINY_PROMPTS = [[7], [3, 141, 59, 26, 5], [(37 * i + 11) % 500 for i in range(40)],
                [(37 * i + 11) % 500 for i in range(24)] + [9, 9]]
TINY_PARAMS = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


def _tokens(outputs: list[RequestOutput]) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


def _assert_no_leaks(llm: LLM) -> None:
    assert not llm.core.has_unfinished()
    assert llm.core.kv.pool.num_free_blocks == llm.core.kv.pool.num_blocks


@pytest.fixture(scope="module")
def single(smollm2: LLM) -> LLM:
    return smollm2.derive(max_num_batched_tokens=BUDGET)


@pytest.fixture(scope="module")
def reference(single: LLM) -> list[RequestOutput]:
    outputs = single.generate(PROMPTS, PARAMS, use_tqdm=False)
    assert len(outputs[0].prompt_token_ids) > 2 * BUDGET  # chunked
    assert outputs[3].num_cached_tokens >= 32  # LONG's first blocks, from the cache
    return outputs


@pytest.fixture(scope="module", params=[(3, 1), (1, 2)], ids=["tp3", "pp2"])
def parallel(request: pytest.FixtureRequest, smollm2: LLM) -> Iterator[LLM]:
    tp, pp = request.param
    llm = smollm2.derive(
        max_num_batched_tokens=BUDGET, tensor_parallel_size=tp, pipeline_parallel_size=pp, num_threads=1
    )
    yield llm
    llm.core.shutdown()
    torch.set_num_threads(2)


def test_greedy_tokens_equal_one_process(parallel: LLM, reference: list[RequestOutput]) -> None:
    outputs = parallel.generate(PROMPTS, PARAMS, use_tqdm=False)
    assert _tokens(outputs) == _tokens(reference)
    assert [o.outputs[0].text for o in outputs] == [o.outputs[0].text for o in reference]
    assert [o.num_cached_tokens for o in outputs] == [o.num_cached_tokens for o in reference]
    _assert_no_leaks(parallel)


def test_prompt_logprobs_equal_one_process(parallel: LLM, single: LLM) -> None:
    """The prompt rows' logits come back from the last stage, micro-batch by micro-batch."""
    params = SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=2)
    ours, want = (llm.generate(PROMPTS, params, use_tqdm=False) for llm in (parallel, single))
    for a, b in zip(ours, want, strict=True):
        assert a.prompt_logprobs is not None and b.prompt_logprobs is not None
        assert len(a.prompt_logprobs) == len(b.prompt_logprobs) == len(a.prompt_token_ids)
        for x, y, token_id in zip(a.prompt_logprobs[1:], b.prompt_logprobs[1:], a.prompt_token_ids[1:], strict=True):
            assert x is not None and y is not None
            assert abs(x[token_id].logprob - y[token_id].logprob) < 2e-3
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
    _assert_no_leaks(parallel)


def test_repeated_prompt_hits_the_prefix_cache(parallel: LLM, reference: list[RequestOutput]) -> None:
    again = parallel.generate(LONG, PARAMS, use_tqdm=False)[0]
    assert again.num_cached_tokens >= len(again.prompt_token_ids) - 16
    assert again.outputs[0].token_ids == reference[0].outputs[0].token_ids
    _assert_no_leaks(parallel)


def test_rank_zero_holds_only_its_share(parallel: LLM) -> None:
    tp = parallel.core.config.parallel.tensor_parallel_size
    pp = parallel.core.config.parallel.pipeline_parallel_size
    caches = parallel.core.runner.kv_caches
    assert len(caches) == 30 // pp  # its stage's layers
    assert caches[0].shape[3] == 3 // tp  # its KV heads
    attn = parallel.core.model.model.layers[0].self_attn
    assert (attn.num_heads, attn.num_kv_heads) == (9 // tp, 3 // tp)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"pipeline_parallel_size": 31}, "pipeline_parallel_size 31 exceeds the model's 30 layers: use at most 30"),
        ({"tensor_parallel_size": 0}, r"parallel\.tensor_parallel_size: 0 must be >= 1"),
    ],
)
def test_bad_parallel_config_is_refused(smollm2: LLM, options: dict[str, int], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        smollm2.derive(**options)


def test_llm_refuses_a_bad_split_before_loading() -> None:
    message = r"tensor_parallel_size 2: it must divide num_attention_heads \(9\); for this model use one of \[1, 3\]"
    with pytest.raises(ConfigError, match=message):
        LLM("smollm2-135m-instruct", device="cpu", tensor_parallel_size=2)


# --- tp=2 x pp=2 with a replicated KV head --------------------------------------------


@pytest.fixture(scope="module")
def tiny() -> LLM:
    return LLM("llama-3.2-1b", load_format="dummy", hf_overrides=TINY, device="cpu", dtype="float32",
               num_threads=1, num_blocks=64, block_size=4, max_model_len=256, max_num_batched_tokens=16)


@pytest.fixture(scope="module")
def tiny_parallel(tiny: LLM) -> Iterator[LLM]:
    llm = tiny.derive(tensor_parallel_size=2, pipeline_parallel_size=2)
    yield llm
    llm.core.shutdown()
    torch.set_num_threads(2)


def test_tp2_pp2_replicated_kv_head_equals_one_process(tiny: LLM, tiny_parallel: LLM) -> None:
    want = _tokens(tiny.generate(TINY_PROMPTS, TINY_PARAMS, use_tqdm=False))
    assert len({t for tokens in want for t in tokens}) > 8  # the random model's tokens vary
    assert _tokens(tiny_parallel.generate(TINY_PROMPTS, TINY_PARAMS, use_tqdm=False)) == want
    attn = tiny_parallel.core.model.model.layers[0].self_attn
    assert (attn.num_heads, attn.num_kv_heads) == (2, 1)
    assert len(tiny_parallel.core.runner.kv_caches) == 2
    _assert_no_leaks(tiny_parallel)


def test_dead_worker_fails_the_step_clearly(tiny_parallel: LLM) -> None:
    """Last in this file: it breaks the tp2 x pp2 engine for good."""
    executor = tiny_parallel.core.executor
    assert executor is not None and isinstance(executor.launcher, ProcessLauncher)
    os.kill(executor.launcher.pid(2), signal.SIGKILL)  # rank 2: tensor rank 0 of the first stage
    message = r"rank 2 \(pipeline stage 0, tensor rank 0\) was killed by SIGKILL"
    with pytest.raises(WorkerDiedError, match=message):
        tiny_parallel.generate(TINY_PROMPTS, TINY_PARAMS, use_tqdm=False)
    with pytest.raises(WorkerDiedError, match=message):  # and stays failed
        tiny_parallel.generate(TINY_PROMPTS, TINY_PARAMS, use_tqdm=False)
