"""KV cache transfer between prefill and decode engines: protocols and backends.

Backends: "ucx" (ucxx), "nccl" (torch.distributed point-to-point; gloo on CPU caches),
"cuda_ipc" (processes on one GPU node: the sender writes into the receiver's mapped cache),
"local" (in-process, for tests). The ucx and nccl backends are imported on first use, so
a process that only uses one of them never loads the other's library.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import torch

from vllm_cluster.kv_transfer.base import (
    KVLayout,
    KVLayoutMismatch,
    KVReceiver,
    KVSender,
    KVTransferError,
    TransferStatus,
)
from vllm_cluster.kv_transfer.local import LocalReceiver, LocalSender

__all__ = [
    "BACKENDS",
    "KVLayout",
    "KVLayoutMismatch",
    "KVReceiver",
    "KVSender",
    "KVTransferError",
    "LocalReceiver",
    "LocalSender",
    "TransferStatus",
    "make_receiver",
    "make_sender",
]

BACKENDS = ("ucx", "nccl", "cuda_ipc", "local")

_local_names = itertools.count()


def backend_of(endpoint_or_backend: str) -> str:
    """The backend named by "ucx" or by "ucx://HOST:PORT"; raises ValueError if unknown."""
    backend = endpoint_or_backend.partition("://")[0]
    if backend not in BACKENDS:
        raise ValueError(
            f"unknown KV transfer backend {endpoint_or_backend!r}; use one of {', '.join(BACKENDS)}"
        )
    return backend


def make_receiver(
    backend: str,
    kv_caches: Sequence[torch.Tensor],
    layout: KVLayout,
    host: str = "127.0.0.1",
    port: int = 0,
    cluster_token: str = "",
) -> KVReceiver:
    """A receiver for `backend`, listening on host:port (port 0: any free port; see its
    `endpoint`). A local receiver takes a fresh name instead. With a `cluster_token`, KV is
    accepted only from senders carrying the same token."""
    backend = backend_of(backend)
    if backend == "ucx":
        from vllm_cluster.kv_transfer.ucx import UcxReceiver

        return UcxReceiver(kv_caches, layout, host, port, cluster_token)
    if backend == "nccl":
        from vllm_cluster.kv_transfer.torch_dist import TorchDistReceiver

        return TorchDistReceiver(kv_caches, layout, host, port, cluster_token)
    if backend == "cuda_ipc":
        from vllm_cluster.kv_transfer.cuda_ipc import CudaIpcReceiver

        return CudaIpcReceiver(kv_caches, layout, host, port, cluster_token)
    return LocalReceiver(kv_caches, layout, f"receiver-{next(_local_names)}", cluster_token)


def make_sender(
    endpoint_or_backend: str,
    kv_caches: Sequence[torch.Tensor],
    layout: KVLayout,
    sender_id: str,
    cluster_token: str = "",
    host: str = "127.0.0.1",
) -> KVSender:
    """A sender for a backend, named directly ("ucx") or by an endpoint ("ucx://HOST:PORT").
    `host`: this process's KV address, where the ucx backend's UCX listens for receivers'
    endpoints and the nccl backend's gloo sockets bind (cuda_ipc and local use none)."""
    backend = backend_of(endpoint_or_backend)
    if backend == "ucx":
        from vllm_cluster.kv_transfer.ucx import UcxSender

        return UcxSender(kv_caches, layout, sender_id, cluster_token, host)
    if backend == "nccl":
        from vllm_cluster.kv_transfer.torch_dist import TorchDistSender

        return TorchDistSender(kv_caches, layout, sender_id, cluster_token, host)
    if backend == "cuda_ipc":
        from vllm_cluster.kv_transfer.cuda_ipc import CudaIpcSender

        return CudaIpcSender(kv_caches, layout, sender_id, cluster_token)
    return LocalSender(kv_caches, layout, sender_id, cluster_token)
