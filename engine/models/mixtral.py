"""Mixtral-style sparse MoE: the Llama decoder of engine/models/llama.py (same attention,
norms and rotary) with each MLP replaced by a `SparseMoeBlock`: a router, then top-k of
`num_experts` SwiGLU experts per token, their outputs weighted and summed.

Routing follows HF Mixtral: softmax over the router logits in fp32, top-k, renormalised
to sum to one (Qwen's MoE blocks, engine/models/qwen_moe.py, reuse this block and
renormalise only with norm_topk_prob). Experts are stored stacked in a `StackedExperts`
(`w13_weight` [E, 2I, D] = [w1 | w3] per expert, `w2_weight` [E, D, I]), so a rank of expert
parallelism keeps a contiguous slice of them (`keep_experts`) and the block then returns only
its own experts' share of the output: the sum over ranks is the full output
(engine/parallel/expert.py adds the all-reduce). The block multiplies by its experts only
through the `ExpertStack` methods, so the int8 and fp8 methods put a quantized stack in its
place from outside (engine/quantization/experts.py). No distributed or quantization code here.
"""

from __future__ import annotations

import re
from typing import Protocol

import torch
from torch import nn
from torch.nn import functional as F

from vllm_cluster.kernels.elementwise.dispatch import silu_and_mul

# (expert, part): part 0/1 is w1 (gate) / w3 (up) inside w13_weight; w2_weight has part 0.
ExpertShard = tuple[int, int]

# On a GPU, up to this many tokens run every local expert on every token (forward_dense):
# reading all expert weights dominates there anyway, and the grouped path's host sync and
# per-expert launches cost more. H200, one Mixtral 8x7B layer in bf16, dense vs grouped
# over three runs: 0.70 vs 0.87-0.94 ms at 8 tokens, 0.72 vs 1.1-1.6 ms at 32, 1.1 vs
# 1.1-1.6 ms at 256, 8.9 vs 2.7 ms at 2048 (at 1 token grouped reads only 2 experts:
# 0.48-0.86 vs 0.70 ms); `python benchmarks/bench_moe_gpu.py`.
DENSE_MAX_TOKENS_CUDA = 256

_HF_EXPERT = re.compile(r"\.block_sparse_moe\.experts\.(\d+)\.(w1|w2|w3)\.weight$")


def route(router_logits: torch.Tensor, top_k: int, renormalize: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """router_logits [T, E] -> (weights [T, K] fp32, expert_ids [T, K]): the top-k softmax
    probabilities, renormalised to sum to 1 per token (Mixtral; Qwen's norm_topk_prob) or not."""
    probs = torch.softmax(router_logits.float(), dim=-1)
    weights, expert_ids = torch.topk(probs, top_k, dim=-1)
    return (weights / weights.sum(dim=-1, keepdim=True) if renormalize else weights), expert_ids


class ExpertStack(Protocol):
    """A MoE layer's local experts and the four products the block takes of them."""

    @property
    def num_experts(self) -> int: ...

    def keep(self, start: int, count: int) -> None:
        """Drop every expert but local ids start..start+count-1, freeing the rest."""
        ...

    def gate_up(self, x: torch.Tensor, expert: int) -> torch.Tensor:
        """x [n, D] -> [n, 2I] = [gate | up] of local expert `expert`."""
        ...

    def down(self, h: torch.Tensor, expert: int) -> torch.Tensor:
        """h [n, I] -> [n, D] of local expert `expert`."""
        ...

    def gate_up_all(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, D] -> [E, T, 2I]: every local expert on every token."""
        ...

    def down_all(self, h: torch.Tensor) -> torch.Tensor:
        """h [E, T, I] -> [E, T, D]: each local expert on its own rows."""
        ...


class StackedExperts(nn.Module):
    """The unquantized `ExpertStack`: w13_weight [E, 2I, D] = [w1 | w3] per expert, w2_weight
    [E, D, I], in the model's dtype (the checkpoint's tensors load into them)."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.w13_weight = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size, hidden_size))
        self.w2_weight = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size))

    @property
    def num_experts(self) -> int:
        return self.w13_weight.shape[0]

    def keep(self, start: int, count: int) -> None:
        # Copied, so that the dropped experts are freed.
        self.w13_weight = nn.Parameter(self.w13_weight.data[start : start + count].clone(), requires_grad=False)
        self.w2_weight = nn.Parameter(self.w2_weight.data[start : start + count].clone(), requires_grad=False)

    def gate_up(self, x: torch.Tensor, expert: int) -> torch.Tensor:
        return F.linear(x, self.w13_weight[expert])

    def down(self, h: torch.Tensor, expert: int) -> torch.Tensor:
        return F.linear(h, self.w2_weight[expert])

    def gate_up_all(self, x: torch.Tensor) -> torch.Tensor:
        return torch.matmul(x, self.w13_weight.transpose(1, 2))

    def down_all(self, h: torch.Tensor) -> torch.Tensor:
        return torch.matmul(h, self.w2_weight.transpose(1, 2))


class SparseMoeBlock(nn.Module):
    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        num_experts: int,
        top_k: int,
        renormalize: bool = True,
        router: nn.Module | None = None,
    ) -> None:
        """`router`: a module mapping fp32 router logits [T, E] to (weights, expert_ids),
        in place of `route` (DeepSeek's grouped top-k: engine/models/deepseek.py)."""
        super().__init__()
        assert 0 < top_k <= num_experts, f"top_k {top_k} must be in 1..num_experts ({num_experts})"
        self.num_experts = num_experts
        self.top_k = top_k
        self.renormalize = renormalize
        self.intermediate_size = intermediate_size
        self.expert_start = 0  # global id of the stack's expert 0; >0 on later expert-parallel ranks
        self.gate = nn.Linear(hidden_size, num_experts, bias=False)
        self.router = router
        self.stack: ExpertStack = StackedExperts(num_experts, hidden_size, intermediate_size)

    @property
    def num_local_experts(self) -> int:
        return self.stack.num_experts

    def keep_experts(self, start: int, count: int) -> None:
        """Drop every expert but global ids start..start+count-1 (the rest is freed)."""
        assert start >= 0 and start + count <= self.num_experts, (start, count, self.num_experts)
        assert self.expert_start == 0 and self.num_local_experts == self.num_experts, "already sharded"
        self.stack.keep(start, count)
        self.expert_start = start

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [T, D] -> the local experts' weighted outputs summed per token, [T, D]."""
        weights, expert_ids = self.select_experts(x)  # [T, K] each
        if x.is_cuda and (x.shape[0] <= DENSE_MAX_TOKENS_CUDA or torch.cuda.is_current_stream_capturing()):
            return self.forward_dense(x, weights, expert_ids)
        return self.forward_grouped(x, weights, expert_ids)

    def select_experts(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x: [T, D] -> (weights [T, K] fp32, expert_ids [T, K] global ids): the routing."""
        if self.router is None:
            return route(self.gate(x), self.top_k, self.renormalize)
        weights, expert_ids = self.router(F.linear(x.float(), self.gate.weight.float()))
        return weights, expert_ids

    def forward_grouped(self, x: torch.Tensor, weights: torch.Tensor, expert_ids: torch.Tensor) -> torch.Tensor:
        """Each local expert runs once, on exactly the tokens routed to it: the (token, k)
        slots are sorted by expert id, so each expert's rows are one contiguous slice. Costs
        one host sync per layer (the slice bounds), so it cannot be captured in a CUDA graph."""
        num_tokens, top_k = expert_ids.shape
        flat_ids = expert_ids.flatten()  # [T*K]
        order = flat_ids.argsort(stable=True)  # [T*K] slots grouped by expert
        counts = torch.bincount(flat_ids, minlength=self.num_experts)
        bounds = [0, *counts.cumsum(0).tolist()]  # slots of expert e: bounds[e]:bounds[e+1]
        first, end = self.expert_start, self.expert_start + self.num_local_experts
        local_slots = order[bounds[first] : bounds[end]]  # [S] this rank's slots
        x_local = x[local_slots // top_k]  # [S, D]
        y_local = torch.empty_like(x_local)
        for e in range(self.num_local_experts):
            lo, hi = bounds[first + e] - bounds[first], bounds[first + e + 1] - bounds[first]
            if lo < hi:
                h = silu_and_mul(self.stack.gate_up(x_local[lo:hi], e))  # [n, I]
                y_local[lo:hi] = self.stack.down(h, e)
        y = x.new_zeros(num_tokens * top_k, x.shape[-1])  # other ranks' slots stay zero
        y[local_slots] = y_local
        # Sum over k in a fixed order (no atomics): the same result every run.
        combine = weights.to(x.dtype).unsqueeze(1)  # [T, 1, K]
        return torch.bmm(combine, y.view(num_tokens, top_k, -1)).squeeze(1)

    def forward_dense(self, x: torch.Tensor, weights: torch.Tensor, expert_ids: torch.Tensor) -> torch.Tensor:
        """Every local expert on every token, weighted by its routing weight (0 where not
        chosen). No host sync, so a CUDA graph captures it; decode batches are small and
        read every expert's weights anyway, so the extra FLOPs cost little there."""
        num_local = self.num_local_experts
        local_ids = expert_ids - self.expert_start  # [T, K]
        is_local = (local_ids >= 0) & (local_ids < num_local)
        # The extra last column collects other ranks' experts and is dropped.
        combine = x.new_zeros(x.shape[0], num_local + 1)
        combine.scatter_(1, torch.where(is_local, local_ids, num_local), weights.to(x.dtype))
        h = silu_and_mul(self.stack.gate_up_all(x))  # [E, T, I]
        y = self.stack.down_all(h)  # [E, T, D]
        return torch.einsum("te,etd->td", combine[:, :num_local], y)


def hf_target(name: str) -> tuple[str, ExpertShard | None] | None:
    """An HF Mixtral checkpoint name -> (our parameter, expert shard); None if not MoE.

    `...block_sparse_moe.gate.weight` is the router; `...block_sparse_moe.experts.{e}.w1/w3`
    fill rows of `mlp.stack.w13_weight[e]`, `w2` fills `mlp.stack.w2_weight[e]`."""
    match = _HF_EXPERT.search(name)
    if match is not None:
        prefix, expert, part = name[: match.start()] + ".mlp.stack.", int(match[1]), match[2]
        if part == "w2":
            return prefix + "w2_weight", (expert, 0)
        return prefix + "w13_weight", (expert, 0 if part == "w1" else 1)
    if ".block_sparse_moe.gate." in name:
        return name.replace(".block_sparse_moe.", ".mlp."), None
    return None


def expert_slice(target: str, data: torch.Tensor, shard: ExpertShard) -> torch.Tensor:
    """The view of stacked expert weights `data` that one HF expert tensor fills."""
    expert, part = shard
    if target.endswith(".w2_weight"):
        return data[expert]
    intermediate_size = data.shape[1] // 2  # w13_weight: [E, 2I, D]
    return data[expert].narrow(0, part * intermediate_size, intermediate_size)


def expected_expert_shards(name: str, param: torch.Tensor) -> set[str] | None:
    """The `{name}:{shard}` keys that loading fills for a stacked expert parameter."""
    if name.endswith(".w13_weight"):
        return {f"{name}:{(e, p)}" for e in range(param.shape[0]) for p in (0, 1)}
    if name.endswith(".w2_weight"):
        return {f"{name}:{(e, 0)}" for e in range(param.shape[0])}
    return None
