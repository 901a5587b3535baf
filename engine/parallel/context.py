"""One rank's view of the parallel engine: its place in the grid and its process groups.

Groups (every rank builds them in this order, so the rendezvous cannot deadlock):
  control  gloo over all ranks, no timeout: the driver's step messages.
  world    the device's backend (NCCL / gloo) over all ranks: weights at start, hidden
           states between pipeline stages.
  tp       the device's backend over this stage's ranks (tp > 1 only): the all-reduces
           and the logits gather.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass

import torch
import torch.distributed as dist

from vllm_cluster.engine.layers.attention import kv_scales
from vllm_cluster.engine.models import CausalLM
from vllm_cluster.engine.parallel.expert import shard_experts
from vllm_cluster.engine.parallel.groups import FOREVER, Group, backend_for, make_group
from vllm_cluster.engine.parallel.pipeline import apply_pp
from vllm_cluster.engine.parallel.tensor import apply_tp
from vllm_cluster.engine.parallel.topology import Placement, Topology


@dataclass(slots=True)
class ParallelContext:
    topology: Topology
    place: Placement
    device: torch.device
    control: Group
    world: Group
    tp: Group | None

    @classmethod
    def create(
        cls,
        store: dist.Store,
        topology: Topology,
        rank: int,
        device: torch.device,
        timeout: datetime.timedelta,
        host: str,
    ) -> ParallelContext:
        place = topology.place(rank)
        backend = backend_for(device)
        everyone = list(range(topology.world_size))
        control = make_group(store, "control", everyone, rank, "gloo", FOREVER, host)
        world = make_group(store, "world", everyone, rank, backend, timeout, host)
        tp = None
        if topology.tensor_parallel_size > 1:
            stage_ranks = topology.stage_ranks(place.stage)
            tp = make_group(store, f"tp{place.stage}", stage_ranks, rank, backend, timeout, host)
        return cls(topology, place, device, control, world, tp)

    @property
    def is_driver(self) -> bool:
        return self.place.rank == 0

    @property
    def previous_stage_rank(self) -> int:
        return self.topology.rank_of(self.place.stage - 1, self.place.tp_rank)

    @property
    def next_stage_rank(self) -> int:
        return self.topology.rank_of(self.place.stage + 1, self.place.tp_rank)

    def broadcast_weights(self, model: CausalLM) -> None:
        """Rank 0's parameters and KV cache scales into every rank's (same architecture, same
        order), as bytes."""
        for param in model.parameters():
            self.world.broadcast_(param.data.view(torch.uint8), src=0)
        for scale in kv_scales(model):  # [1] fp32 each
            self.world.broadcast_(scale.view(torch.uint8), src=0)

    def shard(self, model: CausalLM) -> None:
        """Cut the full model down to this rank's share, in place. With expert parallelism
        the stage's tp ranks are also its expert-parallel ranks: each keeps 1/tp of every
        MoE layer's experts (apply_tp leaves MoE blocks whole)."""
        apply_pp(model, self.place)
        if self.tp is not None:
            apply_tp(model, self.tp)
            if self.topology.enable_expert_parallel:
                shard_experts(model, self.tp.rank_in_group, self.tp.size, self.tp.pg)

    def abort(self) -> None:
        """Fail the device groups' operations in flight (NCCL would wait on a dead peer)."""
        for group in (self.world, self.tp):
            if group is not None and group.backend == "nccl":
                group.abort()
