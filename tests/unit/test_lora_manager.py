"""Resident LoRA slots on a tiny dummy Llama: LRU swapping, requests that wait for a slot,
mixed batches that equal their one-by-one runs, prefixes never shared across adapters."""

from __future__ import annotations

import pytest

from tests.lora_adapters import write_adapter
from vllm_cluster.engine import LLM, InvalidRequestError, LoRARequest, SamplingParams
from vllm_cluster.engine.request import RequestId

TINY = dict(
    vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
    tie_word_embeddings=False,
)
PROMPTS = [[1, 5, 9, 17, 33, 2, 7, 11, 40, 41, 42, 43, 44, 45, 46, 47, 3], [4, 8, 15, 16, 23, 42], [100, 101, 102]]
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


def _llm(max_loras: int) -> LLM:
    return LLM("llama-3.2-1b", load_format="dummy", hf_overrides=TINY, device="cpu", dtype="float32",
               num_threads=1, num_blocks=64, block_size=4, max_num_seqs=8, max_num_batched_tokens=64,
               enable_lora=True, max_loras=max_loras, max_lora_rank=8)


@pytest.fixture(scope="module")
def adapters(tmp_path_factory: pytest.TempPathFactory) -> list[LoRARequest]:
    arch = _llm(1).core.model.config
    root = tmp_path_factory.mktemp("adapters")
    return [LoRARequest(f"a{i}", i + 1, str(write_adapter(root / f"a{i}", arch, rank=4 + 2 * i, seed=i, std=0.5)))
            for i in range(3)]


def test_lru_slots(adapters: list[LoRARequest]) -> None:
    llm = _llm(2)
    for a in adapters:
        llm.core.add_lora(a.lora_name, a.lora_path)
    lora = llm.core.lora
    assert lora is not None
    r1, r2, r3 = RequestId("r1"), RequestId("r2"), RequestId("r3")
    assert lora.acquire(r1, "a0") and lora.acquire(r2, "a1")
    assert lora.slot_of(r1) == 0 and lora.slot_of(r2) == 1
    assert not lora.acquire(r3, "a2")  # both slots held: r3 waits
    lora.release(r1)
    assert lora.acquire(r3, "a2") and lora.slot_of(r3) == 0  # a0 (unheld) swapped out
    assert lora.resident_names == ["a1", "a2"] and lora.num_swaps == 1
    lora.release(r2)
    lora.release(r3)
    assert lora.acquire(r1, "a1")  # resident: no swap, and now the most recent
    assert lora.acquire(r2, "a0") and lora.slot_of(r2) == 0  # a2 was least recently used
    assert lora.resident_names == ["a1", "a0"] and lora.num_swaps == 2


def test_mixed_batch_equals_one_by_one_with_one_slot(adapters: list[LoRARequest]) -> None:
    llm = _llm(1)
    loras: list[LoRARequest | None] = [adapters[0], None, adapters[1]]
    alone = [
        llm.generate([p], GREEDY, use_tqdm=False, lora_request=lora)[0] for p, lora in zip(PROMPTS, loras, strict=True)
    ]
    swaps = llm.core.lora.num_swaps if llm.core.lora else 0
    mixed = llm.generate(PROMPTS * 2, GREEDY, use_tqdm=False, lora_request=loras * 2)
    assert [o.outputs[0].token_ids for o in mixed] == [o.outputs[0].token_ids for o in alone] * 2
    assert llm.core.lora is not None and llm.core.lora.num_swaps > swaps  # a0 and a1 took turns in one slot
    base = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
    assert base[0] != mixed[0].outputs[0].token_ids and base[2] != mixed[2].outputs[0].token_ids


def test_prefixes_not_shared_across_adapters(adapters: list[LoRARequest]) -> None:
    llm = _llm(2)
    prompt = PROMPTS[0]  # 17 tokens: 4 full blocks of 4
    llm.generate([prompt], GREEDY, use_tqdm=False)
    again = llm.generate([prompt], GREEDY, use_tqdm=False)[0]
    under_a0 = llm.generate([prompt], GREEDY, use_tqdm=False, lora_request=adapters[0])[0]
    under_a0_again = llm.generate([prompt], GREEDY, use_tqdm=False, lora_request=adapters[0])[0]
    assert again.num_cached_tokens == 16
    assert under_a0.num_cached_tokens == 0
    assert under_a0_again.num_cached_tokens == 16


def test_unknown_adapter_and_engine_without_lora(adapters: list[LoRARequest]) -> None:
    llm = _llm(1)
    with pytest.raises(InvalidRequestError, match="LoRA adapter 'nope' is not loaded"):
        llm.core.make_request("x", [1, 2], GREEDY, lora_name="nope")
    plain = LLM("llama-3.2-1b", load_format="dummy", hf_overrides=TINY, device="cpu", dtype="float32", num_blocks=16)
    with pytest.raises(InvalidRequestError, match="start it with enable_lora: true"):
        plain.generate([PROMPTS[0]], GREEDY, use_tqdm=False, lora_request=adapters[0])
