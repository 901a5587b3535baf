"""Online quantization (`quantization: fp8 | int8`) of Gemma 2, Gemma 3, Phi-3, OLMo 2 and
Granite on CPU: every decoder layer's qkv_proj, o_proj, gate_up_proj and down_proj become
the method's module, and the quantized model's logits stay close to the unquantized model's
on the same tokens (each prompt followed by the unquantized greedy completion, so the two
score identical sequences). Qwen2-MoE, Qwen3-MoE (and Mixtral: tests/unit/test_quantization.py)
and DeepSeek-V2/V3 are refused by name, at start.

Why these tolerances: quantization moves every weight by up to half a step (INT8: 1/254 of
its row's largest weight; FP8: 1/16 of the weight itself, and every activation too), so the
logits move by a fraction of their spread, not by rounding error, and where the two best
tokens are nearly tied the top-1 can swap. Measured on these tiny random checkpoints (fp32,
85 positions each): INT8 kept the top-1 at 95-98% of positions, max |logit error| 2-5% of
the position's logit range (mean 1-1.7%), no top-1 lost that led by more than 1.3% of the
range; FP8 (weights and activations) 77-88%, max 10-24% (mean 6-10%), none lost that led by
more than 10%. The bounds (BOUNDS) leave room for other BLAS builds, not for a broken path:
a wrong scale or layout gives near-random tokens and errors of the order of the range.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import pytest
import torch

from tests.correctness import test_deepseek_vs_hf as deepseek_tests
from tests.correctness import test_gemma_vs_hf as gemma_tests
from tests.correctness import test_more_models_vs_hf as more_tests
from tests.correctness.hf_reference import randomise
from tests.correctness.mixtral_checkpoint import prefill_logits
from vllm_cluster.engine import LLM, ConfigError, SamplingParams
from vllm_cluster.engine.quantization.fp8 import Fp8Linear
from vllm_cluster.engine.quantization.int8 import Int8Linear

MAX_NEW_TOKENS = 12
PROMPTS = [
    [7],
    [3, 141, 59, 26, 5],
    [200, 17, 88, 4, 250, 31, 9, 160, 72, 11, 2],
    [(37 * i + 11) % 256 for i in range(20)],
]
# family -> (HF config, how its test randomises the weights)
FAMILIES: dict[str, tuple[Callable[[], Any], Callable[[torch.nn.Module], None]]] = {
    "gemma2": (gemma_tests.CONFIGS["gemma2"], gemma_tests._randomise),
    "gemma3": (gemma_tests.CONFIGS["gemma3"], gemma_tests._randomise),
    "phi3": (more_tests._phi3, randomise),
    "olmo2": (more_tests._olmo2, randomise),
    "granite": (more_tests._granite, randomise),
}


class Checkpoint(NamedTuple):
    path: Path
    family: str
    sequences: list[list[int]]  # each prompt and the unquantized engine's greedy completion
    logits: torch.Tensor  # [positions, V] the unquantized engine's over the sequences


MODULE_TYPES = {"int8": Int8Linear, "fp8": Fp8Linear}
# Per method: (min top-1 agreement over all positions, max and mean |logit error| / logit
# range, the lead / logit range of an unquantized top-1 that must survive).
BOUNDS = {"int8": (0.9, 0.08, 0.03, 0.05), "fp8": (0.7, 0.35, 0.15, 0.15)}


@pytest.fixture(params=sorted(FAMILIES), scope="module")
def checkpoint(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Checkpoint:
    """A tiny random checkpoint of the family, the unquantized engine's greedy sequences over
    it (each prompt and its completion), and that engine's logits on them."""
    from transformers import AutoModelForCausalLM

    make_config, randomise_weights = FAMILIES[request.param]
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(make_config(), dtype=torch.float32).eval()
    randomise_weights(model)
    path = tmp_path_factory.mktemp(f"{request.param}_quant")
    model.save_pretrained(str(path), safe_serialization=True)
    reference = _llm(path, None)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW_TOKENS, ignore_eos=True)
    outputs = reference.generate(PROMPTS, params, use_tqdm=False)
    sequences = [p + list(o.outputs[0].token_ids) for p, o in zip(PROMPTS, outputs, strict=True)]
    logits = torch.cat(prefill_logits(reference.core.model, sequences))  # [positions, V]
    return Checkpoint(path, request.param, sequences, logits)


def _llm(path: Path, quantization: str | None, device: str = "cpu") -> LLM:
    return LLM(
        str(path), device=device, dtype="float32", num_blocks=64, block_size=4, max_model_len=128,
        quantization=quantization,
    )  # fmt: skip


@pytest.mark.parametrize(
    "device",
    ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"))],
)
@pytest.mark.parametrize("method", sorted(MODULE_TYPES))
def test_quantized_logits_stay_close_to_the_unquantized_model(checkpoint: Checkpoint, method: str, device: str) -> None:
    """On CUDA the quantized model runs the Triton and fp8 kernels; the reference is the CPU's."""
    path, family, sequences, ref = checkpoint
    quantized = _llm(path, method, device)
    for layer in quantized.core.model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        for linear in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj):
            assert isinstance(linear, MODULE_TYPES[method]), f"{family}: {type(linear).__name__}"
    got = torch.cat(prefill_logits(quantized.core.model, sequences)).cpu()
    agree = ref.argmax(-1) == got.argmax(-1)
    top2 = ref.topk(2, dim=-1).values
    spread = ref.amax(-1) - ref.amin(-1)  # [positions]
    min_agreement, max_error, max_mean_error, confident_lead = BOUNDS[method]
    confident = top2[:, 0] - top2[:, 1] > confident_lead * spread
    error = (got - ref).abs().amax(-1) / spread
    report = (f"{family} {method}: top-1 agreement {float(agree.float().mean()):.3f}, max error "
              f"{float(error.max()):.4f}, mean {float(error.mean()):.4f} of the logit range, "
              f"{int(confident.sum())} of {len(ref)} positions confident")  # fmt: skip
    assert int(confident.sum()) >= 2 and bool(agree[confident].all()), report
    assert float(agree.float().mean()) >= min_agreement, report
    assert float(error.max()) <= max_error and float(error.mean()) <= max_mean_error, report
    assert float(error.max()) > 0, "the quantized model computed exactly the unquantized logits"


# name -> (a tiny config of the family, the words its refusal must say)
REFUSED: dict[str, tuple[Callable[[], Any], str]] = {
    "qwen2_moe": (more_tests._qwen2_moe, "routed experts"),
    "qwen3_moe": (more_tests._qwen3_moe, "routed experts"),
    "deepseek_v2": (deepseek_tests._v2_lite, "multi-head latent attention"),
}


@pytest.mark.parametrize("family", sorted(REFUSED))
@pytest.mark.parametrize("method", sorted(MODULE_TYPES))
def test_moe_and_mla_families_are_refused_by_name(family: str, method: str, tmp_path: Path) -> None:
    """Refused at start, before any weight loads (load_format dummy would fill them)."""
    make_config, message = REFUSED[family]
    config = make_config()
    config.save_pretrained(str(tmp_path))
    architecture = type(config).__name__.replace("Config", "ForCausalLM")
    with pytest.raises(ConfigError, match=message):
        LLM(str(tmp_path), load_format="dummy", device="cpu", num_blocks=64, block_size=4, max_model_len=128,
            quantization=method, hf_overrides={"architectures": [architecture]})
