"""What runs a scheduled step's model for the EngineCore, on one process or many.

Lifecycle (both implementations):
  1. Built around a loaded model; `kv_cache_block_bytes` sizes the KV cache.
  2. `init_kv_cache` allocates it, once (after LoRA has wrapped the model: CUDA graphs
     captured here must see the LoRA kernels).
  3. `execute`, each step: the SchedulerOutput in, the logits of its sampling requests out.
     The step's prefill pushes are fed layer by layer (`StepPushes.push_layer`); sampling
     stays with the caller.
  4. `shutdown` (idempotent).

Implementations: `LocalExecutor` (one process, below) and `ParallelExecutor`
(tensor/pipeline parallel ranks, engine/parallel/executor.py).
"""

from __future__ import annotations

from typing import Protocol

import torch

from vllm_cluster.engine.device_tokens import DeviceTokens
from vllm_cluster.engine.kv_push import StepPushes
from vllm_cluster.engine.model_runner import ModelRunner, kv_cache_block_bytes
from vllm_cluster.engine.models import CausalLM
from vllm_cluster.engine.request import RequestId
from vllm_cluster.engine.scheduler_output import SchedulerOutput


class Executor(Protocol):
    def kv_cache_block_bytes(self, block_size: int, kv_cache_dtype: torch.dtype) -> int:
        """One KV block's bytes (over every layer) on the device holding the most."""

    def init_kv_cache(self, num_blocks: int, block_size: int, max_model_len: int, kv_cache_dtype: torch.dtype) -> None:
        """Allocate the KV cache: `num_blocks` blocks of `block_size` tokens per layer."""

    @property
    def runner(self) -> ModelRunner:
        """This process's model runner: its KV cache (one tensor per layer it runs), block tables."""

    @property
    def transfer_caches(self) -> list[torch.Tensor]:
        """The KV caches a transfer reads (prefill) or writes (decode): every KV head of every layer."""

    def execute(
        self, output: SchedulerOutput, pushes: StepPushes | None = None, prev_tokens: DeviceTokens | None = None
    ) -> tuple[list[RequestId], torch.Tensor]:
        """(ids of the requests that sample, their logits [N, V]). `prev_tokens`: the previous
        step's sampled ids, still on the device (async scheduling)."""

    def kv_landed(self, block_ids: list[int]) -> None:
        """Decode: `transfer_caches` now hold these blocks' KV; make them the cache's."""

    def shutdown(self) -> None: ...


class LocalExecutor:
    """One process runs the whole model: a ModelRunner, which is its own transfer cache."""

    def __init__(self, model: CausalLM, device: torch.device, cuda_graph_max_batch: int) -> None:
        self.model = model
        self.device = device
        self.cuda_graph_max_batch = cuda_graph_max_batch
        self._runner: ModelRunner | None = None

    def kv_cache_block_bytes(self, block_size: int, kv_cache_dtype: torch.dtype) -> int:
        return kv_cache_block_bytes(self.model, block_size, kv_cache_dtype)

    def init_kv_cache(self, num_blocks: int, block_size: int, max_model_len: int, kv_cache_dtype: torch.dtype) -> None:
        assert self._runner is None, "the KV cache is allocated once"
        self._runner = ModelRunner(
            self.model, num_blocks, block_size, max_model_len, self.device, kv_cache_dtype, self.cuda_graph_max_batch
        )

    @property
    def runner(self) -> ModelRunner:
        assert self._runner is not None, "init_kv_cache() first"
        return self._runner

    @property
    def transfer_caches(self) -> list[torch.Tensor]:
        return self.runner.kv_caches

    def execute(
        self, output: SchedulerOutput, pushes: StepPushes | None = None, prev_tokens: DeviceTokens | None = None
    ) -> tuple[list[RequestId], torch.Tensor]:
        return self.runner.execute(output, None if pushes is None else pushes.push_layer, prev_tokens)

    def kv_landed(self, block_ids: list[int]) -> None:
        pass  # the transfer wrote the cache itself

    def shutdown(self) -> None:
        pass
