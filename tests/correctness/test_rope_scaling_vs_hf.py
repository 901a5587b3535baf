"""Each RoPE scaling type transformers implements, as a tiny random Llama checkpoint, rotates
and generates as HF transformers does.

The original contexts are small (32 positions), so prompts run past them while staying
short. Where transformers' rotation depends on the sequence's length (dynamic, longrope;
engine/layers/rotary.py says how the one table chooses), the prompts are those lengths
where the table and transformers agree.
"""

from __future__ import annotations

import copy
import re
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.correctness.hf_reference import hf_greedy, randomise
from vllm_cluster.engine import LLM, SamplingParams
from vllm_cluster.engine.errors import ModelLoadError
from vllm_cluster.engine.layers.rotary import RotaryEmbedding
from vllm_cluster.engine.models import ModelArchConfig

MAX_NEW_TOKENS = 6
ORIGINAL = 32  # the context each tiny model was "trained" at
_TINY = dict(
    vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False,
)
_SHORT_FACTOR = [1.0 + 0.1 * i for i in range(8)]  # head_dim 16: 8 frequencies
_LONG_FACTOR = [1.0 + 0.7 * i for i in range(8)]


def _prompt(length: int, seed: int) -> list[int]:
    return [(37 * i + seed) % 253 + 3 for i in range(length)]


SHORT_PROMPTS = [_prompt(5, 11), _prompt(17, 5)]
LONG_PROMPTS = [_prompt(ORIGINAL + 1, 7), _prompt(ORIGINAL + 13, 3)]  # > ORIGINAL, chunked prefill

# name -> (LlamaConfig arguments, prompts compared with transformers)
CASES: dict[str, tuple[dict[str, Any], list[list[int]]]] = {
    "linear": (
        dict(max_position_embeddings=ORIGINAL, rope_parameters={"rope_type": "linear", "factor": 2.0}),
        SHORT_PROMPTS + LONG_PROMPTS,
    ),
    # transformers grows the base past max_position_embeddings; the table is built for the
    # whole context (64), as transformers rotates once it has run a sequence that long.
    "dynamic": (
        dict(max_position_embeddings=ORIGINAL, rope_parameters={"rope_type": "dynamic", "factor": 2.0}),
        LONG_PROMPTS,
    ),
    "yarn": (
        dict(
            max_position_embeddings=4 * ORIGINAL,
            rope_parameters={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": ORIGINAL},
        ),
        SHORT_PROMPTS + LONG_PROMPTS,
    ),
    "yarn_mscale": (
        dict(
            max_position_embeddings=4 * ORIGINAL,
            rope_parameters={
                "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": ORIGINAL,
                "mscale": 1.0, "mscale_all_dim": 0.5, "beta_fast": 16.0, "beta_slow": 2.0, "truncate": False,
            },
        ),
        SHORT_PROMPTS + LONG_PROMPTS,
    ),
    # Served past its original context: the long factors, as transformers uses for every
    # sequence longer than ORIGINAL.
    "longrope": (
        dict(
            max_position_embeddings=4 * ORIGINAL, original_max_position_embeddings=ORIGINAL,
            rope_parameters={"rope_type": "longrope", "short_factor": _SHORT_FACTOR, "long_factor": _LONG_FACTOR},
        ),
        LONG_PROMPTS,
    ),
    # Served no longer than its original context: the short factors.
    "longrope_short": (
        dict(
            max_position_embeddings=ORIGINAL, original_max_position_embeddings=ORIGINAL,
            rope_parameters={"rope_type": "longrope", "short_factor": _SHORT_FACTOR, "long_factor": _LONG_FACTOR},
        ),
        SHORT_PROMPTS,
    ),
}


def _hf_config(name: str) -> Any:
    from transformers import LlamaConfig

    return LlamaConfig(**_TINY, **copy.deepcopy(CASES[name][0]))  # transformers edits rope_parameters in place


@pytest.mark.parametrize("name", sorted(CASES))
def test_tables_equal_transformers_rotary(name: str) -> None:
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    config = _hf_config(name)
    arch = ModelArchConfig.from_hf_dict(config.to_dict())
    ours = RotaryEmbedding(arch.head_dim, arch.max_position_embeddings, arch.rope_theta, arch.rope_scaling)
    positions = torch.arange(arch.max_position_embeddings)[None]  # the whole context, as one sequence
    cos, sin = LlamaRotaryEmbedding(config)(torch.zeros(1), positions)
    half = arch.head_dim // 2
    torch.testing.assert_close(ours.cos, cos[0, :, :half], atol=2e-7, rtol=0)
    torch.testing.assert_close(ours.sin, sin[0, :, :half], atol=2e-7, rtol=0)
    # The scaling is not a no-op: the table differs from plain RoPE's.
    plain = RotaryEmbedding(arch.head_dim, arch.max_position_embeddings, arch.rope_theta)
    assert (ours.cos - plain.cos).abs().max() > 1e-2


@pytest.mark.parametrize("name", ["yarn", "longrope"])
def test_rotary_kernels_rotate_with_the_scaled_tables(name: str) -> None:
    # yarn and longrope fold their attention factor into cos/sin; a rotation keeps a
    # vector's length, so every rotated head comes out longer by exactly that factor.
    from vllm_cluster.kernels.elementwise import reference, torch_ops, triton_ops

    arch = ModelArchConfig.from_hf_dict(_hf_config(name).to_dict())
    table = RotaryEmbedding(arch.head_dim, arch.max_position_embeddings, arch.rope_theta, arch.rope_scaling)
    rope = table(torch.tensor([0, 5, ORIGINAL + 3, arch.max_position_embeddings - 1]))
    attention_factor = float(rope.cos[0, 0])  # position 0: cos 1, scaled
    assert attention_factor > 1.05
    generator = torch.Generator().manual_seed(0)
    q, k = torch.randn(4, 4, 16, generator=generator), torch.randn(4, 2, 16, generator=generator)
    expected_q, expected_k = reference.rotary_embedding(q, k, rope.cos, rope.sin)
    torch.testing.assert_close(expected_q.norm(dim=-1), attention_factor * q.norm(dim=-1))
    torch.testing.assert_close(expected_k.norm(dim=-1), attention_factor * k.norm(dim=-1))
    for ops in (torch_ops, triton_ops):  # triton under TRITON_INTERPRET on CPU
        out_q, out_k = ops.rotary_embedding(q, k, rope.cos, rope.sin)
        torch.testing.assert_close(out_q, expected_q, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(out_k, expected_k, atol=1e-5, rtol=1e-5)


def test_context_length_follows_the_scaling() -> None:
    lengths = {name: ModelArchConfig.from_hf_dict(_hf_config(name).to_dict()).max_position_embeddings for name in CASES}
    # linear/dynamic: max_position_embeddings x factor; yarn: original x factor; longrope: as stated.
    expected = {"linear": 64, "dynamic": 64, "yarn": 128, "yarn_mscale": 128, "longrope": 128, "longrope_short": 32}
    assert lengths == expected


@pytest.mark.parametrize("name", sorted(CASES))
def test_greedy_tokens_and_logprobs_match_hf(name: str, tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    config = _hf_config(name)
    torch.manual_seed(0)
    hf_model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    randomise(hf_model)
    hf_model.save_pretrained(str(tmp_path), safe_serialization=True)
    prompts = CASES[name][1]
    context = ModelArchConfig.from_hf_dict(config.to_dict()).max_position_embeddings
    if config.rope_parameters["rope_type"] == "dynamic":
        with torch.no_grad():  # transformers grows its base for the whole context, and keeps it
            hf_model(torch.zeros(1, context, dtype=torch.long))

    llm = LLM(
        str(tmp_path), device="cpu", dtype="float32", num_blocks=64, block_size=4,
        max_model_len=context, max_num_batched_tokens=16,
    )
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW_TOKENS, ignore_eos=True, logprobs=1)
    outputs = llm.generate(prompts, params, use_tqdm=False)

    for prompt, output in zip(prompts, outputs, strict=True):
        hf_tokens, hf_logprobs = hf_greedy(hf_model, prompt, MAX_NEW_TOKENS)
        completion = output.outputs[0]
        assert completion.token_ids == hf_tokens, f"prompt of {len(prompt)} tokens"
        assert completion.logprobs is not None
        ours = [step[token].logprob for step, token in zip(completion.logprobs, completion.token_ids, strict=True)]
        torch.testing.assert_close(torch.tensor(ours), torch.tensor(hf_logprobs), atol=2e-3, rtol=0)


@pytest.mark.parametrize(
    ("rope", "message"),
    [
        (
            {"rope_type": "proportional", "factor": 2.0},
            "rope type 'proportional' (config.json rope_parameters / rope_scaling) is not supported; "
            "supported: ['default', 'linear', 'dynamic', 'yarn', 'longrope', 'llama3']",
        ),
        ({"type": "linear"}, "rope type 'linear' needs ['factor']"),
        ({"rope_type": "default", "partial_rotary_factor": 0.5}, "partial_rotary_factor 0.5 is not supported"),
    ],
)
def test_unsupported_rope_is_refused_when_the_model_loads(rope: dict[str, Any], message: str) -> None:
    with pytest.raises(ModelLoadError, match=re.escape(message)):
        LLM("llama-3.2-1b", load_format="dummy", device="cpu", hf_overrides={"rope_scaling": rope})
