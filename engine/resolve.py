"""What an engine config resolves to on this machine: the device, the sizes it leaves to the
device's defaults, the dtype, the KV cache's dtype, the context length it serves, whether
steps run ahead (async). (The KV cache's memory: engine/memory.py.)"""

from __future__ import annotations

import dataclasses

import torch

from vllm_cluster.engine.config import EngineConfig, EngineRole
from vllm_cluster.engine.errors import ConfigError
from vllm_cluster.kernels.attention.fp8_kv import FP8_KV_DTYPE

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def use_async_scheduling(config: EngineConfig, device: torch.device) -> bool:
    if config.async_scheduling is not None:
        return config.async_scheduling
    # On CPU every op runs when called: nothing to overlap with.
    return device.type == "cuda" and config.role != EngineRole.PREFILL and config.parallel.world_size == 1


# What a config leaves unset (None), per device. CUDA: batch limits at the low end of vLLM's
# for H100-class GPUs (256-1024 sequences, 8192-16384 tokens; on an H200, 512 mixed-length
# requests to llama-3.1-8b ran 1.9x faster at 256 / 8192 than at 64 / 512;
# benchmarks/bench_gpu_defaults.py compares larger limits), and most of the GPU for this
# instance. CPU: a few cores' worth.
@dataclasses.dataclass(frozen=True, slots=True)
class DeviceDefaults:
    max_num_seqs: int
    max_num_batched_tokens: int
    gpu_memory_utilization: float | None = None  # the KV cache's size: exactly one of these two
    memory_fraction: float | None = None


CUDA_DEFAULTS = DeviceDefaults(max_num_seqs=256, max_num_batched_tokens=8192, gpu_memory_utilization=0.9)
CPU_DEFAULTS = DeviceDefaults(max_num_seqs=64, max_num_batched_tokens=512, memory_fraction=0.1)


def with_device_defaults(config: EngineConfig, device: torch.device) -> EngineConfig:
    """`config` with every size it leaves unset filled in for `device`: the same defaults for
    `LLM(...)`, a worker's YAML and a cluster's."""
    on_cuda = device.type == "cuda"
    cache, sched = config.cache, config.scheduler
    if cache.gpu_memory_utilization is not None and not on_cuda:
        raise ConfigError(
            f"cache.gpu_memory_utilization sizes a GPU's KV cache, but this engine runs on {device}: "
            "set cache.memory_fraction or cache.num_blocks instead"
        )
    defaults = CUDA_DEFAULTS if on_cuda else CPU_DEFAULTS
    sched = dataclasses.replace(
        sched,
        max_num_seqs=sched.max_num_seqs or defaults.max_num_seqs,
        max_num_batched_tokens=sched.max_num_batched_tokens or defaults.max_num_batched_tokens,
    )
    if not cache.size_given:
        cache = dataclasses.replace(
            cache, gpu_memory_utilization=defaults.gpu_memory_utilization, memory_fraction=defaults.memory_fraction
        )
    return dataclasses.replace(config, cache=cache, scheduler=sched)


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ConfigError(f"device {name!r} asked for, but no CUDA device is available: use device: cpu")
    return torch.device(name)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        # bf16 matmuls are slow on most CPUs; fp32 there, bf16 on GPUs.
        return torch.float32 if device.type == "cpu" else torch.bfloat16
    return _DTYPES[name]


def resolve_kv_cache_dtype(name: str, model_dtype: torch.dtype) -> torch.dtype:
    """The KV cache's element type: the model's ("auto") or float8_e4m3fn ("fp8", "fp8_e4m3"),
    one byte per element, so the same memory holds twice the blocks of a 16-bit cache."""
    if name == "auto":
        return model_dtype
    assert name in ("fp8", "fp8_e4m3"), f"config validation lets {name!r} through"
    return FP8_KV_DTYPE


def max_model_len(config: EngineConfig, max_position: int) -> int:
    """The context length an engine of `config` serves (the model's, unless set lower)."""
    asked = config.scheduler.max_model_len
    if asked is None:
        return max_position
    if asked > max_position:
        raise ConfigError(
            f"scheduler.max_model_len {asked} exceeds the model's context length {max_position}: lower it"
        )
    return asked
