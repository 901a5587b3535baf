"""Engine configuration: a few dataclasses, loaded from one YAML file, validated on load."""

from __future__ import annotations

import dataclasses
import enum
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from vllm_cluster.engine.errors import ConfigError
from vllm_cluster.engine.quantization import METHOD_NAMES

_DTYPES = ("auto", "float32", "float16", "bfloat16")
_LOAD_FORMATS = ("auto", "hf", "gguf", "dummy")
_EXECUTOR_BACKENDS = ("mp", "ray")
# "auto": the model's dtype; "fp8" and "fp8_e4m3" (the same): float8_e4m3fn with a scale per
# layer for K and for V (kernels/attention/fp8_kv.py).
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3")


class EngineRole(str, enum.Enum):
    """What an engine instance serves. A str, so YAML, CLI flags and the wire carry the value."""

    COLOCATED = "colocated"  # requests in, tokens out
    PREFILL = "prefill"  # computes the prompt and its first token, pushes the KV to a decode
    DECODE = "decode"  # reserves blocks for a prompt's KV, then decodes from the first token

    def __str__(self) -> str:
        return self.value

    @classmethod
    def parse(cls, value: str) -> EngineRole:
        """The role named `value`; a ConfigError naming the valid ones otherwise."""
        try:
            return cls(value)
        except ValueError:
            raise ConfigError(f"role: {value!r} is not one of {tuple(r.value for r in cls)}") from None


# The resolved per-process YAML (cluster/config.py) carries the role as its plain string.
yaml.SafeDumper.add_representer(EngineRole, lambda dumper, role: dumper.represent_str(role.value))


@dataclass(slots=True)
class ModelConfig:
    # A path (HF directory or .gguf file), a model id ("org/name") found offline in the
    # local Hugging Face cache (engine/loader/hf_cache.py), the bundled
    # "smollm2-135m-instruct", or, with load_format "dummy", a preset name (see
    # engine/loader/presets.py).
    model: str = "smollm2-135m-instruct"
    # A model id's branch, tag or commit hash in the cache (vLLM's `revision`); None: "main".
    revision: str | None = None
    load_format: str = "auto"
    dtype: str = "auto"
    seed: int = 0
    # Overrides for load_format "dummy" (e.g. {"num_hidden_layers": 2}).
    hf_overrides: dict[str, Any] = field(default_factory=dict)
    # "int8" (weight-only), "fp8" (W8A8), "gptq", "awq" (INT4 checkpoints); None: the
    # checkpoint's quantization_config.quant_method, if it declares one (engine/quantization).
    quantization: str | None = None
    # The online methods (fp8, int8) quantize lm_head too (as TensorRT-LLM's --quantize_lm_head;
    # vLLM keeps it unquantized, as does the default): the logits GEMV reads 1-byte weights.
    quantize_lm_head: bool = False

    def validate(self) -> None:
        if not self.model:
            raise ConfigError("model: must name a model path, a preset or 'smollm2-135m-instruct'")
        if self.load_format not in _LOAD_FORMATS:
            raise ConfigError(f"model.load_format: {self.load_format!r} is not one of {_LOAD_FORMATS}")
        if self.dtype not in _DTYPES:
            raise ConfigError(f"model.dtype: {self.dtype!r} is not one of {_DTYPES}")
        if self.quantization is not None and self.quantization not in METHOD_NAMES:
            raise ConfigError(f"model.quantization: {self.quantization!r} is not one of {list(METHOD_NAMES)} (or null)")


@dataclass(slots=True)
class CacheConfig:
    block_size: int = 16
    # The KV cache's size: the first of these that is set decides. num_blocks: exactly that
    # many. gpu_memory_utilization (vLLM's meaning, CUDA only): the fraction of the GPU's
    # total memory this instance may use, weights, activations and KV cache together.
    # memory_fraction: of the memory still free once the weights are loaded. None set: the
    # device's default (engine/resolve.py: 0.9 utilization on CUDA, memory_fraction 0.1 on CPU).
    num_blocks: int | None = None
    gpu_memory_utilization: float | None = None
    memory_fraction: float | None = None
    # A cap in tokens on the size the rules above give (SGLang's --max-total-tokens); a prefill
    # instance sharing its GPU with decode instances gets one by default (worker/main.py).
    max_total_tokens: int | None = None
    enable_prefix_caching: bool = True
    # What the KV cache stores (vLLM's kv_cache_dtype): KV_CACHE_DTYPES.
    kv_cache_dtype: str = "auto"
    # KV offloading below the device cache (engine/kv_offload.py), off at 0 / None: blocks
    # evicted from the device cache are copied to a host-memory tier of `host_kv_gib` GiB
    # (pinned on CUDA; LMCache's max_local_cpu_size), and blocks evicted from there to a
    # disk tier of `disk_kv_gib` GiB of files in `disk_kv_dir`. A prefix hit in a tier
    # loads the blocks instead of recomputing them.
    host_kv_gib: float = 0.0
    disk_kv_dir: str | None = None
    disk_kv_gib: float = 0.0

    @property
    def size_given(self) -> bool:
        """Whether one of num_blocks / gpu_memory_utilization / memory_fraction is set."""
        sizes = (self.num_blocks, self.gpu_memory_utilization, self.memory_fraction)
        return any(size is not None for size in sizes)

    def validate(self) -> None:
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ConfigError(f"cache.kv_cache_dtype: {self.kv_cache_dtype!r} is not one of {KV_CACHE_DTYPES}")
        if self.block_size not in (1, 2, 4, 8, 16, 32, 64, 128, 256):
            raise ConfigError(f"cache.block_size: {self.block_size} must be a power of two in [1, 256]")
        if self.num_blocks is not None and self.num_blocks < 1:
            raise ConfigError(
                f"cache.num_blocks: {self.num_blocks} must be >= 1 (or unset to size the cache by memory)"
            )
        if self.max_total_tokens is not None and self.max_total_tokens < 1:
            raise ConfigError(f"cache.max_total_tokens: {self.max_total_tokens} must be >= 1 (or unset: no cap)")
        if self.gpu_memory_utilization is not None and not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ConfigError(f"cache.gpu_memory_utilization: {self.gpu_memory_utilization} must be in (0, 1]")
        if self.memory_fraction is not None and not 0.0 < self.memory_fraction <= 0.95:
            raise ConfigError(f"cache.memory_fraction: {self.memory_fraction} must be in (0, 0.95]")
        if self.gpu_memory_utilization is not None and self.memory_fraction is not None:
            raise ConfigError(
                "cache.gpu_memory_utilization and cache.memory_fraction are both set: keep one "
                "(gpu_memory_utilization counts the GPU's total memory, memory_fraction what the weights left free)"
            )
        self._validate_tiers()

    def _validate_tiers(self) -> None:
        if self.host_kv_gib < 0 or self.disk_kv_gib < 0:
            raise ConfigError("cache.host_kv_gib and cache.disk_kv_gib must be >= 0 (0 turns the tier off)")
        if (self.disk_kv_gib > 0) != bool(self.disk_kv_dir):
            raise ConfigError(
                "cache.disk_kv_dir and cache.disk_kv_gib go together: set both for a disk tier, or neither"
            )
        if self.disk_kv_gib > 0 and self.host_kv_gib <= 0:
            raise ConfigError(
                "cache.disk_kv_gib needs cache.host_kv_gib > 0: the disk tier holds what the host tier evicts"
            )
        if self.host_kv_gib > 0 and not self.enable_prefix_caching:
            raise ConfigError("cache.host_kv_gib needs enable_prefix_caching: the tiers hold cached prefix blocks")


@dataclass(slots=True)
class SchedulerConfig:
    # None: the device's default (engine/resolve.py: larger batches on CUDA than on CPU).
    max_num_seqs: int | None = None
    # Per-step token budget; a prompt longer than this is prefilled in chunks. None: the
    # device's default.
    max_num_batched_tokens: int | None = None
    # None: the model's context length.
    max_model_len: int | None = None
    enable_chunked_prefill: bool = True
    # "fcfs": first come, first served (a request's priority must be 0). "priority": lower
    # `priority` first, ties by arrival, for admission and (the other way round) preemption.
    scheduling_policy: str = "fcfs"

    def validate(self) -> None:
        if self.scheduling_policy not in ("fcfs", "priority"):
            raise ConfigError(f"scheduler.scheduling_policy: {self.scheduling_policy!r} must be 'fcfs' or 'priority'")
        if self.max_num_seqs is not None and self.max_num_seqs < 1:
            raise ConfigError(f"scheduler.max_num_seqs: {self.max_num_seqs} must be >= 1")
        if self.max_num_batched_tokens is not None and self.max_num_batched_tokens < 1:
            raise ConfigError(f"scheduler.max_num_batched_tokens: {self.max_num_batched_tokens} must be >= 1")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ConfigError(f"scheduler.max_model_len: {self.max_model_len} must be >= 1")

    def batch_limits(self) -> tuple[int, int]:
        """(max_num_seqs, max_num_batched_tokens), once the device's defaults are in (engine/resolve.py)."""
        if self.max_num_seqs is None or self.max_num_batched_tokens is None:
            raise AssertionError("scheduler limits read before the device's defaults were filled in")
        return self.max_num_seqs, self.max_num_batched_tokens


@dataclass(slots=True)
class ParallelConfig:
    # Ranks are processes: tensor_parallel_size x pipeline_parallel_size of them (one GPU
    # each on CUDA); engine/parallel/ says how they split the model.
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    # How long a rank waits inside a step (a collective, a hidden-state transfer) or at
    # start-up before giving up on another.
    distributed_timeout_s: float = 300.0
    # MoE models: spread each MoE layer's experts over the tensor-parallel ranks (expert-
    # parallel size = tensor_parallel_size; attention stays tensor-parallel) instead of
    # every rank holding all of them. vLLM's option of the same name.
    enable_expert_parallel: bool = False
    # How ranks 1..N-1 start: "mp", local processes; "ray", Ray actors in one placement
    # group on this node (cluster/ray_launcher.py; needs the ray package).
    distributed_executor_backend: str = "mp"
    # With "ray": the Ray cluster to join ("auto", "host:port"). Unset: RAY_ADDRESS if
    # set, else a Ray this process is already connected to, else a local one on loopback.
    ray_address: str | None = None

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size

    def validate(self) -> None:
        if self.tensor_parallel_size < 1:
            raise ConfigError(f"parallel.tensor_parallel_size: {self.tensor_parallel_size} must be >= 1")
        if self.pipeline_parallel_size < 1:
            raise ConfigError(f"parallel.pipeline_parallel_size: {self.pipeline_parallel_size} must be >= 1")
        if self.distributed_timeout_s <= 0:
            raise ConfigError(f"parallel.distributed_timeout_s: {self.distributed_timeout_s} must be > 0")
        if self.distributed_executor_backend not in _EXECUTOR_BACKENDS:
            raise ConfigError(
                f"parallel.distributed_executor_backend: {self.distributed_executor_backend!r} is not one of "
                f"{_EXECUTOR_BACKENDS}"
            )


@dataclass(slots=True)
class LoRAConfig:
    # Multi-LoRA (vLLM's names): at most max_loras adapters resident at once (LRU-swapped),
    # each of rank <= max_lora_rank. lora_modules: adapter name -> PEFT directory, loaded
    # at start-up; more load at run time (LLM.generate's lora_request, the load API).
    enable_lora: bool = False
    max_loras: int = 1
    max_lora_rank: int = 16
    lora_modules: dict[str, str] = field(default_factory=dict)

    def validate(self) -> None:
        if self.max_loras < 1:
            raise ConfigError(f"lora.max_loras: {self.max_loras} must be >= 1")
        if not 1 <= self.max_lora_rank <= 512:
            raise ConfigError(f"lora.max_lora_rank: {self.max_lora_rank} must be in [1, 512]")
        if self.lora_modules and not self.enable_lora:
            raise ConfigError("lora.lora_modules names adapters but enable_lora is false: set enable_lora: true")


@dataclass(slots=True)
class EngineConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    lora: LoRAConfig = field(default_factory=LoRAConfig)
    device: str = "auto"
    role: EngineRole = EngineRole.COLOCATED
    # torch intra-op threads; several engine processes share a machine's cores.
    num_threads: int | None = None
    # On GPU, decode steps replay CUDA graphs captured for batch sizes up to max_num_seqs;
    # True runs every step eagerly (debugging, or to save the capture time).
    enforce_eager: bool = False
    # Async scheduling: prepare step N+1 on the host while the GPU runs step N
    # (engine/async_stepper.py). None: on for CUDA on one process outside the prefill role,
    # off on CPU (where nothing runs ahead of the host, so it cannot pay).
    async_scheduling: bool | None = None
    # Servers: a stream gets a request's new tokens once this many have piled up (the first
    # and the last at once), as SGLang's --stream-interval. 1: every token as it comes;
    # larger: fewer, larger messages and less host work per token with many streams open.
    stream_interval: int = 1

    def __post_init__(self) -> None:
        if not isinstance(self.role, EngineRole):
            self.role = EngineRole.parse(self.role)

    def validate(self) -> None:
        self.model.validate()
        self.cache.validate()
        self.scheduler.validate()
        self.parallel.validate()
        self.lora.validate()
        if self.lora.enable_lora and self.parallel.world_size > 1:
            raise ConfigError(
                "enable_lora runs on one process for now: set tensor_parallel_size and pipeline_parallel_size to 1"
            )
        if self.device not in ("auto", "cpu", "cuda") and not self.device.startswith("cuda:"):
            raise ConfigError(f"device: {self.device!r} must be 'auto', 'cpu', 'cuda' or 'cuda:N'")
        if self.stream_interval < 1:
            raise ConfigError(f"stream_interval: {self.stream_interval} must be >= 1")
        if self.num_threads is not None and self.num_threads < 1:
            raise ConfigError(f"num_threads: {self.num_threads} must be >= 1")
        if self.async_scheduling and (self.role == EngineRole.PREFILL or self.parallel.world_size > 1):
            raise ConfigError(
                "async_scheduling runs on one process outside the prefill role: unset it, or use "
                "role colocated/decode with tensor_parallel_size and pipeline_parallel_size 1"
            )
        if self.parallel.pipeline_parallel_size > 1 and self.role != EngineRole.COLOCATED:
            raise ConfigError(
                f"role {self.role.value!r} splits by tensor parallelism only: set pipeline_parallel_size "
                "to 1 (tensor_parallel_size may be > 1; only the colocated role runs pipeline stages)"
            )
        if self.parallel.world_size > 1 and self.model.quantization is not None:
            raise ConfigError(
                f"model.quantization {self.model.quantization!r} runs on one process for now: set "
                "tensor_parallel_size and pipeline_parallel_size to 1, or unset quantization"
            )
        if self.parallel.world_size > 1 and self.device.startswith("cuda:"):
            raise ConfigError(
                f"device {self.device!r}: with tensor/pipeline parallelism use device: cuda (rank r runs on cuda:r)"
            )

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> EngineConfig:
        kwargs: dict[str, Any] = {}
        top = {f.name for f in dataclasses.fields(cls)}
        for key, value in data.items():
            if key not in top:
                raise ConfigError(f"unknown key {key!r}; valid keys: {sorted(top)}")
            if key in _SECTIONS:
                kwargs[key] = build_section(_SECTIONS[key], key, value)
            else:
                kwargs[key] = value
        config = cls(**kwargs)
        check_types(config, "")
        config.validate()
        return config

    @classmethod
    def from_yaml(cls, path: str | Path) -> EngineConfig:
        try:
            data = yaml.safe_load(Path(path).read_text()) or {}
        except FileNotFoundError:
            raise ConfigError(f"config file {path} does not exist") from None
        except yaml.YAMLError as e:
            raise ConfigError(f"config file {path} is not valid YAML: {e}") from None
        if not isinstance(data, dict):
            raise ConfigError(f"config file {path} must hold a mapping at the top level")
        engine = data.get("engine", data)
        if engine is None:
            engine = {}
        if not isinstance(engine, dict):
            raise ConfigError(f"config file {path}: engine must be a mapping, got {type(engine).__name__}")
        return cls.from_dict(engine)

    @classmethod
    def from_kwargs(cls, model: str, **options: Any) -> EngineConfig:
        """Flat vLLM-style options (`block_size=16, max_num_seqs=8`) to a validated config."""
        return cls.from_dict(_nest({"model": model, **options}, {}))

    def with_overrides(self, **options: Any) -> EngineConfig:
        """A copy with flat options applied (same names as `from_kwargs`), validated."""
        return EngineConfig.from_dict(_nest(options, dataclasses.asdict(self)))


_SECTIONS: dict[str, type] = {
    "model": ModelConfig,
    "cache": CacheConfig,
    "scheduler": SchedulerConfig,
    "parallel": ParallelConfig,
    "lora": LoRAConfig,
}


def _nest(options: dict[str, Any], base: dict[str, Any]) -> dict[str, Any]:
    section_of = {}
    for name, section in _SECTIONS.items():
        for f in dataclasses.fields(section):
            section_of[f.name] = name
    nested: dict[str, Any] = {name: {} for name in _SECTIONS} | base
    for key, value in options.items():
        if key in section_of:
            nested[section_of[key]] = {**nested[section_of[key]], key: value}
        else:
            nested[key] = value
    return nested


def build_section(section: type, name: str, value: Any) -> Any:
    """The dataclass `section` from a YAML mapping; unknown keys name the valid ones."""
    if value is None:
        value = {}
    if not isinstance(value, dict):
        raise ConfigError(f"{name}: must be a mapping, got {type(value).__name__}")
    valid = {f.name for f in dataclasses.fields(section)}
    for key in value:
        if key not in valid:
            raise ConfigError(f"unknown key {name}.{key}; valid keys: {sorted(valid)}")
    return section(**value)


def check_types(obj: Any, prefix: str) -> None:
    """Refuse a value of the wrong type (`max_num_seqs: "8"`) before validation compares it."""
    hints = typing.get_type_hints(type(obj))
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        name = f"{prefix}{f.name}"
        if dataclasses.is_dataclass(value):
            check_types(value, f"{name}.")
            continue
        hint = hints[f.name]
        is_union = typing.get_origin(hint) in (typing.Union, types.UnionType)
        allowed = tuple(typing.get_origin(t) or t for t in (typing.get_args(hint) if is_union else (hint,)))
        if float in allowed:
            allowed += (int,)
        ok = isinstance(value, allowed) and not (isinstance(value, bool) and bool not in allowed)
        if not ok:
            names = " or ".join("null" if t is type(None) else t.__name__ for t in allowed)
            raise ConfigError(f"{name}: {value!r} has type {type(value).__name__}; expected {names}")
