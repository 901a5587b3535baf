"""Cross-instance KV reuse at the router: which instance to pull a prompt's prefix from,
whether that beats computing it, and the `PushCached` call. The lifecycle of a pull, both
ends included, is in engine/kv_pull.py; the user's view in docs/kv_tiers.md.

`plan_pull` is pure: given what the prefix index says each instance holds (in its device
cache, host tier and disk tier), the target's reservation and the cost model, it names the
holder and the blocks, or None. Per block, a pull costs the move over the link plus, for a
block the holder keeps in a tier, the load there (priced as prefix-aware routing prices a
tier hit); a recompute costs the block's tokens at the target's prompt rate. `Puller` is
the thin shell: the index lookup, the call, and a failure that only ever means "pull
nothing" (the target then computes those tokens, as it would have without the pull).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

import grpc

from vllm_cluster.engine.block_hash import hash_block_tokens
from vllm_cluster.kv_index import PrefixIndex, TierOverlap
from vllm_cluster.proto import cluster_pb2 as pb
from vllm_cluster.proto import cluster_pb2_grpc as pb_grpc
from vllm_cluster.router.policy import PrefixWeights
from vllm_cluster.router.registry import Instance, Registry

if TYPE_CHECKING:
    from vllm_cluster.router.pull_cost import MeasuredPullCost

logger = logging.getLogger(__name__)

_ITEM_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "float8_e4m3fn": 1, "float8_e5m2": 1}


@dataclass(frozen=True, slots=True)
class PullCost:
    """What a pull and a recompute cost, per block: from the config (or measured). A block the
    holder keeps in its host or disk tier is first loaded there, at the cost prefix-aware
    routing gives such a load: `1 - weights.host` (`.disk`) of recomputing the block."""

    link_bytes_per_s: float  # KV transport bandwidth between two instances
    recompute_tokens_per_s: float  # prompt tokens per second a target computes
    setup_s: float  # fixed cost of one pull: the RPCs, the handshake, the wait
    weights: PrefixWeights = field(default_factory=PrefixWeights)


@dataclass(frozen=True, slots=True)
class PullPlan:
    holder_id: str  # prefix-index id of the instance to pull from
    num_skip_blocks: int  # leading prompt blocks the target already holds
    num_blocks: int  # blocks to pull, right after those
    num_host_blocks: int = 0  # of which the holder loads from its host tier first
    num_disk_blocks: int = 0  # ... and from its disk tier


def block_bytes(layout: pb.Reservation) -> int:
    """One block's KV over every layer, from the reservation's layout."""
    kv = layout.layout
    entries = 1 if kv.layout.startswith("NB,1,") else 2  # an MLA latent entry, or K and V
    return kv.num_layers * entries * kv.block_size * kv.num_kv_heads * kv.head_dim * _ITEM_BYTES.get(kv.dtype, 4)


def pull_saving_s(
    num_blocks: int, num_block_bytes: int, block_size: int, cost: PullCost, num_host_blocks: int = 0,
    num_disk_blocks: int = 0,
) -> float:
    """Seconds a pull of `num_blocks` blocks (of which `num_host_blocks` and `num_disk_blocks`
    sit in the holder's tiers) saves against computing their tokens on the target; <= 0: none."""
    if num_blocks <= 0:
        return 0.0
    assert num_host_blocks + num_disk_blocks <= num_blocks
    recompute_s = block_size / cost.recompute_tokens_per_s  # per block
    load_s = recompute_s * ((1 - cost.weights.host) * num_host_blocks + (1 - cost.weights.disk) * num_disk_blocks)
    pull_s = cost.setup_s + num_blocks * num_block_bytes / cost.link_bytes_per_s + load_s
    return num_blocks * recompute_s - pull_s


def pull_is_cheaper(num_blocks: int, num_block_bytes: int, block_size: int, cost: PullCost) -> bool:
    """Moving `num_blocks` device-cache blocks beats computing their tokens on the target."""
    return pull_saving_s(num_blocks, num_block_bytes, block_size, cost) > 0


def _blocks_worth_pulling(
    held: TierOverlap, num_skip: int, max_blocks: int, num_block_bytes: int, block_size: int, cost: PullCost
) -> tuple[int, int, int]:
    """(device, host, disk) blocks to pull from a holder past the target's `num_skip`. The
    index gives counts, not positions: the holder's device blocks are taken to lead, then its
    host ones, then disk (blocks leave the device tail-first). A tier whose blocks each cost
    more to load and move than to compute is left out, and so is every slower tier after it."""
    counts: list[int] = []
    start = 0
    for num_tier in (held.num_device, held.num_host, held.num_disk):
        end = min(start + num_tier, max_blocks)
        counts.append(max(0, end - max(start, num_skip)))
        start += num_tier
    no_setup = replace(cost, setup_s=0.0)
    per_block_s = [pull_saving_s(1, num_block_bytes, block_size, no_setup, host, disk)
                   for host, disk in ((0, 0), (1, 0), (0, 1))]
    for tier, saving_s in enumerate(per_block_s):
        if saving_s <= 0:  # the weights order the tiers: every later one saves less still
            counts[tier:] = [0] * (len(counts) - tier)
            break
    device, host, disk = counts
    return device, host, disk


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
    """The holder among `holder_ids` (reachable, healthy) whose blocks of the prompt past what
    the target holds save the most against computing them, device-cache blocks and blocks it
    would load from its host or disk tier first alike; None when no pull saves anything. The
    last prompt token is always left to compute: its logits give the first output token."""
    num_skip = num_target_cached_tokens // block_size
    max_blocks = (num_prompt_tokens - 1) // block_size
    best: PullPlan | None = None
    best_saving_s = 0.0
    for holder_id in sorted(holder_ids - {target_id}):  # sorted: ties go the same way every time
        held = overlap.get(holder_id, TierOverlap())
        device, host, disk = _blocks_worth_pulling(held, num_skip, max_blocks, num_block_bytes, block_size, cost)
        saving_s = pull_saving_s(device + host + disk, num_block_bytes, block_size, cost, host, disk)
        if saving_s > best_saving_s:
            best, best_saving_s = PullPlan(holder_id, num_skip, device + host + disk, host, disk), saving_s
    return best


class Puller:
    def __init__(
        self, registry: Registry, prefix_index: PrefixIndex | None, block_size: int, cost: MeasuredPullCost,
        timeout_s: float,
    ) -> None:
        self._registry = registry
        self._prefix_index = prefix_index
        self._block_size = block_size
        self.cost = cost  # the servicer feeds it the prefill replies' rates
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
        num_block_bytes = block_bytes(reservation)
        plan = plan_pull(overlap, target.index_id, set(holders), len(request.prompt_token_ids), self._block_size,
                         reservation.num_cached_tokens, num_block_bytes, self.cost.current())
        if plan is None:
            return 0
        holder = holders[plan.holder_id]
        asked = pb.PushCachedRequest(
            block_hashes=hashes[plan.num_skip_blocks : plan.num_skip_blocks + plan.num_blocks],
            reservation=reservation, num_skip_blocks=plan.num_skip_blocks, timeout_s=self._timeout_s,
        )
        start = time.monotonic()
        try:
            reply = pb_grpc.KVPullStub(holder.channel).PushCached(asked, timeout=self._timeout_s + 1.0)
        except grpc.RpcError as e:
            logger.warning("%s: pull from %s failed (%s %s); computing those tokens instead",
                           request.request_id, holder.name, e.code().name, e.details())
            return 0
        if reply.error:
            logger.warning("%s: pull from %s pushed %d of %d blocks (%s)", request.request_id, holder.name,
                           reply.num_blocks_pushed, plan.num_blocks, reply.error)
        num_pushed = min(reply.num_blocks_pushed, plan.num_blocks)
        if num_pushed and not reply.error:
            self.cost.observe_pull(num_pushed * num_block_bytes, time.monotonic() - start)
        return num_pushed
