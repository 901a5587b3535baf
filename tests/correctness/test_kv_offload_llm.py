"""Offload tiers on the bundled model: greedy output with a host (and disk) tier equals the
output without, on a multi-turn workload whose conversations do not fit the device cache,
and a corrupt disk file only costs a recompute."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from tests.correctness.handoff import run_disaggregated
from vllm_cluster.engine import LLM, SamplingParams
from vllm_cluster.engine.kv_offload import Tier

pytestmark = pytest.mark.slow

NUM_DEVICE_BLOCKS = 24  # 384 tokens: three conversations at most
GREEDY = SamplingParams(temperature=0, max_tokens=4)


def _conversations(num: int, num_tokens: int) -> list[list[int]]:
    rng = random.Random(3)
    return [[rng.randrange(1000, 20000) for _ in range(num_tokens)] for _ in range(num)]


def _chat(llm: LLM, conversations: list[list[int]], num_turns: int) -> list[list[int]]:
    """Each turn of each conversation, interleaved: the conversation so far plus a new message."""
    history = [list(c) for c in conversations]
    answers = []
    for turn in range(num_turns):
        for i, convo in enumerate(history):
            convo += [200 + turn, 300 + i, 400 + turn]
            output = llm.generate([convo], GREEDY, use_tqdm=False)[0].outputs[0]
            answers.append(list(output.token_ids))
            convo += output.token_ids
    return answers


def _gib(llm: LLM, num_blocks: int) -> float:
    block_bytes = sum(c[0].numel() * c.element_size() for c in llm.core.runner.kv_caches)
    return num_blocks * block_bytes / 2**30


@pytest.fixture(scope="module")
def small(smollm2: LLM) -> LLM:
    return smollm2.derive(num_blocks=NUM_DEVICE_BLOCKS, max_model_len=384, max_num_batched_tokens=256)


@pytest.fixture(scope="module")
def reference(small: LLM) -> list[list[int]]:
    return _chat(small, _conversations(4, 100), num_turns=2)


def test_host_tier_output_equals_no_tier(small: LLM, reference: list[list[int]]) -> None:
    tiered = small.derive(host_kv_gib=_gib(small, 64))
    assert _chat(tiered, _conversations(4, 100), num_turns=2) == reference
    stats = tiered.core.kv.prefix_stats
    assert stats.num_host_hits >= 4 * 16, "the second turns should load blocks from the host tier"
    assert tiered.core.kv.offload is not None
    assert tiered.core.kv.offload.stats[Tier.HOST].num_hit_blocks >= 4


def test_disk_tier_survives_a_corrupt_file(small: LLM, reference: list[list[int]], tmp_path: Path) -> None:
    tiered = small.derive(host_kv_gib=_gib(small, 2), disk_kv_dir=str(tmp_path), disk_kv_gib=_gib(small, 64))
    offload = tiered.core.kv.offload
    assert offload is not None and offload.disk is not None
    conversations = _conversations(4, 100)
    first = _chat(tiered, conversations, num_turns=1)
    files = sorted(tmp_path.glob("*.kvblock"))
    assert files, "the first turns should have spilled to disk"
    for path in files[::3]:
        data = bytearray(path.read_bytes())
        data[len(data) // 2] ^= 0xFF
        path.write_bytes(bytes(data))
    tiered.core.kv.prefix_stats.num_disk_hits = 0
    again = _chat(tiered, conversations, num_turns=2)
    assert first == reference[:4] and again == reference
    assert offload.stats[Tier.DISK].num_failed_loads >= 1
    assert tiered.core.kv.prefix_stats.num_disk_hits > 0


def test_decode_loads_a_prefix_from_its_host_tier_and_prefill_skips_it(smollm2: LLM) -> None:
    shared = list(range(1000, 1096))  # 6 full blocks
    prompts = [shared + [5, 6, 7], list(range(3000, 3140)), shared + [8, 9, 10]]  # the second evicts the first
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    expected = [smollm2.generate([p], params, use_tqdm=False)[0].outputs[0].token_ids for p in prompts]
    prefill = smollm2.derive(role="prefill").core
    decode = smollm2.derive(role="decode", num_blocks=10, max_model_len=160, host_kv_gib=_gib(smollm2, 32)).core
    got, pushes = [], []
    for prompt in prompts:
        outputs, step_pushes = run_disaggregated(prefill, decode, [prompt], params)
        got += outputs
        pushes += step_pushes
    assert got == expected
    assert pushes[2].num_skip_blocks == 6  # the decode side held the whole shared prefix, partly in host memory
    assert decode.kv.prefix_stats.num_host_hits > 0
    assert decode.kv.pool.num_free_blocks == decode.kv.pool.num_blocks
