"""Prefill -> decode hand-off with kv_cache_dtype fp8: the fp8 blocks move as bytes and the
decode continues exactly as a colocated fp8 engine would (greedy tokens equal, token for
token: both read the same stored values); a tensor-parallel prefill gathers its ranks' fp8
heads the same way; a prefill and a decode of different KV cache dtypes are refused at the
transport's handshake, naming both, and nothing lands."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from tests.correctness.handoff import run_disaggregated
from tests.correctness.test_heterogeneous_tp import PARAMS, PROMPTS, TINY
from vllm_cluster.engine import LLM
from vllm_cluster.engine.engine_core import EngineCore
from vllm_cluster.engine.scheduler import SampledToken
from vllm_cluster.kv_transfer import KVLayout, TransferStatus, make_receiver, make_sender
from vllm_cluster.prefill_service.push import ReservationPush

pytestmark = pytest.mark.slow


def _fp8_llm() -> LLM:
    return LLM("llama-3.2-1b", load_format="dummy", hf_overrides=TINY, device="cpu", dtype="float32",
               num_threads=1, num_blocks=64, block_size=4, max_model_len=256, max_num_batched_tokens=24,
               kv_cache_dtype="fp8")


@pytest.fixture(scope="module")
def tiny_fp8() -> LLM:
    return _fp8_llm()


@pytest.fixture(scope="module")
def expected(tiny_fp8: LLM) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in tiny_fp8.generate(PROMPTS, PARAMS, use_tqdm=False)]


def _run_over_transport(prefill: EngineCore, decode: EngineCore, prompts: list[list[int]]) -> tuple[list, list]:
    """The hand-off through the local KV transport (handshake, layout check, raw bytes):
    ([generated tokens] per prompt, [ReservationPush] per prompt)."""
    receiver = make_receiver("local", decode.transfer_caches, _layout(decode))
    sender = make_sender(receiver.endpoint, prefill.transfer_caches, _layout(prefill), "prefill-0")
    try:
        pushes, first = [], {}
        for i, prompt in enumerate(prompts):
            rid = f"r{i}"
            block_ids = decode.reserve(decode.make_request(rid, prompt, PARAMS), lease_s=60)
            assert block_ids is not None
            receiver.expect(rid, block_ids)
            num_skip = decode.scheduler.requests[rid].num_cached_tokens // decode.kv.block_size
            push = ReservationPush(sender, receiver.endpoint, rid, block_ids, num_skip, timeout_s=10)
            prefill.add_request(prefill.make_request(rid, prompt, PARAMS), push)
            pushes.append(push)
        while prefill.has_unfinished():
            for update in prefill.step():
                first[update.request.request_id] = SampledToken(update.new_token_ids[0], None)
        outputs = {}
        for rid, token in first.items():
            landed = receiver.wait(rid, 10) == TransferStatus.DONE
            update = decode.land(rid, token if landed else None)  # not landed: decode recomputes
            outputs[rid] = list(update.new_token_ids) if update is not None else []
        while decode.has_unfinished():
            for update in decode.step():
                outputs[update.request.request_id] += update.new_token_ids
        return [outputs[f"r{i}"] for i in range(len(prompts))], pushes
    finally:
        sender.close()
        receiver.close()


def _layout(core: EngineCore) -> KVLayout:
    return KVLayout.from_kv_caches(core.transfer_caches, model=core.config.model.model)


def test_fp8_over_the_transport_equals_colocated_fp8(tiny_fp8: LLM, expected: list[list[int]]) -> None:
    prefill = tiny_fp8.derive(role="prefill", max_num_batched_tokens=8).core  # chunked prompts
    decode = tiny_fp8.derive(role="decode").core
    got, pushes = _run_over_transport(prefill, decode, PROMPTS)
    assert all(p.status == TransferStatus.DONE for p in pushes), [p.error for p in pushes]
    assert got == expected
    assert _layout(decode).dtype == "float8_e4m3fn"


def test_fp8_by_copy_equals_colocated_fp8(tiny_fp8: LLM, expected: list[list[int]]) -> None:
    prefill = tiny_fp8.derive(role="prefill").core
    decode = tiny_fp8.derive(role="decode").core
    got, _ = run_disaggregated(prefill, decode, PROMPTS, PARAMS)
    assert got == expected


@pytest.fixture()
def tp2_prefill(tiny_fp8: LLM) -> Iterator[LLM]:
    llm = tiny_fp8.derive(role="prefill", tensor_parallel_size=2)
    yield llm
    llm.core.shutdown()
    torch.set_num_threads(2)


def test_fp8_prefill_tp2_into_decode_tp1(tiny_fp8: LLM, tp2_prefill: LLM, expected: list[list[int]]) -> None:
    """Rank 1 allocates an fp8 cache too (the INIT message names it) and sends its heads to
    rank 0's fp8 mirror as bytes (gloo has no fp8 type)."""
    assert tp2_prefill.core.transfer_caches[0].dtype == torch.float8_e4m3fn
    decode = tiny_fp8.derive(role="decode").core
    got, _ = run_disaggregated(tp2_prefill.core, decode, PROMPTS, PARAMS)
    assert got == expected


def test_fp8_prefill_into_auto_decode_is_refused(tiny_fp8: LLM) -> None:
    prefill = tiny_fp8.derive(role="prefill").core
    decode = tiny_fp8.derive(role="decode", kv_cache_dtype="auto").core
    assert decode.transfer_caches[0].dtype == torch.float32
    got, pushes = _run_over_transport(prefill, decode, PROMPTS[:1])
    assert pushes[0].status == TransferStatus.FAILED
    assert pushes[0].error is not None and "dtype: sender float8_e4m3fn, receiver float32" in pushes[0].error
    assert "kv_cache_dtype" in pushes[0].error
    # Nothing landed, so the decode computed the prompt itself and still answered.
    assert len(got[0]) == PARAMS.max_tokens
