"""Expert parallelism, applied to a built MoE model from outside (the model files have no
distributed code). Every MoE family keeps its routed experts in a `SparseMoeBlock`
(Mixtral's block itself; Qwen2-MoE and Qwen3-MoE wrap one: engine/models/qwen_moe.py), and
that block is what is sharded; a Qwen2-MoE shared expert is an ordinary MLP beside it.

Over ep_size ranks, each running the same model on the same batch:
  1. `shard_experts` keeps, in every MoE layer, only this rank's num_experts / ep_size
     experts (rank r holds the contiguous global ids r*n .. r*n+n-1) and hooks an
     all-reduce onto the layer's output.
  2. Every rank runs the (replicated) router on every token, so all ranks route alike.
  3. Each rank computes the weighted outputs of its own experts for the tokens routed to
     them; slots routed to other ranks' experts contribute zero.
  4. The all-reduce sums the partial outputs: every rank then holds the full MoE output,
     identical on every rank, and the next layer proceeds as in one process.

Everything else (attention, norms, embeddings, lm_head) is left as it is: replicated, with
each rank computing it in full, or tensor-parallel over the same ranks by
engine/parallel/tensor.py's `apply_tp` (which leaves MoE blocks alone). Either way every
rank's MoE block sees the full hidden states of the whole batch, so the scheme is the same.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from vllm_cluster.engine.errors import ConfigError
from vllm_cluster.engine.models.mixtral import SparseMoeBlock


def expert_range(num_experts: int, ep_rank: int, ep_size: int) -> range:
    """The global expert ids rank `ep_rank` of `ep_size` holds."""
    if ep_size < 1 or not 0 <= ep_rank < ep_size:
        raise ConfigError(f"ep_rank {ep_rank} must be in 0..ep_size-1 with ep_size >= 1 (ep_size is {ep_size})")
    if num_experts % ep_size:
        divisors = [d for d in range(1, num_experts + 1) if num_experts % d == 0]
        raise ConfigError(
            f"expert_parallel_size {ep_size} does not divide the model's {num_experts} experts: "
            f"set it to one of {divisors}"
        )
    num_local = num_experts // ep_size
    return range(ep_rank * num_local, (ep_rank + 1) * num_local)


def moe_blocks(model: nn.Module) -> list[SparseMoeBlock]:
    return [m for m in model.modules() if isinstance(m, SparseMoeBlock)]


def shard_experts(
    model: nn.Module, ep_rank: int, ep_size: int, group: dist.ProcessGroup | None = None
) -> None:
    """Keep this rank's experts in every MoE layer and sum the layer outputs over `group`,
    which must hold exactly the ep_size ranks, in ep_rank order: a process group of its
    own (engine/parallel/groups.py's `Group.pg`), or None for the default group."""
    blocks = moe_blocks(model)
    if not blocks:
        raise ConfigError("expert parallelism needs a MoE model (e.g. MixtralForCausalLM); this one has no experts")
    ranges = [expert_range(block.num_experts, ep_rank, ep_size) for block in blocks]
    pg = group if group is not None or ep_size == 1 else dist.group.WORLD
    if ep_size > 1:
        assert pg is not None, "no process group given and no default group initialised"
        if pg.size() != ep_size or pg.rank() != ep_rank:
            raise ConfigError(
                f"the process group has {pg.size()} ranks (this is {pg.rank()}) but ep_size is {ep_size} "
                f"(ep_rank {ep_rank}): pass the group of exactly the expert-parallel ranks"
            )
    for block, experts in zip(blocks, ranges, strict=True):
        block.keep_experts(experts.start, len(experts))
        if pg is not None and ep_size > 1:
            block.register_forward_hook(_all_reduce_hook(pg))


def _all_reduce_hook(pg: dist.ProcessGroup) -> Any:
    def hook(_module: nn.Module, _inputs: Any, output: torch.Tensor) -> torch.Tensor:
        # output: [T, D], summed in place (the backend's own call: the group need not be
        # registered with torch.distributed's default world).
        pg.allreduce([output]).wait()
        return output

    return hook
