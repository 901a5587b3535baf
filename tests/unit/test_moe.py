"""The sparse MoE block against a per-token reference: routing as HF Mixtral does it, both
compute paths (grouped by expert; dense for CUDA graphs), and expert shards that sum to
the whole. Plus the expert-parallel split rule and its errors."""

from __future__ import annotations

import pytest
import torch
from torch.nn import functional as F

from vllm_cluster.engine.errors import ConfigError, ModelLoadError
from vllm_cluster.engine.loader.presets import PRESETS
from vllm_cluster.engine.models import CausalLM, ModelArchConfig
from vllm_cluster.engine.models.mixtral import SparseMoeBlock, route
from vllm_cluster.engine.parallel.expert import expert_range, moe_blocks, shard_experts

HIDDEN, INTERMEDIATE, NUM_EXPERTS, TOP_K = 16, 24, 8, 2


def _block(seed: int = 0) -> SparseMoeBlock:
    torch.manual_seed(seed)
    block = SparseMoeBlock(HIDDEN, INTERMEDIATE, NUM_EXPERTS, TOP_K)
    with torch.no_grad():
        for param in block.parameters():
            param.normal_(0.0, 0.3)
    return block


def _reference(block: SparseMoeBlock, x: torch.Tensor) -> torch.Tensor:
    """One token at a time, straight from the Mixtral definition."""
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        probs = torch.softmax(block.gate(x[t]), dim=-1)
        top, ids = probs.topk(TOP_K)
        for weight, e in zip(top / top.sum(), ids.tolist(), strict=True):
            gate, up = F.linear(x[t], block.stack.w13_weight[e]).chunk(2)
            out[t] += weight * F.linear(F.silu(gate) * up, block.stack.w2_weight[e])
    return out


def test_route_renormalises_the_top_k() -> None:
    logits = torch.tensor([[0.0, 2.0, 1.0, -1.0], [3.0, 3.5, -2.0, 0.5]])
    weights, ids = route(logits, 2)
    assert ids.tolist() == [[1, 2], [1, 0]]
    probs = torch.softmax(logits, dim=-1)
    expected = probs.gather(1, ids) / probs.gather(1, ids).sum(dim=-1, keepdim=True)
    torch.testing.assert_close(weights, expected)
    torch.testing.assert_close(weights.sum(dim=-1), torch.ones(2))


@pytest.mark.parametrize("num_tokens", [1, 5, 37])
def test_both_paths_match_the_per_token_reference(num_tokens: int) -> None:
    block = _block()
    x = torch.randn(num_tokens, HIDDEN, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = _reference(block, x)
        weights, expert_ids = route(block.gate(x), TOP_K)
        grouped = block.forward_grouped(x, weights, expert_ids)
        dense = block.forward_dense(x, weights, expert_ids)
    torch.testing.assert_close(grouped, expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(dense, expected, atol=1e-5, rtol=1e-5)
    assert torch.equal(block(x), grouped)  # forward takes the grouped path off CUDA graphs


@pytest.mark.parametrize("ep_size", [2, 4, 8])
def test_expert_shards_sum_to_the_whole_block(ep_size: int) -> None:
    x = torch.randn(23, HIDDEN, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        whole = _block()(x)
        partials = []
        for rank in range(ep_size):
            block = _block()
            experts = expert_range(NUM_EXPERTS, rank, ep_size)
            block.keep_experts(experts.start, len(experts))
            assert block.num_local_experts == NUM_EXPERTS // ep_size
            weights, expert_ids = route(block.gate(x), TOP_K)
            grouped = block.forward_grouped(x, weights, expert_ids)
            torch.testing.assert_close(block.forward_dense(x, weights, expert_ids), grouped, atol=1e-5, rtol=1e-5)
            partials.append(grouped)
    # Every shard contributes: no rank's experts go unused on 23 tokens x 2 slots.
    assert all(p.abs().sum() > 0 for p in partials)
    torch.testing.assert_close(torch.stack(partials).sum(dim=0), whole, atol=1e-5, rtol=1e-5)


def test_expert_range_splits_evenly_and_in_order() -> None:
    assert [expert_range(8, r, 4) for r in range(4)] == [range(0, 2), range(2, 4), range(4, 6), range(6, 8)]
    assert expert_range(8, 0, 1) == range(8)


def test_expert_range_refuses_an_uneven_split_and_says_what_fits() -> None:
    with pytest.raises(ConfigError, match=r"does not divide the model's 8 experts: set it to one of \[1, 2, 4, 8\]"):
        expert_range(8, 0, 3)
    with pytest.raises(ConfigError, match="ep_rank"):
        expert_range(8, 2, 2)


def _tiny_model(architecture: str) -> CausalLM:
    config = {**PRESETS["mixtral-tiny"], "architectures": [architecture]}
    return CausalLM(ModelArchConfig.from_hf_dict(config))


def test_shard_experts_refuses_a_dense_model() -> None:
    with pytest.raises(ConfigError, match="needs a MoE model"):
        shard_experts(_tiny_model("LlamaForCausalLM"), 0, 2)


def test_shard_experts_refuses_an_uneven_split_before_touching_the_model() -> None:
    model = _tiny_model("MixtralForCausalLM")
    with pytest.raises(ConfigError, match="expert_parallel_size 3 does not divide the model's 8 experts"):
        shard_experts(model, 0, 3)
    assert all(block.num_local_experts == 8 for block in moe_blocks(model))


def test_top_k_above_num_experts_is_a_load_error() -> None:
    config = {**PRESETS["mixtral-tiny"], "num_experts_per_tok": 9}
    with pytest.raises(ModelLoadError, match=r"num_experts_per_tok \(9\) must be in 1..num_local_experts \(8\)"):
        ModelArchConfig.from_hf_dict(config)
