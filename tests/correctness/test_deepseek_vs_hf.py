"""DeepSeek-V2 and DeepSeek-V3 (multi-head latent attention, grouped top-k MoE with shared
experts), each as a tiny random HF checkpoint (transformers' own config class,
`save_pretrained`), through our HF-directory loader and the real engine with its paged
latent cache: 32 greedy tokens equal HF transformers' token for token, logprobs within 2e-3.
Prompts of several lengths run in one batch, one longer than the step's token budget (its
prefill is chunked); a second batch shares a prefix with the first (prefix caching).

Each config turns on what sets it apart: V3 its sigmoid grouped routing with a non-zero
e_score_correction_bias, q_lora_rank, interleaved rope and a dense first layer; V3 with
YaRN (mscale_all_dim: the softmax scale changes too), rope_interleave off and the top-k
weights not renormalised; V2-Lite style q_lora_rank None with softmax greedy routing and
two shared experts; V2 with group_limited_greedy routing and attention biases.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.correctness.handoff import run_disaggregated
from tests.correctness.hf_reference import hf_greedy, randomise
from vllm_cluster.engine import LLM, ConfigError, SamplingParams
from vllm_cluster.engine.models import ModelArchConfig
from vllm_cluster.engine.models.deepseek import DeepseekMoeBlock, MlaAttention
from vllm_cluster.engine.parallel.expert import moe_blocks

MAX_NEW_TOKENS = 32
MAX_NUM_BATCHED_TOKENS = 16
BLOCK_SIZE = 4
PROMPTS = [
    [7],
    [3, 141, 59, 26, 5],
    [200, 17, 88, 4, 250, 31, 9, 160, 72, 11, 2],
    [(37 * i + 11) % 256 for i in range(29)],  # > MAX_NUM_BATCHED_TOKENS: chunked prefill
]
# Its first 24 tokens (6 blocks) are PROMPTS[3]'s: served from the prefix cache.
SHARED_PREFIX_PROMPT = PROMPTS[3][:24] + [99, 98, 97]

_TINY = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=3,
    num_attention_heads=4,
    max_position_embeddings=512,
    rms_norm_eps=1e-6,
    bos_token_id=1,
    eos_token_id=2,
    tie_word_embeddings=False,
    kv_lora_rank=32,
    qk_rope_head_dim=8,
    qk_nope_head_dim=16,
    v_head_dim=24,
    moe_intermediate_size=32,
    n_routed_experts=8,
    num_experts_per_tok=2,
    first_k_dense_replace=1,
)


def _v3() -> Any:
    from transformers import DeepseekV3Config

    return DeepseekV3Config(
        **_TINY,
        q_lora_rank=48,
        n_shared_experts=1,
        n_group=4,
        topk_group=2,
        routed_scaling_factor=2.5,
        norm_topk_prob=True,
    )


def _v3_yarn() -> Any:
    from transformers import DeepseekV3Config

    rope = {
        "rope_type": "yarn",
        "rope_theta": 10000.0,
        "factor": 4.0,
        "original_max_position_embeddings": 128,
        "mscale": 0.707,
        "mscale_all_dim": 0.707,
        "beta_fast": 32,
        "beta_slow": 1,
    }
    return DeepseekV3Config(
        **_TINY,
        q_lora_rank=48,
        n_shared_experts=1,
        n_group=2,
        topk_group=1,
        routed_scaling_factor=1.5,
        norm_topk_prob=False,
        rope_interleave=False,
        rope_parameters=rope,
    )


def _v2_lite() -> Any:
    from transformers import DeepseekV2Config

    return DeepseekV2Config(**_TINY, q_lora_rank=None, n_shared_experts=2, topk_method="greedy")


def _v2_grouped() -> Any:
    from transformers import DeepseekV2Config

    return DeepseekV2Config(
        **_TINY,
        q_lora_rank=40,
        n_shared_experts=1,
        topk_method="group_limited_greedy",
        n_group=4,
        topk_group=2,
        routed_scaling_factor=2.0,
        attention_bias=True,
    )


CONFIGS: dict[str, Callable[[], Any]] = {
    "deepseek_v3": _v3,
    "deepseek_v3_yarn": _v3_yarn,
    "deepseek_v2_lite": _v2_lite,
    "deepseek_v2_grouped": _v2_grouped,
}


@pytest.fixture(params=sorted(CONFIGS), scope="module")
def checkpoint(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any, str]:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(CONFIGS[request.param](), dtype=torch.float32).eval()
    randomise(model)
    # V3's score correction bias is a buffer, which randomise leaves at zero: give it values
    # that change which experts win.
    generator = torch.Generator().manual_seed(1)
    for name, buffer in model.named_buffers():
        if name.endswith("e_score_correction_bias"):
            buffer.copy_(0.3 * torch.randn(buffer.shape, generator=generator))
    path = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(str(path), safe_serialization=True)
    return path, model, request.param


def _llm(path: Path, **overrides: Any) -> LLM:
    return LLM(
        str(path),
        num_blocks=96,
        block_size=BLOCK_SIZE,
        max_model_len=256,
        max_num_batched_tokens=MAX_NUM_BATCHED_TOKENS,
        **({"device": "cpu", "dtype": "float32"} | overrides),
    )


def _assert_matches_hf(llm: LLM, hf_model: Any) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW_TOKENS, ignore_eos=True, logprobs=1)
    batches = [PROMPTS, [SHARED_PREFIX_PROMPT]]
    generated = []
    for prompts in batches:
        outputs = llm.generate(prompts, params, use_tqdm=False)
        for prompt, output in zip(prompts, outputs, strict=True):
            hf_tokens, hf_logprobs = hf_greedy(hf_model, prompt, MAX_NEW_TOKENS)
            generated.append(tuple(hf_tokens))
            completion = output.outputs[0]
            assert completion.token_ids == hf_tokens, f"prompt of {len(prompt)} tokens"
            assert completion.logprobs is not None
            ours = [step[token].logprob for step, token in zip(completion.logprobs, completion.token_ids, strict=True)]
            torch.testing.assert_close(torch.tensor(ours), torch.tensor(hf_logprobs), atol=2e-3, rtol=0)
    assert outputs[0].num_cached_tokens == 24, "the shared prefix was not served from the cache"
    # Guards the comparison: one repeated token per prompt would let a broken model pass.
    assert len(set(generated)) == len(generated)
    assert all(len(set(tokens)) > 2 for tokens in generated)


def test_greedy_tokens_and_logprobs_match_hf(checkpoint: tuple[Path, Any, str]) -> None:
    path, hf_model, _ = checkpoint
    _assert_matches_hf(_llm(path), hf_model)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("enforce_eager", [False, True], ids=["cuda-graphs", "eager"])
def test_on_gpu_greedy_tokens_and_logprobs_match_hf(checkpoint: tuple[Path, Any, str], enforce_eager: bool) -> None:
    """The same on CUDA in fp32: the Triton MLA decode kernel, and decode steps from CUDA graphs."""
    path, hf_model, _ = checkpoint
    _assert_matches_hf(_llm(path, device="cuda", enforce_eager=enforce_eager), hf_model)


def _common_prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), len(a))


def _hf_greedy_on_gpu(model: Any, prompt: list[int]) -> list[int]:
    ids = torch.tensor([prompt], device="cuda")
    with torch.inference_mode():
        for _ in range(MAX_NEW_TOKENS):
            ids = torch.cat([ids, model(ids).logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    return ids[0, len(prompt) :].tolist()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("enforce_eager", [False, True], ids=["cuda-graphs", "eager"])
def test_on_gpu_bf16_tracks_fp32_as_well_as_hf_bf16(checkpoint: tuple[Path, Any, str], enforce_eager: bool) -> None:
    """bf16 rounding makes greedy paths drift from the exact (fp32) one at near-ties; ours must
    follow HF's fp32 tokens about as far as HF's own bf16 run does, over all prompts."""
    import copy

    path, hf_model, _ = checkpoint
    llm = _llm(path, device="cuda", dtype="bfloat16", enforce_eager=enforce_eager)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW_TOKENS, ignore_eos=True)
    ours = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]
    hf_bf16 = copy.deepcopy(hf_model).to("cuda", torch.bfloat16)
    ours_total = hf_total = 0
    for prompt, tokens in zip(PROMPTS, ours, strict=True):
        truth = hf_greedy(hf_model, prompt, MAX_NEW_TOKENS)[0]
        ours_total += _common_prefix(tokens, truth)
        hf_total += _common_prefix(_hf_greedy_on_gpu(hf_bf16, prompt), truth)
    assert ours_total >= 0.8 * hf_total, (ours_total, hf_total)
    assert ours_total > 0


@pytest.mark.parametrize("checkpoint", ["deepseek_v3"], indirect=True)
def test_kv_cache_holds_only_the_latent_and_rotary_key(checkpoint: tuple[Path, Any, str]) -> None:
    """The KV bytes per token the engine sizes its cache by, and the cache it allocates, are
    (kv_lora_rank + qk_rope_head_dim) * dtype bytes * layers: no per-head keys or values."""
    path, _, _ = checkpoint
    llm = _llm(path)
    executor = llm.core.executor
    expected = (32 + 8) * 4 * 3  # fp32, three layers
    assert llm.core.kv_bytes_per_token == expected  # what the engine reports at start
    assert executor.kv_cache_block_bytes(BLOCK_SIZE, torch.float32) == expected * BLOCK_SIZE
    assert executor.kv_cache_block_bytes(BLOCK_SIZE, torch.float16) == expected // 2 * BLOCK_SIZE
    caches = executor.runner.kv_caches
    assert [tuple(c.shape) for c in caches] == [(96, 1, BLOCK_SIZE, 1, 32 + 8)] * 3
    assert sum(c[0].numel() * c.element_size() for c in caches) == expected * BLOCK_SIZE
    # A full K/V cache of the same model would hold 2 * heads * (nope + rope) per token: 6x more here.
    assert expected * 4 < 2 * 4 * (16 + 8) * 4 * 3


@pytest.mark.parametrize("checkpoint", ["deepseek_v3"], indirect=True)
def test_disaggregated_latent_handoff_gives_hf_tokens(checkpoint: tuple[Path, Any, str]) -> None:
    """Prefill pushes each layer's latent blocks into the blocks decode reserved (a direct
    copy, as a transport does); decode continues from them with HF's tokens."""
    path, hf_model, _ = checkpoint
    llm = _llm(path)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    prefill = llm.derive(role="prefill", max_num_batched_tokens=MAX_NUM_BATCHED_TOKENS).core
    decode = llm.derive(role="decode").core
    got, pushes = run_disaggregated(prefill, decode, PROMPTS, params)
    assert got == [hf_greedy(hf_model, prompt, 12)[0] for prompt in PROMPTS]
    assert all(p.layers_pushed == [0, 1, 2] and p.finished for p in pushes)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("checkpoint", "parallel"),
    [
        ("deepseek_v3", {"tensor_parallel_size": 2, "enable_expert_parallel": True}),
        ("deepseek_v2_lite", {"tensor_parallel_size": 2}),
        ("deepseek_v3", {"pipeline_parallel_size": 2}),
    ],
    indirect=["checkpoint"],
    ids=["tp2-ep", "tp2", "pp2"],
)
def test_parallel_equals_hf(checkpoint: tuple[Path, Any, str], parallel: dict[str, Any]) -> None:
    """Two real processes (gloo). Tensor parallelism: each rank keeps 2 of the 4 MLA heads
    (q_b_proj or q_proj, kv_b_proj, row-parallel o_proj) and caches the whole latent; the
    shared experts and the dense layer are tensor-parallel MLPs. With enable_expert_parallel
    each rank holds 4 of every MoE layer's 8 routed experts, without it all 8. Pipeline
    parallelism: each stage holds its layers' latent caches."""
    path, hf_model, _ = checkpoint
    llm = _llm(path, num_threads=1, **parallel)
    try:
        layers = list(llm.core.model.model.layers)
        if parallel.get("tensor_parallel_size"):
            local_experts = 4 if parallel.get("enable_expert_parallel") else 8
            experts = [(b.expert_start, b.num_local_experts) for b in moe_blocks(llm.core.model)]
            assert experts == [(0, local_experts)] * 2
            assert all(layer.self_attn.num_heads == 2 for layer in layers)
        else:
            assert 0 < len(layers) < 3  # this process holds one stage's layers (of 3)
        params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
        outputs = llm.generate(PROMPTS, params, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outputs] == [hf_greedy(hf_model, p, 12)[0] for p in PROMPTS]
    finally:
        llm.core.shutdown()
        torch.set_num_threads(2)


@pytest.mark.parametrize("checkpoint", ["deepseek_v3", "deepseek_v2_lite"], indirect=True)
def test_layers_are_built_as_the_config_says(checkpoint: tuple[Path, Any, str]) -> None:
    path, _, name = checkpoint
    model = _llm(path).core.model
    config: ModelArchConfig = model.config
    assert config.dense_layer_ids == (0,)
    layers = list(model.model.layers)
    assert all(isinstance(layer.self_attn, MlaAttention) for layer in layers)
    assert not isinstance(layers[0].mlp, DeepseekMoeBlock)
    blocks = [layer.mlp for layer in layers[1:]]
    assert all(isinstance(b, DeepseekMoeBlock) for b in blocks)
    shared = blocks[0].shared_experts
    assert shared is not None and shared.intermediate_size == 32 * (1 if name == "deepseek_v3" else 2)
    assert (layers[0].self_attn.q_proj is None) == (name == "deepseek_v3")
    router = blocks[0].experts.router
    assert (router.e_score_correction_bias is not None) == (name == "deepseek_v3")
    assert config.routing is not None and config.routing.scoring == ("sigmoid" if name == "deepseek_v3" else "softmax")


@pytest.mark.parametrize("checkpoint", ["deepseek_v3_yarn"], indirect=True)
def test_yarn_mscale_all_dim_scales_the_softmax(checkpoint: tuple[Path, Any, str]) -> None:
    path, hf_model, _ = checkpoint
    config = _llm(path).core.model.config
    assert config.mla is not None and config.rope_scaling is not None
    assert config.rope_scaling["rope_type"] == "yarn"
    expected = hf_model.model.layers[0].self_attn.scaling
    assert expected != pytest.approx((16 + 8) ** -0.5)
    assert config.mla.softmax_scale == pytest.approx(expected, rel=1e-6)


@pytest.mark.parametrize("checkpoint", ["deepseek_v2_lite"], indirect=True)
def test_fp8_kv_cache_is_refused(checkpoint: tuple[Path, Any, str]) -> None:
    path, _, _ = checkpoint
    with pytest.raises(ConfigError, match="kv_cache_dtype 'fp8' is not supported for DeepseekV2ForCausalLM"):
        _llm(path, kv_cache_dtype="fp8")


def test_deepseek_v2_lite_preset_runs_with_dummy_weights() -> None:
    """The preset GPU benchmarks use, shrunk: random weights through the whole engine."""
    small = {
        "num_hidden_layers": 2, "hidden_size": 64, "intermediate_size": 128, "moe_intermediate_size": 32,
        "n_routed_experts": 8, "num_attention_heads": 4, "vocab_size": 512, "kv_lora_rank": 32,
        "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 16,
    }  # fmt: skip
    llm = LLM("deepseek-v2-lite", load_format="dummy", hf_overrides=small, device="cpu", dtype="float32",
              num_blocks=32, block_size=4, max_model_len=128)  # fmt: skip
    config = llm.core.model.config
    assert config.mla is not None and config.mla.q_lora_rank is None and config.rope_scaling is not None
    out = llm.generate([[5, 6, 7]], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4
