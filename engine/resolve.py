"""What an engine config resolves to on this machine: the device, the dtype, the KV cache's
dtype, the context length it serves, the memory its KV cache may take, whether steps run
ahead (async)."""

from __future__ import annotations

import os

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


def available_memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free)
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return (os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")) // 2
