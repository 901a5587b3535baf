"""The router's view of LoRA adapters: which names a request's `model` may take, and the
load/unload fan-out to every instance (vLLM's /v1/load_lora_adapter, /v1/unload_lora_adapter).

Known adapters: those the instances report in Stats (loaded from their config at
start-up, or by an earlier load) and those loaded through this router, which count at
once, before the next Stats poll. A load reaches every healthy instance, prefill and
decode alike, so any of them can serve a request under it.
"""

from __future__ import annotations

import threading

import grpc

from vllm_cluster.proto import cluster_pb2 as pb
from vllm_cluster.router.registry import Registry

_TIMEOUT_S = 60.0


class LoRAAdapterCallError(Exception):
    """A load/unload that failed on some instance: the gRPC code and vLLM-style message."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code


class LoRAAdapters:
    def __init__(self, registry: Registry) -> None:
        self._registry = registry
        self._lock = threading.Lock()
        self._loaded: set[str] = set()  # through this router
        self._unloaded: set[str] = set()  # through this router, maybe still in stale Stats

    def known(self) -> set[str]:
        with self._lock:
            return (self._registry.lora_names() - self._unloaded) | self._loaded

    def load(self, name: str, path: str) -> None:
        if not name or not path:
            raise LoRAAdapterCallError(
                grpc.StatusCode.INVALID_ARGUMENT, "Both 'lora_name' and 'lora_path' must be provided."
            )
        if name in self.known():
            raise LoRAAdapterCallError(
                grpc.StatusCode.INVALID_ARGUMENT, f"The lora adapter '{name}' has already been loaded."
            )
        self._fan_out("LoadLoRAAdapter", pb.LoRAAdapterRequest(lora_name=name, lora_path=path))
        with self._lock:
            self._loaded.add(name)
            self._unloaded.discard(name)

    def unload(self, name: str) -> None:
        if name not in self.known():
            raise LoRAAdapterCallError(grpc.StatusCode.NOT_FOUND, f"The lora adapter '{name}' cannot be found.")
        self._fan_out("UnloadLoRAAdapter", pb.LoRAAdapterRequest(lora_name=name))
        with self._lock:
            self._loaded.discard(name)
            self._unloaded.add(name)

    def _fan_out(self, method: str, msg: pb.LoRAAdapterRequest) -> None:
        instances = [i for i in self._registry.instances.values() if i.healthy]
        if not instances:
            raise LoRAAdapterCallError(grpc.StatusCode.UNAVAILABLE, "no healthy instance to load the adapter on")
        for instance in instances:
            try:
                getattr(instance.stub, method)(msg, timeout=_TIMEOUT_S)
            except grpc.RpcError as e:
                raise LoRAAdapterCallError(e.code(), f"{instance.name}: {e.details()}") from e
