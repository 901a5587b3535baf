"""Sizes a config leaves unset: filled in per device (engine/resolve.py), the KV cache's
memory under gpu_memory_utilization (engine/memory.py), and instances sharing one GPU."""

from __future__ import annotations

import pytest
import torch

from vllm_cluster.engine import memory
from vllm_cluster.engine.config import EngineConfig
from vllm_cluster.engine.errors import ConfigError
from vllm_cluster.engine.loader.presets import PRESETS
from vllm_cluster.engine.models import ModelArchConfig
from vllm_cluster.engine.resolve import CPU_DEFAULTS, CUDA_DEFAULTS, with_device_defaults
from vllm_cluster.worker.main import share_gpu

CUDA = torch.device("cuda", 0)  # a device object needs no GPU; nothing here touches one
GiB = 1 << 30


def test_cuda_fills_in_serving_sized_batches_and_most_of_the_gpu() -> None:
    config = with_device_defaults(EngineConfig.from_kwargs("llama-3.1-8b", load_format="dummy"), CUDA)
    assert config.scheduler.batch_limits() == (CUDA_DEFAULTS.max_num_seqs, CUDA_DEFAULTS.max_num_batched_tokens)
    assert (config.cache.gpu_memory_utilization, config.cache.memory_fraction) == (0.9, None)


def test_cpu_keeps_small_batches_and_a_tenth_of_free_memory() -> None:
    config = with_device_defaults(EngineConfig(), torch.device("cpu"))
    limits = (CPU_DEFAULTS.max_num_seqs, CPU_DEFAULTS.max_num_batched_tokens)
    assert config.scheduler.batch_limits() == (64, 512) == limits
    assert (config.cache.gpu_memory_utilization, config.cache.memory_fraction) == (None, 0.1)


def test_what_the_config_sets_is_kept() -> None:
    config = EngineConfig.from_kwargs("m", max_num_seqs=8, max_num_batched_tokens=64, num_blocks=100)
    resolved = with_device_defaults(config, CUDA)
    assert resolved.scheduler.batch_limits() == (8, 64)
    assert (resolved.cache.num_blocks, resolved.cache.gpu_memory_utilization) == (100, None)
    explicit = with_device_defaults(EngineConfig.from_kwargs("m", gpu_memory_utilization=0.5), CUDA)
    assert explicit.cache.gpu_memory_utilization == 0.5


def test_gpu_memory_utilization_on_cpu_is_refused_with_what_to_set() -> None:
    config = EngineConfig.from_kwargs("m", gpu_memory_utilization=0.9)
    with pytest.raises(ConfigError, match="runs on cpu: set cache.memory_fraction or cache.num_blocks"):
        with_device_defaults(config, torch.device("cpu"))


def test_unresolved_limits_are_never_read_silently() -> None:
    with pytest.raises(AssertionError, match="before the device's defaults"):
        EngineConfig().scheduler.batch_limits()


def test_the_llm_api_on_cpu_starts_with_the_cpu_defaults() -> None:
    from vllm_cluster.engine.llm import LLM

    tiny = {"num_hidden_layers": 1, "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 2,
            "num_key_value_heads": 1, "head_dim": 32, "vocab_size": 256}
    llm = LLM("llama-3.2-1b", load_format="dummy", device="cpu", hf_overrides=tiny, max_model_len=256, num_blocks=32)
    assert llm.core.config.scheduler.batch_limits() == (64, 512)
    assert (llm.core.scheduler.max_num_seqs, llm.core.scheduler.max_num_batched_tokens) == (64, 512)


def _arch(preset: str) -> ModelArchConfig:
    return ModelArchConfig.from_hf_dict(PRESETS[preset])


def test_activation_bound_grows_with_the_step_budget() -> None:
    arch = _arch("llama-3.1-8b")
    small = with_device_defaults(EngineConfig.from_kwargs("m", max_num_batched_tokens=512), CUDA).scheduler
    large = with_device_defaults(EngineConfig.from_kwargs("m", max_num_batched_tokens=8192), CUDA).scheduler
    a_small, a_large = memory.activation_bytes(arch, small, 2), memory.activation_bytes(arch, large, 2)
    # 8192 tokens x (4 x 4096 + 4096 + 2 x 1024 + 3 x 14336) x 2 bytes = 1.06 GiB, plus logits and slack
    assert 1.5 * GiB < a_large < 2.5 * GiB
    assert a_large > a_small


class _FakeGpu:
    """An H200-sized device for the arithmetic: 140 GiB, `used_by_others` held elsewhere,
    `ours` reserved by this process (the weights). Only here, where no GPU exists."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, ours: int, used_by_others: int) -> None:
        total = 140 * GiB
        free = total - ours - used_by_others - memory.CUDA_CONTEXT_BYTES
        monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (free, total))
        monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: ours)


def _cache(**options: object):
    return with_device_defaults(EngineConfig.from_kwargs("m", **options), CUDA).cache


def test_utilization_counts_total_memory_less_weights_and_activations(monkeypatch: pytest.MonkeyPatch) -> None:
    _FakeGpu(monkeypatch, ours=16 * GiB, used_by_others=0)
    budget = memory.kv_cache_bytes(_cache(), CUDA, activations=2 * GiB)
    assert budget == int(140 * GiB * 0.9) - 16 * GiB - memory.CUDA_CONTEXT_BYTES - 2 * GiB


def test_two_instances_sharing_a_gpu_each_fit_at_half(monkeypatch: pytest.MonkeyPatch) -> None:
    # The first instance (0.45 of the GPU) is up: it holds about 63 GiB.
    _FakeGpu(monkeypatch, ours=16 * GiB, used_by_others=63 * GiB)
    assert memory.kv_cache_bytes(_cache(gpu_memory_utilization=0.45), CUDA, activations=2 * GiB) > 40 * GiB
    with pytest.raises(ConfigError, match=r"only .* GiB are free \(other processes hold about 63\.0 GiB\): lower it"):
        memory.kv_cache_bytes(_cache(gpu_memory_utilization=0.9), CUDA, activations=2 * GiB)


def test_a_share_too_small_for_the_weights_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    _FakeGpu(monkeypatch, ours=16 * GiB, used_by_others=0)
    with pytest.raises(ConfigError, match=r"gpu_memory_utilization 0\.1 gives this instance 14\.0 GiB .* raise it"):
        memory.kv_cache_bytes(_cache(gpu_memory_utilization=0.1), CUDA, activations=2 * GiB)


def test_share_gpu_splits_the_default_only_where_nothing_is_set() -> None:
    unset = EngineConfig.from_kwargs("m", device="cpu")
    assert share_gpu(unset, 2) is unset  # CPU: nothing to split
    sized = EngineConfig.from_kwargs("m", device="cpu", num_blocks=64)
    assert share_gpu(sized, 2) is sized


def test_max_total_tokens_caps_the_cache_in_whole_blocks() -> None:
    from vllm_cluster.engine.llm import LLM

    tiny = {"num_hidden_layers": 1, "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 2,
            "num_key_value_heads": 1, "head_dim": 32, "vocab_size": 256}
    llm = LLM("llama-3.2-1b", load_format="dummy", device="cpu", hf_overrides=tiny, max_model_len=256,
              max_total_tokens=1000)  # memory_fraction 0.1 of this host would give far more
    assert llm.core.kv.pool.num_blocks == 63  # 1000 tokens in blocks of 16, rounded up
    with pytest.raises(ConfigError, match="fewer than max_model_len 256: raise cache.max_total_tokens"):
        LLM("llama-3.2-1b", load_format="dummy", device="cpu", hf_overrides=tiny, max_model_len=256,
            max_total_tokens=100)


def test_a_capped_share_fits_beside_other_processes(monkeypatch: pytest.MonkeyPatch) -> None:
    # 0.9 of the GPU would not fit beside 63 GiB held elsewhere, but the cap keeps it to 4 GiB.
    _FakeGpu(monkeypatch, ours=16 * GiB, used_by_others=63 * GiB)
    assert memory.kv_cache_bytes(_cache(), CUDA, activations=2 * GiB, cap=4 * GiB) == 4 * GiB


def test_a_prefill_sharing_the_gpu_keeps_one_prompt_and_two_steps(monkeypatch: pytest.MonkeyPatch) -> None:
    import vllm_cluster.worker.main as worker

    monkeypatch.setattr(worker, "resolve_device", lambda name: CUDA)  # the arithmetic only: no GPU here
    prefill = EngineConfig.from_kwargs("llama-3.1-8b", load_format="dummy", max_model_len=8192, role="prefill")
    shared = share_gpu(prefill, 2)
    assert shared.cache.gpu_memory_utilization == pytest.approx(0.45)
    assert shared.cache.max_total_tokens == 8192 + 2 * 8192  # CUDA's max_num_batched_tokens
    decode = EngineConfig.from_kwargs("llama-3.1-8b", load_format="dummy", max_model_len=8192, role="decode")
    given = share_gpu(decode, 2, utilization=0.7)  # what the prefill instances left, from the launcher
    assert (given.cache.gpu_memory_utilization, given.cache.max_total_tokens) == (0.7, None)
    assert share_gpu(decode, 2).cache.gpu_memory_utilization == pytest.approx(0.45)


def test_a_local_cluster_gives_its_decodes_what_the_prefills_left(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    from vllm_cluster.cluster.local import LocalCluster, _Process

    path = tmp_path / "c.yaml"
    path.write_text("engine: {model: llama-3.1-8b, load_format: dummy}\ncluster: {num_prefill: 2, num_decode: 2}\n")
    cluster = LocalCluster.from_yaml(path)
    monkeypatch.setattr(cluster, "_engine_on_cuda", lambda: True)  # no GPU here: the arithmetic only
    monkeypatch.setattr(cluster, "_wait_ready", lambda process: None)
    info = {"gpu_total_bytes": 100 * GiB, "gpu_bytes": 20 * GiB}
    prefills = [_Process(f"prefill-{i}", None, path, path, info=info) for i in range(2)]  # type: ignore[arg-type]
    assert cluster._decode_share(prefills) == ["--gpu-memory-utilization", "0.2500"]  # (0.9 - 0.4) / 2
    info["gpu_bytes"] = 44 * GiB
    with pytest.raises(RuntimeError, match="leaving the decode instances nothing"):
        cluster._decode_share(prefills)
    monkeypatch.setattr(cluster, "_engine_on_cuda", lambda: False)
    assert cluster._decode_share(prefills) == []  # CPU: every instance starts at once
