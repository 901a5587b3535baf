"""Expert parallelism over two real processes (gloo on 127.0.0.1, groups built with
engine/parallel/groups.py): the tiny Mixtral of test_mixtral_vs_hf.py with its 4 experts
split 2 + 2 by `shard_experts`.

- Attention replicated: each rank's logits over a batch equal the single-process model's,
  are identical on both ranks, and greedy generation through the engine (each rank runs
  the same `LLM.generate`) equals HF transformers token for token.
- Attention tensor-parallel (engine/parallel/tensor.py's `apply_tp` over the same two
  ranks: heads, KV heads and vocabulary split) with the experts split as above: the
  logits equal the single-process model's, and a greedy loop equals HF's tokens.
- With two GPUs: NCCL, and decode steps replayed from CUDA graphs (the MoE block's dense
  path and the all-reduce captured in them); greedy tokens equal HF's.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from tests.correctness.mixtral_checkpoint import (
    MAX_NEW_TOKENS,
    PROMPTS,
    hf_greedy,
    prefill_logits,
    save_hf_mixtral,
)
from vllm_cluster.engine import LLM, SamplingParams
from vllm_cluster.engine.models import CausalLM
from vllm_cluster.engine.parallel.expert import moe_blocks, shard_experts
from vllm_cluster.engine.parallel.groups import Group, host_store, join_store, make_group
from vllm_cluster.engine.parallel.tensor import apply_tp

pytestmark = pytest.mark.slow

EP_SIZE = 2
HOST = "127.0.0.1"
TIMEOUT = timedelta(seconds=60)
# Sharding changes only summation orders (k summed per rank, then across ranks; attention
# output and logits summed or gathered over ranks) and the row counts the matmuls see, so
# at most fp32 rounding: logits reach about 6.5, and on this machine the expert split alone
# comes out bit-identical. Without the experts' all-reduce they are off by about 7.
ATOL = 1e-4

RankFn = Callable[[int, Group, LLM, list[torch.Tensor], list[list[int]]], None]


def _run_rank(rank: int, port: int, path: str, hf_tokens: list[list[int]], check: RankFn, device: str) -> None:
    torch.set_num_threads(1)  # two ranks on two cores
    if device == "cuda":
        torch.cuda.set_device(rank)
    store = join_store(HOST, port, EP_SIZE + 1, TIMEOUT)
    backend = "nccl" if device == "cuda" else "gloo"
    group = make_group(store, "ep", list(range(EP_SIZE)), rank, backend, TIMEOUT, HOST)
    device = f"cuda:{rank}" if device == "cuda" else device
    llm = LLM(path, device=device, dtype="float32", num_threads=1, num_blocks=64, block_size=4, max_model_len=256)
    single = prefill_logits(llm.core.model, PROMPTS)  # before any sharding: the one-process model
    check(rank, group, llm, single, hf_tokens)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[list[int]]]:
    """The checkpoint's path and HF's greedy tokens for PROMPTS."""
    path = tmp_path_factory.mktemp("tiny_mixtral")
    hf_model = save_hf_mixtral(path)
    return path, [hf_greedy(hf_model, p) for p in PROMPTS]


def _spawn(checkpoint: tuple[Path, list[list[int]]], check: RankFn, device: str = "cpu") -> None:
    path, hf_tokens = checkpoint
    store = host_store(HOST, EP_SIZE + 1, TIMEOUT)  # held here; the ranks join it
    # A rank that fails makes spawn stop the other one and raise its traceback here.
    mp.spawn(_run_rank, args=(store.port, str(path), hf_tokens, check, device), nprocs=EP_SIZE, join=True)


def _assert_experts_split(model: CausalLM, rank: int) -> None:
    blocks = moe_blocks(model)
    assert len(blocks) == model.config.num_hidden_layers
    assert [(b.expert_start, b.num_local_experts) for b in blocks] == [(2 * rank, 2)] * len(blocks)


def _check_replicated_attention(
    rank: int, group: Group, llm: LLM, single: list[torch.Tensor], hf_tokens: list[list[int]]
) -> None:
    shard_experts(llm.core.model, rank, EP_SIZE, group.pg)
    _assert_experts_split(llm.core.model, rank)
    sharded = prefill_logits(llm.core.model, PROMPTS)
    for ours, reference in zip(sharded, single, strict=True):
        torch.testing.assert_close(ours, reference, atol=ATOL, rtol=0)
    everyone = group.gather_cat(torch.cat(sharded).unsqueeze(0), dim=0)
    assert everyone is None or all(torch.equal(g, everyone[0]) for g in everyone), "ranks disagree"

    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW_TOKENS, ignore_eos=True)
    outputs = llm.generate(PROMPTS, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == hf_tokens


def _check_cuda_graphs(
    rank: int, group: Group, llm: LLM, single: list[torch.Tensor], hf_tokens: list[list[int]]
) -> None:
    assert llm.core.runner.graphs is not None, "decode steps should replay CUDA graphs"
    shard_experts(llm.core.model, rank, EP_SIZE, group.pg)
    _assert_experts_split(llm.core.model, rank)
    for ours, reference in zip(prefill_logits(llm.core.model, PROMPTS), single, strict=True):
        torch.testing.assert_close(ours, reference, atol=ATOL, rtol=0)
    # The graphs were captured before sharding: capture them again over the local experts.
    eager = llm.derive(enforce_eager=True)
    graphs = llm.derive()
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW_TOKENS, ignore_eos=True)
    for engine in (eager, graphs):
        outputs = engine.generate(PROMPTS, params, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outputs] == hf_tokens


def _check_tensor_parallel_attention(
    rank: int, group: Group, llm: LLM, single: list[torch.Tensor], hf_tokens: list[list[int]]
) -> None:
    model = copy.deepcopy(llm.core.model)
    apply_tp(model, group)  # attention heads and vocabulary; leaves the MoE blocks alone
    shard_experts(model, rank, EP_SIZE, group.pg)
    _assert_experts_split(model, rank)
    assert model.model.layers[0].self_attn.num_heads == 2  # type: ignore[union-attr]
    vocab_block = model.config.vocab_size // EP_SIZE
    columns = slice(0, None) if rank == 0 else slice(rank * vocab_block, (rank + 1) * vocab_block)
    for ours, reference in zip(prefill_logits(model, PROMPTS), single, strict=True):
        torch.testing.assert_close(ours, reference[:, columns], atol=ATOL, rtol=0)

    # Greedy, recomputing each sequence from scratch per token: rank 0 holds the logits
    # and picks; the other rank follows its choice.
    sequences = [list(p) for p in PROMPTS]
    for _ in range(MAX_NEW_TOKENS):
        last = torch.stack([logits[-1] for logits in prefill_logits(model, sequences)])
        chosen = last.argmax(dim=-1) if rank == 0 else torch.empty(len(sequences), dtype=torch.long)
        group.broadcast_(chosen, src=0)
        for sequence, token in zip(sequences, chosen.tolist(), strict=True):
            sequence.append(token)
    assert [s[len(p) :] for s, p in zip(sequences, PROMPTS, strict=True)] == hf_tokens


def test_expert_parallel_with_replicated_attention_matches_one_process_and_hf(
    checkpoint: tuple[Path, list[list[int]]],
) -> None:
    _spawn(checkpoint, _check_replicated_attention)


def test_expert_parallel_with_tensor_parallel_attention_matches_hf(checkpoint: tuple[Path, list[list[int]]]) -> None:
    _spawn(checkpoint, _check_tensor_parallel_attention)


@pytest.mark.skipif(torch.cuda.device_count() < EP_SIZE, reason="needs two GPUs")
def test_expert_parallel_on_two_gpus_with_cuda_graphs_matches_hf(checkpoint: tuple[Path, list[list[int]]]) -> None:
    _spawn(checkpoint, _check_cuda_graphs, device="cuda")
