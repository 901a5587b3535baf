"""torch.distributed pieces under kv_transfer/torch_dist.py: the pairwise process group
(NCCL on CUDA caches, gloo on CPU), waiting for a point-to-point op, and the store queue
that carries header frames."""

from __future__ import annotations

import datetime
import socket
from typing import Any

import torch
import torch.distributed as dist

OP_TIMEOUT = datetime.timedelta(seconds=60)  # one payload, once its header has arrived


def pair_group(store: dist.Store, rank: int, device: torch.device, address: str) -> Any:
    """The 2-rank group of one sender (rank 1) and one receiver (rank 0)."""
    if device.type == "cuda":
        torch.cuda.set_device(device)  # this thread's NCCL communicator lives on the cache's GPU
        nccl = dist.ProcessGroupNCCL  # present in CUDA builds only
        options = nccl.Options()
        options._timeout = OP_TIMEOUT
        return nccl(store, rank, 2, options)
    options = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]
    options._devices = [dist.ProcessGroupGloo.create_device(hostname=address)]
    options._timeout = OP_TIMEOUT
    return dist.ProcessGroupGloo(store, rank, 2, options)


def wait_done(work: Any, data: torch.Tensor) -> None:
    """Wait for a send (its buffer is reusable) or a receive (its bytes have landed)."""
    work.wait()
    if data.is_cuda:  # NCCL's wait only orders the current stream against its own
        torch.cuda.current_stream(data.device).synchronize()


def pop(store: dist.Store, key: str) -> bytes:
    """Block until `key`'s queue has a message; b"" means: stop serving this peer."""
    while True:
        try:
            return bytes(store.queue_pop(key))
        except dist.DistStoreError as e:
            if "timeout" not in str(e):
                raise


def local_address_towards(host: str, port: int) -> str:
    """The address of this machine's interface that routes to host (no packet is sent)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect((host, port))
        return str(probe.getsockname()[0])
