"""Heterogeneous disaggregation: a tensor-parallel prefill hands its KV to a decode of
another tensor-parallel size (tp=2 -> tp=1, tp=1 -> tp=2), through the transfer caches
(every KV head, as one process holds them: engine/parallel/kv_mirror.py). Greedy tokens
equal the colocated single-process engine's, with the KV heads split across the ranks and
replicated (one KV head, two ranks), and no block leaks on either side."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from tests.correctness.handoff import run_disaggregated
from vllm_cluster.engine import LLM, SamplingParams
from vllm_cluster.engine.errors import ConfigError

pytestmark = pytest.mark.slow

# 4 query heads; 2 KV heads split one per rank at tp=2 (the replicated case overrides to 1).
TINY = dict(
    vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
    num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
    tie_word_embeddings=False,
)
PROMPTS = [[7, 8], [3, 141, 59, 26, 5], [(37 * i + 11) % 500 for i in range(40)], [(13 * i) % 500 for i in range(21)]]
PARAMS = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


def _llm(num_kv_heads: int) -> LLM:
    return LLM("llama-3.2-1b", load_format="dummy", hf_overrides={**TINY, "num_key_value_heads": num_kv_heads},
               device="cpu", dtype="float32", num_threads=1, num_blocks=64, block_size=4,
               max_model_len=256, max_num_batched_tokens=24)


def _expected(llm: LLM) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, PARAMS, use_tqdm=False)]


@pytest.fixture(scope="module")
def tiny() -> LLM:
    return _llm(2)


@pytest.fixture()
def parallel_role(tiny: LLM, request: pytest.FixtureRequest) -> Iterator[LLM]:
    llm = tiny.derive(role=request.param, tensor_parallel_size=2)
    yield llm
    llm.core.shutdown()
    torch.set_num_threads(2)


def _assert_no_leaks(*llms: LLM) -> None:
    for llm in llms:
        assert not llm.core.has_unfinished()
        assert llm.core.kv.pool.num_free_blocks == llm.core.kv.pool.num_blocks


@pytest.mark.parametrize("parallel_role", ["prefill"], indirect=True)
def test_prefill_tp2_into_decode_tp1_equals_colocated(tiny: LLM, parallel_role: LLM) -> None:
    prefill = parallel_role
    assert prefill.core.runner.kv_caches[0].shape[3] == 1  # rank 0 holds one of the two heads
    assert prefill.core.transfer_caches[0].shape[3] == 2  # and sends both
    decode = tiny.derive(role="decode")
    got, pushes = run_disaggregated(prefill.core, decode.core, PROMPTS, PARAMS)
    assert got == _expected(tiny)
    assert all(p.layers_pushed == [0, 1, 2] and p.finished for p in pushes)
    _assert_no_leaks(prefill, decode)


@pytest.mark.parametrize("parallel_role", ["decode"], indirect=True)
def test_prefill_tp1_into_decode_tp2_equals_colocated(tiny: LLM, parallel_role: LLM) -> None:
    decode = parallel_role
    prefill = tiny.derive(role="prefill", max_num_batched_tokens=8)  # chunked prompts
    got, _ = run_disaggregated(prefill.core, decode.core, PROMPTS, PARAMS)
    assert got == _expected(tiny)
    # Again: the decode now serves prompt prefixes from its own (per-rank) cache.
    got, pushes = run_disaggregated(prefill.core, decode.core, PROMPTS, PARAMS)
    assert got == _expected(tiny)
    assert any(p.num_skip_blocks > 0 for p in pushes)
    _assert_no_leaks(prefill, decode)


def test_replicated_kv_head_prefill_tp2_into_decode_tp1() -> None:
    single = _llm(1)
    prefill = single.derive(role="prefill", tensor_parallel_size=2)
    try:
        got, _ = run_disaggregated(prefill.core, single.derive(role="decode").core, PROMPTS, PARAMS)
        assert got == _expected(single)
    finally:
        prefill.core.shutdown()
        torch.set_num_threads(2)


def test_pipeline_parallel_roles_are_refused(tiny: LLM) -> None:
    with pytest.raises(ConfigError, match="role 'prefill' splits by tensor parallelism only"):
        tiny.derive(role="prefill", pipeline_parallel_size=2)
