"""Qwen2, Qwen3, Qwen2-MoE and Qwen3-MoE with a sliding window of 8 tokens, each a tiny random
HF checkpoint of 4 layers, generate HF transformers' greedy tokens (logprobs within 2e-3) far
past the window: a prompt shorter than the window and one longer than the step's token
budget (a chunked prefill) in one batch, 32 new tokens each.

The windowed layers are the ones transformers picks: Qwen2 from max_window_layers on (here 2,
so layers 2 and 3), Qwen3 by an explicit layer_types, Qwen2-MoE the even layers below
max_window_layers (here 3: layers 0 and 2), Qwen3-MoE every layer.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.correctness.hf_reference import hf_greedy, randomise
from vllm_cluster.engine import LLM, ModelLoadError, SamplingParams
from vllm_cluster.engine.layers.attention import Attention

WINDOW = 8
MAX_NEW_TOKENS = 32
MAX_NUM_BATCHED_TOKENS = 16
PROMPTS = [
    [3, 141, 59, 26, 5],
    [(37 * i + 11) % 256 for i in range(29)],  # > MAX_NUM_BATCHED_TOKENS: chunked prefill
]
_TINY = dict(
    vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2,
    tie_word_embeddings=False, sliding_window=WINDOW,
)  # fmt: skip
_MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)


def _qwen2(use_sliding_window: bool) -> Any:
    from transformers import Qwen2Config

    return Qwen2Config(**_TINY, use_sliding_window=use_sliding_window, max_window_layers=2)


def _qwen3(use_sliding_window: bool) -> Any:
    from transformers import Qwen3Config

    layer_types = ["sliding_attention", "full_attention", "full_attention", "sliding_attention"]
    if not use_sliding_window:
        layer_types = ["full_attention"] * 4
    return Qwen3Config(**_TINY, use_sliding_window=use_sliding_window, layer_types=layer_types)


def _qwen2_moe(use_sliding_window: bool) -> Any:
    from transformers import Qwen2MoeConfig

    return Qwen2MoeConfig(
        **_TINY, **_MOE, shared_expert_intermediate_size=48, use_sliding_window=use_sliding_window,
        max_window_layers=3,
    )  # fmt: skip


def _qwen3_moe(use_sliding_window: bool) -> Any:
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(**_TINY, **_MOE, norm_topk_prob=True, use_sliding_window=use_sliding_window)


# family -> (config, the windowed layers transformers builds from it)
CONFIGS: dict[str, tuple[Callable[[bool], Any], tuple[int, ...]]] = {
    "qwen2": (_qwen2, (2, 3)),
    "qwen3": (_qwen3, (0, 3)),
    "qwen2_moe": (_qwen2_moe, (0, 2)),
    "qwen3_moe": (_qwen3_moe, (0, 1, 2, 3)),
}


@pytest.fixture(params=sorted(CONFIGS), scope="module")
def checkpoint(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any, str]:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(CONFIGS[request.param][0](True), dtype=torch.float32).eval()
    randomise(model)
    path = tmp_path_factory.mktemp(f"{request.param}_window")
    model.save_pretrained(str(path), safe_serialization=True)
    if request.param in ("qwen2", "qwen2_moe"):
        # As the hub's Qwen2 / Qwen2-MoE configs: no layer_types, so the engine derives the
        # windowed layers from use_sliding_window and max_window_layers as transformers does.
        config = json.loads((path / "config.json").read_text())
        del config["layer_types"]
        (path / "config.json").write_text(json.dumps(config))
    return path, model, request.param


def _llm(path: Path) -> LLM:
    return LLM(
        str(path), device="cpu", dtype="float32", num_blocks=96, block_size=4, max_model_len=128,
        max_num_batched_tokens=MAX_NUM_BATCHED_TOKENS,
    )  # fmt: skip


def test_greedy_tokens_and_logprobs_match_hf_past_the_window(checkpoint: tuple[Path, Any, str]) -> None:
    path, hf_model, name = checkpoint
    llm = _llm(path)
    windows = [m.sliding_window for m in llm.core.model.modules() if isinstance(m, Attention)]
    sliding = CONFIGS[name][1]
    assert windows == [WINDOW if i in sliding else None for i in range(4)]
    # Blocks behind the window are released only where every layer slides.
    assert llm.core.kv.sliding_window == (WINDOW if len(sliding) == 4 else None)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW_TOKENS, ignore_eos=True, logprobs=1)
    outputs = llm.generate(PROMPTS, params, use_tqdm=False)
    for prompt, output in zip(PROMPTS, outputs, strict=True):
        hf_tokens, hf_logprobs = hf_greedy(hf_model, prompt, MAX_NEW_TOKENS)
        completion = output.outputs[0]
        assert completion.token_ids == hf_tokens, f"prompt of {len(prompt)} tokens"
        assert completion.logprobs is not None
        ours = [step[token].logprob for step, token in zip(completion.logprobs, completion.token_ids, strict=True)]
        torch.testing.assert_close(torch.tensor(ours), torch.tensor(hf_logprobs), atol=2e-3, rtol=0)


def test_the_window_changes_hf_outputs(checkpoint: tuple[Path, Any, str]) -> None:
    """Guards the comparison above: the same weights without the window score the long
    prompt differently, so an engine that ignored it (or slid every layer) would fail it."""
    from transformers import AutoModelForCausalLM

    _, hf_model, name = checkpoint
    full = AutoModelForCausalLM.from_config(CONFIGS[name][0](False), dtype=torch.float32).eval()
    full.load_state_dict(hf_model.state_dict())
    ids = torch.tensor([PROMPTS[-1]])
    with torch.no_grad():
        assert (hf_model(ids).logits - full(ids).logits).abs().max() > 1e-2
    layer_types = getattr(hf_model.config, "layer_types", None)
    if layer_types is not None:  # Qwen3-MoE has none: every layer slides
        assert [i for i, t in enumerate(layer_types) if t == "sliding_attention"] == list(CONFIGS[name][1])


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ({"layer_types": ["chunked_attention"] * 4}, "layer_types"),
        ({"use_sliding_window": False, "layer_types": ["sliding_attention"] * 4}, "use_sliding_window"),
    ],
)
def test_layer_types_the_engine_cannot_follow_are_refused(
    override: dict[str, Any], message: str, tmp_path: Path
) -> None:
    _qwen2(True).save_pretrained(str(tmp_path))
    with pytest.raises(ModelLoadError, match=message):
        LLM(str(tmp_path), load_format="dummy", device="cpu", num_blocks=64, block_size=4, max_model_len=128,
            hf_overrides={"architectures": ["Qwen2ForCausalLM"], **override})
