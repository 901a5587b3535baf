"""kv_cache_dtype="fp8": the bundled SmolLM2 with an fp8 KV cache stays close to the same
engine with a cache of the model's dtype; a checkpoint's k_scale / v_scale are loaded and
used; the same memory holds twice the blocks of a 16-bit cache.

Why these tolerances. e4m3 keeps 3 mantissa bits: a stored K/V element is off by up to 2^-4
of itself (round to nearest), and values under 2^-6 (SmolLM2 has no KV scales, so scale
1.0: many V elements are that small) keep only an absolute step of 2^-9. Attention scores
and outputs move by a few percent, so logits move by a fraction of their spread, not by
rounding error, and where the two best tokens are nearly tied the greedy token can swap.
Measured (fp32 CPU, the 92 prompt positions of test_quantized_smollm2's texts): top-1 kept
at 95.7% of positions and at every one of the 56 where the top-1 leads by more than 1 logit;
|logit error| at most 9.8% of the position's logit range, 3.0% on average. Greedy over 32
tokens: 4 of those 6 prompts identical throughout, the others part where the cache-dtype
"auto" run's two best tokens were within 0.21 nats (one at the very first token, 0.10
apart). So greedy equality is asserted up to the first near tie (0.5 nats), not for a fixed
count of tokens.
"""

from __future__ import annotations

import pytest
import torch

from tests.correctness.int4_checkpoint import TINY_LLAMA, float_weights, write_checkpoint
from tests.correctness.mixtral_checkpoint import prefill_logits
from tests.correctness.test_quantized_smollm2 import TEXTS
from vllm_cluster.engine import LLM, SamplingParams
from vllm_cluster.kernels.attention.fp8_kv import FP8_KV_DTYPE

NEAR_TIE_NATS = 0.5
MAX_NEW_TOKENS = 32


@pytest.fixture(scope="module")
def fp8(smollm2: LLM) -> LLM:
    return smollm2.derive(kv_cache_dtype="fp8")


def test_fp8_engine_holds_an_fp8_cache(fp8: LLM) -> None:
    assert fp8.core.kv_cache_dtype == FP8_KV_DTYPE
    assert all(cache.dtype == FP8_KV_DTYPE for cache in fp8.core.runner.kv_caches)


def test_logits_stay_close_to_the_auto_cache(smollm2: LLM) -> None:
    tokenizer = smollm2.get_tokenizer()
    prompts = [list(tokenizer.encode(text)) for text in TEXTS]
    ref = torch.cat(prefill_logits(smollm2.core.model, prompts, block_size=16))  # [positions, V]
    got = torch.cat(prefill_logits(smollm2.core.model, prompts, block_size=16, kv_cache_dtype=FP8_KV_DTYPE))
    agree = ref.argmax(-1) == got.argmax(-1)
    top2 = ref.topk(2, dim=-1).values
    confident = top2[:, 0] - top2[:, 1] > 1.0
    error = (got - ref).abs().amax(-1) / (ref.amax(-1) - ref.amin(-1))
    report = (f"top-1 agreement {float(agree.float().mean()):.3f}, max error {float(error.max()):.4f}, "
              f"mean {float(error.mean()):.4f} of the logit range, over {len(ref)} positions")
    assert int(confident.sum()) >= 40 and bool(agree[confident].all()), report
    assert float(agree.float().mean()) >= 0.9, report
    assert float(error.max()) <= 0.15 and float(error.mean()) <= 0.05, report
    assert float(error.max()) > 0, "fp8 gave exactly the auto logits: nothing was quantized"


def test_greedy_tokens_equal_until_the_first_near_tie(smollm2: LLM, fp8: LLM) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW_TOKENS, logprobs=2, ignore_eos=True)
    auto_out = smollm2.generate(TEXTS, params, use_tqdm=False)
    fp8_out = fp8.generate(TEXTS, params, use_tqdm=False)
    num_identical = 0
    for a, b in zip(auto_out, fp8_out, strict=True):
        ours, theirs = a.outputs[0].token_ids, b.outputs[0].token_ids
        assert a.outputs[0].logprobs is not None
        margins = [_top2_margin(step) for step in a.outputs[0].logprobs]
        first_tie = next((i for i, m in enumerate(margins) if m < NEAR_TIE_NATS), len(margins))
        assert theirs[:first_tie] == ours[:first_tie], (a.prompt, first_tie, ours, theirs)
        num_identical += theirs == ours
    assert num_identical >= 3, f"only {num_identical} of {len(TEXTS)} prompts kept every greedy token"


def _top2_margin(step: dict) -> float:
    best = sorted((entry.logprob for entry in step.values()), reverse=True)
    return best[0] - best[1] if len(best) > 1 else float("inf")


def test_chat_answer_survives(fp8: LLM) -> None:
    chat = [{"role": "user", "content": "What is the capital of France?"}]
    text = fp8.chat(chat, SamplingParams(temperature=0.0, max_tokens=8), use_tqdm=False)[0].outputs[0].text
    assert "Paris" in text, text


# --- scales from a checkpoint ------------------------------------------------------------

K_SCALES, V_SCALES = (0.02, 0.0125), (0.015, 0.025)  # none saturates: |K|, |V| < 448 * 0.0125
SCALE_NAMES = {
    "self_attn": ("model.layers.{i}.self_attn.k_scale", "model.layers.{i}.self_attn.v_scale"),
    "output_scale": (
        "model.layers.{i}.self_attn.k_proj.output_scale",
        "model.layers.{i}.self_attn.v_proj.output_scale",
    ),
}
PROMPT = [3, 141, 59, 26, 5, 77, 200, 13, 9]
_TINY_ENGINE = dict(device="cpu", dtype="float32", num_blocks=16, block_size=4, max_model_len=64)


@pytest.fixture(scope="module")
def plain_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> tuple:
    path = tmp_path_factory.mktemp("tiny-llama")
    weights = float_weights(TINY_LLAMA)
    return write_checkpoint(path, TINY_LLAMA, weights), weights


def _with_scales(root, weights: dict, names: tuple[str, str] | None, kv_scale: bool = False):
    tensors = dict(weights)
    for i in range(TINY_LLAMA["num_hidden_layers"]):
        if kv_scale:
            tensors[f"model.layers.{i}.self_attn.kv_scale"] = torch.tensor(K_SCALES[i])
        elif names is not None:
            tensors[names[0].format(i=i)] = torch.tensor([K_SCALES[i]])  # [1], as llm-compressor writes
            tensors[names[1].format(i=i)] = torch.tensor(V_SCALES[i])  # [], as vLLM writes
    return write_checkpoint(root, TINY_LLAMA, tensors)


def _stored_layer0(llm: LLM) -> tuple[torch.Tensor, torch.Tensor]:
    """Layer 0's K and V after the prompt, as stored (the fp8 values, in fp32). Two fresh
    engines of one config put the prompt in the same blocks."""
    llm.generate([PROMPT], SamplingParams(max_tokens=1), use_tqdm=False)
    cache = llm.core.runner.kv_caches[0].float()  # [NB, 2, BS, Hkv, D]
    return cache[:, 0], cache[:, 1]


@pytest.mark.parametrize("naming", ["self_attn", "output_scale", "kv_scale"])
def test_checkpoint_scales_are_loaded_and_used(naming: str, plain_checkpoint: tuple, tmp_path) -> None:
    plain_path, weights = plain_checkpoint
    scaled_path = _with_scales(tmp_path, weights, SCALE_NAMES.get(naming), kv_scale=naming == "kv_scale")
    scaled = LLM(str(scaled_path), kv_cache_dtype="fp8", **_TINY_ENGINE)
    plain = LLM(str(plain_path), kv_cache_dtype="fp8", **_TINY_ENGINE)
    assert scaled.core.model.kv_scales_loaded and not plain.core.model.kv_scales_loaded
    for i, layer in enumerate(scaled.core.model.model.layers):
        v_expected = K_SCALES[i] if naming == "kv_scale" else V_SCALES[i]
        assert float(layer.self_attn.k_scale) == pytest.approx(K_SCALES[i])
        assert float(layer.self_attn.v_scale) == pytest.approx(v_expected)
        assert layer.self_attn.k_scale.dtype == torch.float32 and layer.self_attn.k_scale.shape == (1,)
    # Writes divide by the scale: the stored values are the plain ones / scale (within fp8's
    # 2^-4, where the plain values are not subnormal).
    k_scaled, v_scaled = _stored_layer0(scaled)
    k_plain, v_plain = _stored_layer0(plain)
    v0 = V_SCALES[0] if naming != "kv_scale" else K_SCALES[0]
    big = k_plain.abs() > 2**-6
    torch.testing.assert_close(k_scaled[big] * K_SCALES[0], k_plain[big], rtol=2**-3, atol=0)
    big = v_plain.abs() > 2**-6
    torch.testing.assert_close(v_scaled[big] * v0, v_plain[big], rtol=2**-3, atol=0)
    # Reads multiply by it: the logits match the auto cache's closely (an unapplied scale of
    # 1/50 or less would wreck them).
    auto = LLM(str(plain_path), **_TINY_ENGINE)
    ref = prefill_logits(auto.core.model, [PROMPT])[0]
    got = prefill_logits(scaled.core.model, [PROMPT], kv_cache_dtype=FP8_KV_DTYPE)[0]
    spread = float((ref.amax(-1) - ref.amin(-1)).min())
    assert float((got - ref).abs().max()) < 0.05 * spread


def test_bad_checkpoint_scale_is_refused(plain_checkpoint: tuple, tmp_path) -> None:
    _, weights = plain_checkpoint
    tensors = {**weights, "model.layers.0.self_attn.k_scale": torch.tensor(0.0)}
    path = write_checkpoint(tmp_path, TINY_LLAMA, tensors)
    with pytest.raises(Exception, match="must be positive and finite"):
        LLM(str(path), kv_cache_dtype="fp8", **_TINY_ENGINE)


# --- the block budget ------------------------------------------------------------------------


def test_fp8_doubles_the_blocks_of_a_16_bit_cache(monkeypatch: pytest.MonkeyPatch) -> None:
    """The same memory budget (memory_fraction of a fixed amount) holds twice the blocks."""
    monkeypatch.setattr("vllm_cluster.engine.memory.available_memory_bytes", lambda device: 256 * 2**20)
    options = dict(load_format="dummy", dtype="bfloat16", device="cpu", memory_fraction=0.25, max_model_len=512,
                   hf_overrides={"num_hidden_layers": 2, "hidden_size": 256, "intermediate_size": 512,
                                 "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 512})
    auto = LLM("llama-3.2-1b", **options)
    fp8 = LLM("llama-3.2-1b", kv_cache_dtype="fp8", **options)
    num_auto, num_fp8 = auto.core.kv.pool.num_blocks, fp8.core.kv.pool.num_blocks
    assert num_fp8 == 2 * num_auto, (num_auto, num_fp8)
    auto_bytes = sum(c.numel() * c.element_size() for c in auto.core.runner.kv_caches)
    fp8_bytes = sum(c.numel() * c.element_size() for c in fp8.core.runner.kv_caches)
    assert auto.core.runner.kv_caches[0].dtype == torch.bfloat16
    assert fp8_bytes == auto_bytes <= 64 * 2**20
