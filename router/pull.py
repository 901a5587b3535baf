"""Cross-instance KV reuse at the router: which instance to pull a prompt's prefix from,
whether that beats computing it, and the `PushCached` call. The lifecycle of a pull, both
ends included, is in engine/kv_pull.py; the user's view in docs/kv_tiers.md.

`plan_pull` is pure: given what the prefix index says each instance holds, the target's
reservation and the cost model, it names the holder and the blocks, or None. `Puller` is
the thin shell: the index lookup, the call, and a failure that only ever means "pull
nothing" (the target then computes those tokens, as it would have without the pull).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass

import grpc

from vllm_cluster.engine.block_hash import hash_block_tokens
from vllm_cluster.kv_index import PrefixIndex, TierOverlap
from vllm_cluster.proto import cluster_pb2 as pb
from vllm_cluster.proto import cluster_pb2_grpc as pb_grpc
from vllm_cluster.router.registry import Instance, Registry

logger = logging.getLogger(__name__)

_ITEM_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "float8_e4m3fn": 1, "float8_e5m2": 1}


@dataclass(frozen=True, slots=True)
class PullCost:
    """What a pull and a recompute cost, per block: from the config (or measured)."""

    link_bytes_per_s: float  # KV transport bandwidth between two instances
    recompute_tokens_per_s: float  # prompt tokens per second a target computes
    setup_s: float  # fixed cost of one pull: the RPCs, the handshake, the wait


@dataclass(frozen=True, slots=True)
class PullPlan:
    holder_id: str  # prefix-index id of the instance to pull from
    num_skip_blocks: int  # leading prompt blocks the target already holds
    num_blocks: int  # blocks to pull, right after those


def block_bytes(layout: pb.Reservation) -> int:
    """One block's KV over every layer, from the reservation's layout."""
    kv = layout.layout
    entries = 1 if kv.layout.startswith("NB,1,") else 2  # an MLA latent entry, or K and V
    return kv.num_layers * entries * kv.block_size * kv.num_kv_heads * kv.head_dim * _ITEM_BYTES.get(kv.dtype, 4)


def pull_is_cheaper(num_blocks: int, num_block_bytes: int, block_size: int, cost: PullCost) -> bool:
    """Moving `num_blocks` blocks beats computing their tokens on the target."""
    if num_blocks <= 0:
        return False
    pull_s = cost.setup_s + num_blocks * num_block_bytes / cost.link_bytes_per_s
    recompute_s = num_blocks * block_size / cost.recompute_tokens_per_s
    return pull_s < recompute_s


def plan_pull(
    overlap: Mapping[str, TierOverlap],
    target_id: str,
    holder_ids: set[str],
    num_prompt_tokens: int,
    block_size: int,
    num_target_cached_tokens: int,
    num_block_bytes: int,
    cost: PullCost,
) -> PullPlan | None:
    """The holder among `holder_ids` (reachable, healthy) with the most device blocks of the
    prompt past what the target holds, if pulling them is cheaper; None otherwise. The last
    prompt token is always left to compute: its logits give the first output token."""
    num_skip = num_target_cached_tokens // block_size
    max_blocks = (num_prompt_tokens - 1) // block_size
    best: PullPlan | None = None
    for holder_id in sorted(holder_ids - {target_id}):  # sorted: ties go the same way every time
        num_held = min(overlap.get(holder_id, TierOverlap()).num_device, max_blocks)
        if num_held > num_skip and (best is None or num_held - num_skip > best.num_blocks):
            best = PullPlan(holder_id, num_skip, num_held - num_skip)
    if best is None or not pull_is_cheaper(best.num_blocks, num_block_bytes, block_size, cost):
        return None
    return best


class Puller:
    def __init__(
        self, registry: Registry, prefix_index: PrefixIndex | None, block_size: int, cost: PullCost, timeout_s: float
    ) -> None:
        self._registry = registry
        self._prefix_index = prefix_index
        self._block_size = block_size
        self._cost = cost
        self._timeout_s = timeout_s

    def pull(
        self, request: pb.WorkerRequest, target: Instance, reservation: pb.Reservation,
        overlap: Mapping[str, TierOverlap],
    ) -> int:
        """Have the best holder push the prompt's prefix into `reservation`; the number of
        blocks that landed after the target's cached ones (0: none, the target computes them)."""
        if self._prefix_index is None:
            return 0
        hashes = [bytes(h) for h in hash_block_tokens(
            list(request.prompt_token_ids), self._block_size, tuple(request.extra_keys))]
        if not hashes:
            return 0
        overlap = overlap or self._prefix_index.tier_overlap(hashes)
        holders = {i.index_id: i for i in self._registry.instances.values() if i.healthy}
        plan = plan_pull(overlap, target.index_id, set(holders), len(request.prompt_token_ids), self._block_size,
                         reservation.num_cached_tokens, block_bytes(reservation), self._cost)
        if plan is None:
            return 0
        holder = holders[plan.holder_id]
        asked = pb.PushCachedRequest(
            block_hashes=hashes[plan.num_skip_blocks : plan.num_skip_blocks + plan.num_blocks],
            reservation=reservation, num_skip_blocks=plan.num_skip_blocks, timeout_s=self._timeout_s,
        )
        try:
            reply = pb_grpc.KVPullStub(holder.channel).PushCached(asked, timeout=self._timeout_s + 1.0)
        except grpc.RpcError as e:
            logger.warning("%s: pull from %s failed (%s %s); computing those tokens instead",
                           request.request_id, holder.name, e.code().name, e.details())
            return 0
        if reply.error:
            logger.warning("%s: pull from %s pushed %d of %d blocks (%s)", request.request_id, holder.name,
                           reply.num_blocks_pushed, plan.num_blocks, reply.error)
        return min(reply.num_blocks_pushed, plan.num_blocks)
