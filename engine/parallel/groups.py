"""Process groups over a TCPStore: gloo on CPU, NCCL on CUDA, built with the backend
classes directly rather than `init_process_group`, so that several engines (and the
KV-transfer groups) can live in one process without a global default group.

A `Group` knows the global ranks it spans; its methods take and return global ranks.
`Group.pg` is the backend object (ProcessGroupGloo / ProcessGroupNCCL); torch.distributed's
functions take it as `group=` (`dist.all_reduce(t, group=g.pg)`), so code written for
`init_process_group` groups, such as engine/parallel/expert.py, runs on it unchanged.
"""

from __future__ import annotations

import datetime
from typing import Any

import torch
import torch.distributed as dist

# The control group waits for the next step as long as the driver idles; only a peer's
# exit (its sockets close) ends that wait.
FOREVER = datetime.timedelta(days=365)


class Group:
    def __init__(self, pg: Any, ranks: list[int], rank: int, backend: str) -> None:
        self.pg = pg
        self.ranks = ranks  # global ranks, by group rank
        self.rank = rank  # this process's global rank
        self.backend = backend

    @property
    def size(self) -> int:
        return len(self.ranks)

    @property
    def rank_in_group(self) -> int:
        return self.ranks.index(self.rank)

    def all_reduce_(self, tensor: torch.Tensor) -> None:
        """Sum over the group, in place."""
        self.pg.allreduce([tensor]).wait()

    def broadcast_(self, tensor: torch.Tensor, src: int) -> None:
        options = dist.BroadcastOptions()
        options.rootRank = self.ranks.index(src)
        self.pg.broadcast([tensor], options).wait()

    def gather_cat(self, tensor: torch.Tensor, dim: int) -> torch.Tensor | None:
        """Every rank's `tensor` concatenated along `dim` on the group's first rank; None elsewhere."""
        parts = self.gather_list(tensor)
        return torch.cat(parts, dim=dim) if parts is not None else None

    def gather_list(self, tensor: torch.Tensor) -> list[torch.Tensor] | None:
        """Every rank's `tensor` (same shape), by group rank, on the group's first rank; None elsewhere."""
        root = self.rank_in_group == 0
        outputs = [[torch.empty_like(tensor) for _ in self.ranks]] if root else []
        options = dist.GatherOptions()
        options.rootRank = 0
        self.pg.gather(outputs, [tensor], options).wait()
        return outputs[0] if root else None

    def send(self, tensor: torch.Tensor, dst: int) -> Any:
        """Start sending; wait on the returned work before reusing `tensor`."""
        return self.pg.send([tensor], self.ranks.index(dst), 0)

    def recv_(self, tensor: torch.Tensor, src: int) -> None:
        self.pg.recv([tensor], self.ranks.index(src), 0).wait()

    def barrier(self) -> None:
        flag = torch.zeros(1)
        self.pg.allreduce([flag]).wait()

    def abort(self) -> None:
        """Fail every operation in flight (NCCL: a dead peer otherwise hangs them)."""
        self.pg.abort()


def make_group(
    store: dist.Store,
    name: str,
    ranks: list[int],
    rank: int,
    backend: str,
    timeout: datetime.timedelta,
    host: str = "127.0.0.1",
) -> Group:
    """The group of `ranks` (global) named `name`; every member calls this with the same
    name and ranks. `host`: the address this rank's gloo sockets bind to."""
    assert rank in ranks, f"rank {rank} is not in group {name} {ranks}"
    prefixed = dist.PrefixStore(f"group/{name}/", store)
    group_rank, size = ranks.index(rank), len(ranks)
    pg: Any
    if backend == "nccl":
        nccl = dist.ProcessGroupNCCL  # present in CUDA builds only
        nccl_options = nccl.Options()
        nccl_options._timeout = timeout
        pg = nccl(prefixed, group_rank, size, nccl_options)
    else:
        assert backend == "gloo", backend
        options = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]
        options._devices = [dist.ProcessGroupGloo.create_device(hostname=host)]
        options._timeout = timeout
        pg = dist.ProcessGroupGloo(prefixed, group_rank, size, options)
    return Group(pg, list(ranks), rank, backend)


def host_store(host: str, world_size: int, timeout: datetime.timedelta) -> dist.TCPStore:
    """The driver's store, on a free port (`store.port`)."""
    return dist.TCPStore(host, 0, world_size, is_master=True, timeout=timeout, wait_for_workers=False)


def join_store(host: str, port: int, world_size: int, timeout: datetime.timedelta) -> dist.TCPStore:
    return dist.TCPStore(host, port, world_size, is_master=False, timeout=timeout)


def backend_for(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"
