"""Heterogeneous disaggregation on two GPUs (NCCL): a tp=2 prefill hands its KV to a tp=1
decode and a tp=1 prefill to a tp=2 decode, through the full-head transfer caches
(engine/parallel/kv_mirror.py: the prefill gathers its ranks' heads over NCCL, the decode
scatters landed blocks to its ranks). Greedy tokens equal the colocated single-GPU
engine's (fp32, random weights with a peaked lm_head, as tests/correctness/test_parallel_gpu.py),
and no block leaks. Skipped with fewer than two CUDA devices; the CPU (gloo) version is
tests/correctness/test_heterogeneous_tp.py."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from tests.correctness.handoff import run_disaggregated
from vllm_cluster.engine import LLM, SamplingParams

pytestmark = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")

CONFIG = dict(
    vocab_size=4096, hidden_size=512, intermediate_size=1024, num_hidden_layers=4,
    num_attention_heads=8, num_key_value_heads=2, head_dim=64, max_position_embeddings=2048,
    tie_word_embeddings=False,
)
OPTIONS = dict(load_format="dummy", hf_overrides=CONFIG, device="cuda", dtype="float32", block_size=16,
               num_blocks=256, max_model_len=1024, max_num_batched_tokens=128, max_num_seqs=16)
PARAMS = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(2)
    return [torch.randint(0, 4096, (n,), generator=g).tolist() for n in (1, 9, 40, 200)]


@pytest.fixture(scope="module")
def single() -> LLM:
    llm = LLM("llama-3.2-1b", **OPTIONS)
    with torch.no_grad():  # a peaked next-token distribution: no near-ties to flip
        llm.core.model.lm_head.weight.mul_(15.0)
    return llm


@pytest.fixture(scope="module")
def reference(single: LLM) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in single.generate(_prompts(), PARAMS, use_tqdm=False)]


@pytest.fixture()
def tp2(single: LLM, request: pytest.FixtureRequest) -> Iterator[LLM]:
    llm = single.derive(role=request.param, tensor_parallel_size=2)
    yield llm
    llm.core.shutdown()


def _assert_no_leaks(*llms: LLM) -> None:
    for llm in llms:
        assert not llm.core.has_unfinished()
        assert llm.core.kv.pool.num_free_blocks == llm.core.kv.pool.num_blocks


@pytest.mark.parametrize("tp2", ["prefill"], indirect=True)
def test_prefill_tp2_into_decode_tp1(single: LLM, tp2: LLM, reference: list[list[int]]) -> None:
    decode = single.derive(role="decode")
    got, pushes = run_disaggregated(tp2.core, decode.core, _prompts(), PARAMS)
    assert got == reference
    assert all(p.finished for p in pushes)
    _assert_no_leaks(tp2, decode)


@pytest.mark.parametrize("tp2", ["decode"], indirect=True)
def test_prefill_tp1_into_decode_tp2(single: LLM, tp2: LLM, reference: list[list[int]]) -> None:
    prefill = single.derive(role="prefill", max_num_batched_tokens=32)  # chunked prompts
    got, _ = run_disaggregated(prefill.core, tp2.core, _prompts(), PARAMS)
    assert got == reference
    _assert_no_leaks(prefill, tp2)
