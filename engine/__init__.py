"""The engine core: paged KV cache, continuous batching, chunked prefill, prefix caching."""

from engine.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from engine.errors import ConfigError, EngineError, InvalidRequestError, ModelLoadError
from engine.llm import LLM
from engine.lora import LoRARequest
from engine.outputs import CompletionOutput, Logprob, RequestOutput
from engine.sampling_params import SamplingParams

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
]
