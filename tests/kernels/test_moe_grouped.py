"""The MoE decode kernels (kernels/moe/triton_grouped.py) against their torch definition
(kernels/moe/reference.py) and the model's own MoE block, under the Triton interpreter on
tiny shapes in fp32 and fp16: D and I not multiples of the blocks (so the masks run), a
token routed twice to neighbouring experts, and an expert-parallel rank's share. That the
kernels read only the routed experts is checked by poisoning every other expert with NaN.
"""

from __future__ import annotations

import pytest
import torch

from vllm_cluster.engine.models.mixtral import SparseMoeBlock, route
from vllm_cluster.kernels.moe import reference
from vllm_cluster.kernels.moe.triton_grouped import moe_selected_experts

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
NUM_EXPERTS, TOP_K, HIDDEN, INTER = 6, 2, 40, 24
# fp32: sums in another order; fp16: h is kept in fp32, the output rounds once.
TOLERANCES = {torch.float32: 1e-4, torch.float16: 2e-3}


def _inputs(num_tokens: int, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(num_tokens)
    x = torch.randn(num_tokens, HIDDEN, generator=gen)
    w13 = torch.randn(NUM_EXPERTS, 2 * INTER, HIDDEN, generator=gen) * HIDDEN**-0.5
    w2 = torch.randn(NUM_EXPERTS, HIDDEN, INTER, generator=gen) * INTER**-0.5
    weights, expert_ids = route(torch.randn(num_tokens, NUM_EXPERTS, generator=gen), TOP_K)
    return tuple(t.to(DEVICE) for t in (x.to(dtype), w13.to(dtype), w2.to(dtype), weights, expert_ids))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("num_tokens", [1, 3])
def test_matches_the_reference_and_the_model_block(num_tokens: int, dtype: torch.dtype) -> None:
    x, w13, w2, weights, expert_ids = _inputs(num_tokens, dtype)
    got = moe_selected_experts(x, w13, w2, weights, expert_ids)
    tol = TOLERANCES[dtype]
    torch.testing.assert_close(got, reference.moe_selected_experts(x, w13, w2, weights, expert_ids), atol=tol, rtol=tol)
    block = SparseMoeBlock(HIDDEN, INTER, NUM_EXPERTS, TOP_K).to(DEVICE)
    with torch.no_grad():
        block.stack.w13_weight.copy_(w13.float())
        block.stack.w2_weight.copy_(w2.float())
        dense = block.forward_dense(x.float(), weights, expert_ids)
    torch.testing.assert_close(got.float(), dense, atol=tol, rtol=tol)


def test_reads_only_the_routed_experts() -> None:
    x, w13, w2, weights, expert_ids = _inputs(2, torch.float32)
    unused = sorted(set(range(NUM_EXPERTS)) - set(expert_ids.flatten().tolist()))
    assert unused, "every expert routed: the poison would not be read either way"
    w13[unused], w2[unused] = float("nan"), float("nan")
    got = moe_selected_experts(x, w13, w2, weights, expert_ids)
    assert bool(torch.isfinite(got).all())
    torch.testing.assert_close(got, reference.moe_selected_experts(x, w13, w2, weights, expert_ids))


def test_an_expert_parallel_rank_adds_only_its_experts() -> None:
    """Ranks holding experts 0-2 and 3-5 each return their share; the shares sum to the whole."""
    x, w13, w2, weights, expert_ids = _inputs(3, torch.float32)
    half = NUM_EXPERTS // 2
    shares = [
        moe_selected_experts(x, w13[start : start + half], w2[start : start + half], weights, expert_ids, start)
        for start in (0, half)
    ]
    whole = reference.moe_selected_experts(x, w13, w2, weights, expert_ids)
    torch.testing.assert_close(shares[0] + shares[1], whole, atol=1e-4, rtol=1e-4)
    assert (shares[0] - whole).abs().max() > 1e-2  # each rank's share alone is not the whole


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_cuda_graph_replays_it_for_new_routes() -> None:
    """Captured once, replayed after the inputs and routes change in place: static shapes, no
    host sync."""
    x, w13, w2, weights, expert_ids = _inputs(4, torch.float16)
    moe_selected_experts(x, w13, w2, weights, expert_ids)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = moe_selected_experts(x, w13, w2, weights, expert_ids)
    x2, _, _, weights2, ids2 = _inputs(5, torch.float16)
    x.copy_(x2[:4])
    weights.copy_(weights2[:4])
    expert_ids.copy_(ids2[:4])
    graph.replay()
    expected = reference.moe_selected_experts(x, w13, w2, weights, expert_ids)
    torch.testing.assert_close(out, expected, atol=2e-3, rtol=2e-3)
