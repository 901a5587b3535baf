"""Start-up: what an EngineConfig becomes on this machine before the engine's first step.

In order: the device and dtypes (engine/resolve.py), the checkpoint and its architecture,
the checks that need them (quantization and expert parallelism against the split, the
context length against the token budget), the model on an Executor (one process, or the
parallel ranks started and the weights sent), and the number of KV blocks that fit. A
config that cannot run raises ConfigError saying what to change, and leaves no rank running.
The KV cache itself is allocated later (`Executor.init_kv_cache`), once LoRA has wrapped
the model.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vllm_cluster.engine.config import EngineConfig, EngineRole
from vllm_cluster.engine.errors import ConfigError
from vllm_cluster.engine.executor import Executor, LocalExecutor
from vllm_cluster.engine.layers.attention import sliding_window_of_every_layer
from vllm_cluster.engine.loader import ModelSource, load_model, resolve
from vllm_cluster.engine.memory import activation_bytes, kv_cache_bytes
from vllm_cluster.engine.models import CausalLM, ModelArchConfig
from vllm_cluster.engine.models.kv_scales import warn_once_if_unscaled
from vllm_cluster.engine.parallel.executor import ParallelExecutor
from vllm_cluster.engine.parallel.topology import check_expert_parallel
from vllm_cluster.engine.quantization.swap import check_quantizable
from vllm_cluster.engine.resolve import (
    max_model_len,
    resolve_device,
    resolve_dtype,
    resolve_kv_cache_dtype,
    use_async_scheduling,
    with_device_defaults,
)


@dataclass(slots=True)
class EngineParts:
    """What the EngineCore is built from."""

    config: EngineConfig  # the one asked for, with the device's defaults filled in
    source: ModelSource
    arch: ModelArchConfig
    device: torch.device
    dtype: torch.dtype
    kv_cache_dtype: torch.dtype
    max_model_len: int
    model: CausalLM  # with tp x pp > 1: rank 0's shard
    executor: Executor  # its KV cache not yet allocated
    num_blocks: int
    async_scheduling: bool
    # Where every layer slides (engine/kv_cache_manager.py), the window past which a colocated
    # engine releases KV blocks; None for a global layer, and for the prefill and decode roles,
    # whose blocks are handed off whole (engine/kv_push.py, Scheduler.reserve).
    kv_release_window: int | None = None


def start_engine(config: EngineConfig, model: CausalLM | None = None) -> EngineParts:
    """`model`: weights already loaded for the same config.model (reused, not copied)."""
    if config.num_threads is not None:
        torch.set_num_threads(config.num_threads)
    device = resolve_device(config.device)
    config = with_device_defaults(config, device)
    dtype = resolve_dtype(config.model.dtype, device)
    kv_cache_dtype = resolve_kv_cache_dtype(config.cache.kv_cache_dtype, dtype)
    source = resolve(config.model)
    arch = model.config if model is not None else ModelArchConfig.from_hf_dict(source.hf_config)
    _check_split(config, source, arch)
    max_len = max_model_len(config, arch.max_position_embeddings)
    if arch.mla is not None and kv_cache_dtype != dtype:
        raise ConfigError(
            f"cache.kv_cache_dtype {config.cache.kv_cache_dtype!r} is not supported for {arch.architecture}: its "
            "multi-head latent attention caches latents in the model's dtype; set kv_cache_dtype to auto"
        )
    _, max_num_batched_tokens = config.scheduler.batch_limits()
    if not config.scheduler.enable_chunked_prefill and max_num_batched_tokens < max_len:
        raise ConfigError(
            f"without chunked prefill, scheduler.max_num_batched_tokens ({max_num_batched_tokens}) "
            f"must be >= max_model_len ({max_len}): raise it, lower max_model_len, or enable chunked prefill"
        )
    executor, model = _start_executor(config, source, dtype, device, model)
    if config.cache.kv_cache_dtype != "auto":
        warn_once_if_unscaled(model.kv_scales_loaded)
    try:
        num_blocks = _num_kv_blocks(config, executor, device, arch, dtype, kv_cache_dtype, max_len)
    except BaseException:
        executor.shutdown()
        raise
    use_async = use_async_scheduling(config, device)
    release_window = None
    if config.role == EngineRole.COLOCATED:
        release_window = sliding_window_of_every_layer(model, arch.num_hidden_layers)
    return EngineParts(
        config, source, arch, device, dtype, kv_cache_dtype, max_len, model, executor, num_blocks, use_async,
        release_window,
    )  # fmt: skip


def _check_split(config: EngineConfig, source: ModelSource, arch: ModelArchConfig) -> None:
    if source.quantization is not None:
        check_quantizable(arch, source.quantization)  # before the weights load
    if source.quantization is not None and config.parallel.world_size > 1:
        raise ConfigError(
            f"the checkpoint is quantized ({source.quantization}), which runs on one process "
            "for now: set tensor_parallel_size and pipeline_parallel_size to 1"
        )
    if config.parallel.enable_expert_parallel:  # refused even where tp = 1 makes it a no-op
        check_expert_parallel(arch, config.parallel.tensor_parallel_size)


def _start_executor(
    config: EngineConfig, source: ModelSource, dtype: torch.dtype, device: torch.device, model: CausalLM | None
) -> tuple[Executor, CausalLM]:
    """tp x pp > 1: rank 0 (this process) keeps its shard; the executor runs the others."""
    if config.parallel.world_size > 1:
        parallel = ParallelExecutor.start(config, source, dtype, device, model)
        assert parallel.model is not None
        return parallel, parallel.model
    if model is None:
        model = load_model(source, dtype, device, config.model.seed)
    graph_batch = 0 if config.enforce_eager else config.scheduler.batch_limits()[0]
    return LocalExecutor(model, device, graph_batch), model


def _num_kv_blocks(
    config: EngineConfig,
    executor: Executor,
    device: torch.device,
    arch: ModelArchConfig,
    dtype: torch.dtype,
    kv_cache_dtype: torch.dtype,
    max_len: int,
) -> int:
    cache = config.cache
    num_blocks = cache.num_blocks
    if num_blocks is None:
        activations = activation_bytes(arch, config.scheduler, dtype.itemsize)
        block_bytes = executor.kv_cache_block_bytes(cache.block_size, kv_cache_dtype)
        cap = None if cache.max_total_tokens is None else -(-cache.max_total_tokens // cache.block_size) * block_bytes
        num_blocks = max(1, kv_cache_bytes(cache, device, activations, cap) // block_bytes)
    elif cache.max_total_tokens is not None:
        num_blocks = min(num_blocks, -(-cache.max_total_tokens // cache.block_size))
    if num_blocks * cache.block_size < max_len:
        knob = (
            "max_total_tokens"
            if cache.max_total_tokens is not None and num_blocks * cache.block_size >= cache.max_total_tokens
            else "num_blocks"
            if cache.num_blocks is not None
            else ("gpu_memory_utilization" if cache.gpu_memory_utilization is not None else "memory_fraction")
        )
        raise ConfigError(
            f"the KV cache holds {num_blocks * cache.block_size} tokens, fewer than max_model_len "
            f"{max_len}: raise cache.{knob} or lower scheduler.max_model_len"
        )
    return num_blocks
