"""The engine core: paged KV cache, continuous batching, chunked prefill, prefix caching.

The public names below load on first use, so that `vllm_cluster.engine.errors` or
`vllm_cluster.engine.config` can be imported (by the router, the CLI) without torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from vllm_cluster.engine.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
    from vllm_cluster.engine.errors import ConfigError, EngineError, InvalidRequestError, ModelLoadError
    from vllm_cluster.engine.llm import LLM
    from vllm_cluster.engine.lora import LoRARequest
    from vllm_cluster.engine.outputs import CompletionOutput, Logprob, RequestOutput
    from vllm_cluster.engine.sampling_params import SamplingParams
    from vllm_cluster.engine.structured_output_params import StructuredOutputsParams

# public name -> the module that defines it
_EXPORTS = {
    "LLM": "llm",
    "CacheConfig": "config",
    "CompletionOutput": "outputs",
    "ConfigError": "errors",
    "EngineConfig": "config",
    "EngineError": "errors",
    "InvalidRequestError": "errors",
    "Logprob": "outputs",
    "LoRARequest": "lora",
    "ModelConfig": "config",
    "ModelLoadError": "errors",
    "RequestOutput": "outputs",
    "SamplingParams": "sampling_params",
    "SchedulerConfig": "config",
    "StructuredOutputsParams": "structured_output_params",
}
__all__ = [
    "LLM",
    "CacheConfig",
    "CompletionOutput",
    "ConfigError",
    "EngineConfig",
    "EngineError",
    "InvalidRequestError",
    "Logprob",
    "LoRARequest",
    "ModelConfig",
    "ModelLoadError",
    "RequestOutput",
    "SamplingParams",
    "SchedulerConfig",
    "StructuredOutputsParams",
]
assert sorted(__all__) == sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
