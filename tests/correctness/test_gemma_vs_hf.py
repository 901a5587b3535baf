"""Gemma 2 and Gemma 3 (text), each as a tiny random HF checkpoint (transformers' own config
class, `save_pretrained`), loaded through our HF-directory loader: 32 greedy tokens equal HF
transformers' token for token, logprobs within 2e-3. Prompts of several lengths run in one
batch; one is longer than the step's token budget, so its prefill is chunked.

The configs turn on everything that sets the family apart, at values that change the outputs:
four norms per layer (scale 1 + weight), GeGLU, sqrt(hidden_size) embeddings, tied embeddings,
query_pre_attn_scalar != head_dim, sliding layers beside global ones, final logit
soft-capping; Gemma 2 attention soft-capping; Gemma 3 q/k norms, a local rope base and linear
rope scaling on the global layers. The sliding window (8 tokens) is shorter than two of the
prompts and than every completion; test_each_config_value_changes_hf_outputs checks that each
of these values changes HF's outputs, so the greedy comparison would notice one dropped.
Config keys as the hub's config.json files write them are read as transformers reads them.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.correctness.hf_reference import hf_greedy
from vllm_cluster.engine import LLM, ModelLoadError, SamplingParams
from vllm_cluster.engine.layers.attention import Attention
from vllm_cluster.engine.loader import build_model
from vllm_cluster.engine.models import ModelArchConfig

MAX_NEW_TOKENS = 32
MAX_NUM_BATCHED_TOKENS = 16
PROMPTS = [
    [7],
    [3, 141, 59, 26, 5],
    [200, 17, 88, 4, 250, 31, 9, 160, 72, 11, 2],
    [(37 * i + 11) % 256 for i in range(29)],  # > MAX_NUM_BATCHED_TOKENS: chunked prefill
]
SMALL_WINDOW = 8  # shorter than two prompts and than every completion

_TINY = dict(
    vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=24, max_position_embeddings=512,
    rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2, pad_token_id=0, final_logit_softcapping=5.0,
)


_LINEAR = {"rope_type": "linear", "factor": 2.0}


def _gemma2(window: int, **overrides: Any) -> Any:
    from transformers import Gemma2Config

    # Layers 0 and 2 slide, 1 and 3 are global.
    return Gemma2Config(**{**_TINY, "sliding_window": window, "attn_logit_softcapping": 2.0, **overrides})


def _gemma3(window: int, **overrides: Any) -> Any:
    from transformers import Gemma3TextConfig

    # Layers 0 and 2 slide (rope base 100), 1 and 3 are global (base 10000, linear scaling).
    return Gemma3TextConfig(**{
        **_TINY, "sliding_window": window, "sliding_window_pattern": 2, "rope_theta": 10000.0,
        "rope_local_base_freq": 100.0, "rope_scaling": dict(_LINEAR), **overrides,
    })  # fmt: skip


CONFIGS: dict[str, Callable[..., Any]] = {
    "gemma2": partial(_gemma2, SMALL_WINDOW),
    "gemma3": partial(_gemma3, SMALL_WINDOW),
}


def _randomise(model: torch.nn.Module) -> None:
    # The default init (std 0.02, norms 0) makes nearly uniform logits, where argmax ties hide
    # bugs. The (tied, sqrt(hidden_size)-scaled) embeddings stay small, or the residual stream
    # is the input token's embedding and every prompt repeats its last token.
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=generator)
            std = 0.3 if name.endswith("norm.weight") else 0.05 if "embed_tokens" in name else 0.2
            param.copy_(std * noise)


@pytest.fixture(params=sorted(CONFIGS), scope="module")
def checkpoint(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any, str]:
    from transformers import AutoModelForCausalLM

    config = CONFIGS[request.param]()
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="eager").eval()
    _randomise(model)
    path = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(str(path), safe_serialization=True)
    return path, model, request.param


def _llm(path: Path, **overrides: Any) -> LLM:
    return LLM(
        str(path), dtype="float32", num_blocks=64, block_size=4, max_model_len=256,
        max_num_batched_tokens=MAX_NUM_BATCHED_TOKENS, **({"device": "cpu"} | overrides),
    )


def test_greedy_tokens_and_logprobs_match_hf(checkpoint: tuple[Path, Any, str]) -> None:
    path, hf_model, _ = checkpoint
    _assert_matches_hf(_llm(path), hf_model)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("enforce_eager", [False, True], ids=["cuda-graphs", "eager"])
def test_on_gpu_greedy_tokens_and_logprobs_match_hf(checkpoint: tuple[Path, Any, str], enforce_eager: bool) -> None:
    """Gemma 2 and Gemma 3 on CUDA in fp32: Triton kernels (the windowed attention, Gemma 2's
    soft-capped attention in prefill and decode, Gemma's norm, GeGLU), and decode steps from
    CUDA graphs."""
    path, hf_model, _ = checkpoint
    _assert_matches_hf(_llm(path, device="cuda", enforce_eager=enforce_eager), hf_model)


def _assert_matches_hf(llm: LLM, hf_model: Any) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW_TOKENS, ignore_eos=True, logprobs=1)
    outputs = llm.generate(PROMPTS, params, use_tqdm=False)
    generated = []
    for prompt, output in zip(PROMPTS, outputs, strict=True):
        hf_tokens, hf_logprobs = hf_greedy(hf_model, prompt, MAX_NEW_TOKENS)
        generated.append(tuple(hf_tokens))
        completion = output.outputs[0]
        assert completion.token_ids == hf_tokens, f"prompt of {len(prompt)} tokens"
        assert completion.logprobs is not None
        ours = [step[token].logprob for step, token in zip(completion.logprobs, completion.token_ids, strict=True)]
        torch.testing.assert_close(torch.tensor(ours), torch.tensor(hf_logprobs), atol=2e-3, rtol=0)
    # Guards the comparison: one repeated token per prompt would let a broken model pass.
    assert len(set(generated)) == len(PROMPTS)
    assert all(len(set(tokens)) > 2 for tokens in generated)


def test_config_facts_are_read(checkpoint: tuple[Path, Any, str]) -> None:
    path, hf_model, _ = checkpoint
    arch = _llm(path).core.model.config
    gemma = arch.gemma
    assert gemma is not None and arch.tie_word_embeddings and arch.hidden_act == "gelu_pytorch_tanh"
    window = hf_model.config.sliding_window
    assert gemma.layer_windows == (window, None, window, None)
    assert gemma.query_pre_attn_scalar == 24 and gemma.final_logit_softcapping == 5.0
    if arch.architecture == "Gemma2ForCausalLM":
        assert gemma.attn_logit_softcapping == 2.0 and gemma.local_rope_theta is None and not arch.qk_norm
    else:
        assert gemma.attn_logit_softcapping is None and gemma.local_rope_theta == 100.0 and arch.qk_norm
        assert arch.rope_theta == 10000.0 and arch.rope_scaling is not None
        assert arch.rope_scaling["rope_type"] == "linear"


@pytest.mark.parametrize(
    ("family", "override", "message"),
    [
        ("gemma3", {"architectures": ["Gemma3ForConditionalGeneration"]}, "multimodal Gemma 3"),
        ("gemma2", {"use_bidirectional_attention": True}, "use_bidirectional_attention true"),
        ("gemma3", {"hidden_activation": "gelu"}, "hidden_activation 'gelu'"),
        ("gemma2", {"attention_bias": True}, "attention_bias true"),
        ("gemma3", {"layer_types": ["chunked_attention"] * 4}, "layer_types"),
        ("gemma3", {"rope_parameters": {"sliding_attention": _LINEAR}}, "sliding layers"),
    ],
)
def test_unimplemented_config_values_are_refused_by_name(
    family: str, override: dict[str, Any], message: str, tmp_path: Path
) -> None:
    config = CONFIGS[family]()
    config.save_pretrained(str(tmp_path))  # a config alone: config.json names no architecture
    architecture = "Gemma2ForCausalLM" if family == "gemma2" else "Gemma3ForCausalLM"
    with pytest.raises(ModelLoadError, match=message):
        LLM(str(tmp_path), load_format="dummy", device="cpu", num_blocks=64, block_size=4, max_model_len=128,
            hf_overrides={"architectures": [architecture], **override})


@pytest.mark.parametrize("family", sorted(CONFIGS))
def test_attention_softcap_reaches_every_layer(family: str) -> None:
    """Gemma 2's attn_logit_softcapping is each attention layer's softcap (what the kernels
    cap with, on CUDA as on CPU); Gemma 3 reads the key but never applies it, as HF."""
    architecture = "Gemma2ForCausalLM" if family == "gemma2" else "Gemma3ForCausalLM"
    d = {**CONFIGS[family](attn_logit_softcapping=2.0).to_dict(), "architectures": [architecture]}
    model = build_model(ModelArchConfig.from_hf_dict(d), torch.float32, torch.device("cpu"))
    layers = [m for m in model.modules() if isinstance(m, Attention)]
    assert len(layers) == _TINY["num_hidden_layers"]
    assert [m.softcap for m in layers] == [2.0 if family == "gemma2" else None] * len(layers)


@pytest.mark.parametrize(
    ("checkpoint", "override"),
    [
        ("gemma2", {"sliding_window": 128}),
        ("gemma2", {"attn_logit_softcapping": None}),
        ("gemma2", {"final_logit_softcapping": None}),
        ("gemma2", {"query_pre_attn_scalar": 16}),
        ("gemma3", {"sliding_window": 128}),
        ("gemma3", {"rope_local_base_freq": 10000.0}),
        ("gemma3", {"rope_scaling": None}),
    ],
    indirect=["checkpoint"],
)
def test_each_config_value_changes_hf_outputs(checkpoint: tuple[Path, Any, str], override: dict[str, Any]) -> None:
    """The same weights without each value score the long prompt differently, or the greedy
    comparison would not notice the engine dropping it."""
    from transformers import AutoModelForCausalLM

    _, hf_model, name = checkpoint
    changed = CONFIGS[name](**override)
    other = AutoModelForCausalLM.from_config(changed, dtype=torch.float32, attn_implementation="eager").eval()
    other.load_state_dict(hf_model.state_dict())
    ids = torch.tensor([PROMPTS[-1]])
    with torch.no_grad():
        assert (hf_model(ids).logits - other(ids).logits).abs().max() > 1e-2


# Keys as the hub's config.json files write them (no layer_types; Gemma 3's rope as
# rope_theta, rope_scaling and rope_local_base_freq), on tiny shapes.
_HUB_GEMMA2 = {
    "architectures": ["Gemma2ForCausalLM"], "hidden_act": "gelu_pytorch_tanh",
    "hidden_activation": "gelu_pytorch_tanh", "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0,
    "query_pre_attn_scalar": 224, "sliding_window": 4096, "cache_implementation": "hybrid", "rope_theta": 10000.0,
}
_HUB_GEMMA3 = {
    "architectures": ["Gemma3ForCausalLM"], "hidden_activation": "gelu_pytorch_tanh", "query_pre_attn_scalar": 256,
    "sliding_window": 512, "sliding_window_pattern": 6, "rope_theta": 1000000.0, "rope_local_base_freq": 10000.0,
    "rope_scaling": {"rope_type": "linear", "factor": 8.0}, "final_logit_softcapping": None,
    "attn_logit_softcapping": None,
}


@pytest.mark.parametrize("hub", [_HUB_GEMMA2, _HUB_GEMMA3], ids=["gemma2", "gemma3"])
def test_hub_config_keys_are_read_as_transformers_reads_them(hub: dict[str, Any]) -> None:
    from transformers import Gemma2Config, Gemma3TextConfig

    d = {**_TINY, "num_hidden_layers": 7, **hub}
    gemma2 = hub["architectures"] == ["Gemma2ForCausalLM"]
    hf: Any = (Gemma2Config if gemma2 else Gemma3TextConfig)(**{k: v for k, v in d.items() if k != "architectures"})
    arch = ModelArchConfig.from_hf_dict(d)
    assert arch.gemma is not None and arch.tie_word_embeddings  # the key is absent: HF's default
    windows = tuple(hf.sliding_window if t == "sliding_attention" else None for t in hf.layer_types)
    assert arch.gemma.layer_windows == windows and None in windows and windows[0] is not None
    assert arch.gemma.final_logit_softcapping == hf.final_logit_softcapping
    assert arch.gemma.attn_logit_softcapping == (hf.attn_logit_softcapping if gemma2 else None)
    assert arch.gemma.query_pre_attn_scalar == hf.query_pre_attn_scalar
    rope = hf.rope_parameters if gemma2 else hf.rope_parameters["full_attention"]
    assert arch.rope_theta == rope["rope_theta"]
    assert (arch.rope_scaling or {}).get("factor") == rope.get("factor")
    if not gemma2:
        assert arch.gemma.local_rope_theta == hf.rope_parameters["sliding_attention"]["rope_theta"]
