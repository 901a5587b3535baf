"""The prefill and decode roles of the engine, in one process, with the hand-off done by a
direct copy between the two engines' KV caches: disaggregated greedy tokens equal colocated
ones, only the blocks decode lacks are pushed, and no block leaks on either side."""

from __future__ import annotations

import pytest

from tests.correctness.handoff import run_disaggregated
from vllm_cluster.engine import LLM, SamplingParams
from vllm_cluster.engine.scheduler import SampledToken
from vllm_cluster.kv_transfer import KVLayout, TransferStatus
from vllm_cluster.kv_transfer.local import LocalReceiver, LocalSender
from vllm_cluster.prefill_service.push import ReservationPush

pytestmark = pytest.mark.slow


def test_disaggregated_equals_colocated(smollm2: LLM) -> None:
    tok = smollm2.get_tokenizer()
    texts = ["The capital of France is", "def fibonacci(n):", "Once upon a time, " * 9, "1, 2, 3,"]
    prompts = [tok.encode(t) for t in texts]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    expected = [o.outputs[0].token_ids for o in smollm2.generate(prompts, params, use_tqdm=False)]
    prefill = smollm2.derive(role="prefill", max_num_batched_tokens=32).core  # chunked prompts
    decode = smollm2.derive(role="decode").core
    got, pushes = run_disaggregated(prefill, decode, prompts, params)
    assert got == expected
    num_layers = smollm2.core.model.config.num_hidden_layers
    assert all(p.layers_pushed == list(range(num_layers)) and p.finished for p in pushes)
    for core in (prefill, decode):
        assert core.kv.pool.num_free_blocks == core.kv.pool.num_blocks


def test_decode_prefix_hit_pushes_only_missing_blocks(smollm2: LLM) -> None:
    tok = smollm2.get_tokenizer()
    shared = tok.encode("You are a helpful assistant. Answer briefly and precisely. " * 4)
    prompts = [shared + tok.encode(" What is 2+2?"), shared + tok.encode(" Name a color.")]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    expected = [o.outputs[0].token_ids for o in smollm2.generate(prompts, params, use_tqdm=False)]
    prefill = smollm2.derive(role="prefill").core
    decode = smollm2.derive(role="decode").core
    first, _ = run_disaggregated(prefill, decode, prompts[:1], params)
    second, pushes = run_disaggregated(prefill, decode, prompts[1:], params)
    assert [first[0], second[0]] == expected
    block_size = decode.kv.block_size
    num_shared_blocks = len(shared) // block_size
    assert pushes[0].num_skip_blocks == num_shared_blocks
    assert pushes[0].num_blocks_pushed == -(-len(prompts[1]) // block_size) - num_shared_blocks


def test_first_token_ends_request_and_recompute_and_lease(smollm2: LLM) -> None:
    tok = smollm2.get_tokenizer()
    prompt = tok.encode("Count: one, two, three,")
    decode = smollm2.derive(role="decode").core
    baseline = decode.kv.pool.num_free_blocks
    # max_tokens=1: the first token from prefill finishes the request at once.
    decode.reserve(decode.make_request("a", prompt, SamplingParams(max_tokens=1)), lease_s=60)
    update = decode.land("a", SampledToken(42, None))
    assert update is not None and update.finished and not decode.has_unfinished()
    # A failed hand-off: decode computes the prompt itself, output as colocated.
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    expected = smollm2.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids
    decode.reserve(decode.make_request("b", prompt, params), lease_s=60)
    assert decode.land("b", None) is None
    got = []
    while decode.has_unfinished():
        got += [t for u in decode.step() for t in u.new_token_ids]
    assert got == expected
    # A lease that expires frees its blocks.
    decode.reserve(decode.make_request("c", prompt, params), lease_s=5)
    assert decode.kv.pool.num_free_blocks < baseline
    assert decode.expired_leases() == []
    assert decode.expired_leases(now=1e18) == ["c"]
    decode.abort("c")
    assert decode.kv.pool.num_free_blocks == baseline and not decode.is_transferring("c")


def test_seeded_sampling_continues_the_same_stream(smollm2: LLM) -> None:
    tok = smollm2.get_tokenizer()
    prompt = tok.encode("Write a word:")
    params = SamplingParams(temperature=1.0, seed=7, max_tokens=10, ignore_eos=True)
    expected = smollm2.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids
    got, _ = run_disaggregated(
        smollm2.derive(role="prefill").core, smollm2.derive(role="decode").core, [prompt], params
    )
    assert got[0] == expected


def test_a_push_that_cannot_be_queued_fails_only_its_request(smollm2: LLM) -> None:
    """Two prompts complete in one prefill step over the real in-process transport; one
    reservation is too short for its prompt. That push fails with the reason, the other
    lands every layer, both requests get their first token, and no block is held after."""
    tok = smollm2.get_tokenizer()
    prompts = [tok.encode("The capital of France is"), tok.encode("def fibonacci(n):")]
    params = SamplingParams(temperature=0, max_tokens=4)
    prefill = smollm2.derive(role="prefill").core
    decode = smollm2.derive(role="decode").core
    layout = KVLayout.from_kv_caches(decode.transfer_caches, model=decode.config.model.model)
    receiver = LocalReceiver(decode.transfer_caches, layout, "one-push-fails")
    sender = LocalSender(prefill.transfer_caches, layout)
    try:
        block_ids = decode.reserve(decode.make_request("ok", prompts[0], params), lease_s=60)
        assert block_ids
        receiver.expect("t-ok", block_ids)
        good = ReservationPush(sender, receiver.endpoint, "t-ok", block_ids, 0, timeout_s=10)
        short = ReservationPush(sender, receiver.endpoint, "t-short", [], 0, timeout_s=10)
        prefill.add_request(prefill.make_request("ok", prompts[0], params), good)
        prefill.add_request(prefill.make_request("short", prompts[1], params), short)
        first = {}
        while prefill.has_unfinished():
            first |= {u.request.request_id: u.new_token_ids for u in prefill.step()}
        assert sorted(first) == ["ok", "short"] and all(len(t) == 1 for t in first.values())
        assert good.status == TransferStatus.DONE and good.error is None
        assert receiver.status("t-ok") == TransferStatus.DONE
        assert short.status == TransferStatus.FAILED
        assert short.error is not None and "layer 0 was not sent" in short.error
        assert "reservation holds 0 blocks" in short.error and short.num_blocks_sent == 0
        assert prefill.kv.pool.num_free_blocks == prefill.kv.pool.num_blocks
    finally:
        receiver.close()
        sender.close()
        decode.abort("ok")
    assert decode.kv.pool.num_free_blocks == decode.kv.pool.num_blocks
