"""MoE routed experts under the online methods (engine/quantization/experts.py): the quantized
stack against its definition (each expert's products as kernels/linear/reference.py defines
the quantized linears), on both of SparseMoeBlock's paths; expert shards of a quantized
block; and quantized MoE models, dummy-loaded, holding 1-byte expert weights and nothing of
the unquantized ones."""

from __future__ import annotations

import copy
import gc
import weakref
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch.nn import functional as F

from vllm_cluster.engine import LLM, SamplingParams
from vllm_cluster.engine.loader import build_model
from vllm_cluster.engine.loader.presets import PRESETS
from vllm_cluster.engine.models import ModelArchConfig
from vllm_cluster.engine.models.mixtral import SparseMoeBlock, StackedExperts, route
from vllm_cluster.engine.parallel.expert import expert_range, moe_blocks
from vllm_cluster.engine.quantization import get_method
from vllm_cluster.engine.quantization.experts import W8Experts, W8Format
from vllm_cluster.engine.quantization.fp8 import FP8_EXPERTS
from vllm_cluster.engine.quantization.int8 import INT8_EXPERTS
from vllm_cluster.engine.quantization.swap import quantize_model
from vllm_cluster.kernels.linear import reference as linear_reference

HIDDEN, INTERMEDIATE, NUM_EXPERTS, TOP_K = 32, 48, 8, 2
FORMATS = {"int8": INT8_EXPERTS, "fp8": FP8_EXPERTS}
EXPERT_DTYPES = {"int8": torch.int8, "fp8": torch.float8_e4m3fn}
Product = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor]


def _block(seed: int = 0) -> SparseMoeBlock:
    torch.manual_seed(seed)
    block = SparseMoeBlock(HIDDEN, INTERMEDIATE, NUM_EXPERTS, TOP_K)
    with torch.no_grad():
        for param in block.parameters():
            param.normal_(0.0, 0.3)
        # Experts and rows of very different ranges: scales are per expert and output row.
        block.stack.w13_weight[3] *= 10
        block.stack.w2_weight[0, 0] *= 50
    return block


def _quantized(block: SparseMoeBlock, fmt: W8Format) -> SparseMoeBlock:
    stack = block.stack
    assert isinstance(stack, StackedExperts)
    quantized = copy.deepcopy(block)
    quantized.stack = W8Experts.quantize(fmt, stack.w13_weight.data, stack.w2_weight.data)
    return quantized


def _definition(block: SparseMoeBlock, x: torch.Tensor, product: Product) -> torch.Tensor:
    """One token at a time: each chosen expert's products as `product` (a reference of
    kernels/linear/reference.py) defines them on the stack's int8 / fp8 values and scales."""
    stack = block.stack
    assert isinstance(stack, W8Experts)
    out = torch.zeros_like(x)
    weights, expert_ids = route(block.gate(x), TOP_K)
    for t in range(x.shape[0]):
        for weight, e in zip(weights[t].tolist(), expert_ids[t].tolist(), strict=True):
            gate, up = product(x[t : t + 1], stack.w13_qweight[e], stack.w13_scale[e], None).chunk(2, dim=-1)
            out[t] += weight * product(F.silu(gate) * up, stack.w2_qweight[e], stack.w2_scale[e], None)[0]
    return out


@pytest.mark.parametrize("num_tokens", [1, 5, 37])
@pytest.mark.parametrize("method", sorted(FORMATS))
def test_quantized_stack_equals_its_definition(method: str, num_tokens: int) -> None:
    """fp8 runs weight-only up to FP8_WEIGHT_ONLY_MAX_ROWS rows a product, W8A8 above: at 37
    tokens the dense path (every expert on all 37 rows) is W8A8, while the grouped path's
    products take the rows routed to one expert, so there it is only held near the block."""
    block = _block()
    quantized = _quantized(block, FORMATS[method])
    x = torch.randn(num_tokens, HIDDEN, generator=torch.Generator().manual_seed(1))
    if method == "int8":
        grouped_product: Product | None = linear_reference.int8_linear_reference
        dense_product: Product = linear_reference.int8_linear_reference
    elif num_tokens <= linear_reference.FP8_WEIGHT_ONLY_MAX_ROWS:
        grouped_product = dense_product = linear_reference.fp8_weight_only_reference
    else:
        grouped_product, dense_product = None, linear_reference.fp8_w8a8_reference
    with torch.no_grad():
        weights, expert_ids = route(quantized.gate(x), TOP_K)
        grouped = quantized.forward_grouped(x, weights, expert_ids)
        dense = quantized.forward_dense(x, weights, expert_ids)
        if grouped_product is not None:
            torch.testing.assert_close(grouped, _definition(quantized, x, grouped_product), atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(dense, _definition(quantized, x, dense_product), atol=1e-4, rtol=1e-4)
        assert torch.equal(quantized(x), grouped)  # off CUDA, forward takes the grouped path
        exact = block.forward_grouped(x, weights, expert_ids)
    # And both stay near the unquantized block: a step of the format, not a wrong layout.
    for got in (grouped, dense):
        rel = float((got - exact).norm() / exact.norm())
        assert 0 < rel < (0.02 if method == "int8" else 0.1), rel


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit for bit (1-byte tensors compared as their bytes)."""
    if a.element_size() == 1:
        a, b = a.view(torch.uint8), b.view(torch.uint8)
    return torch.equal(a, b)


@pytest.mark.parametrize("method", sorted(FORMATS))
@pytest.mark.parametrize("ep_size", [2, 4])
def test_quantized_expert_shards_sum_to_the_whole_block(method: str, ep_size: int) -> None:
    whole = _quantized(_block(), FORMATS[method])
    # 16 rows at most: fp8 runs weight-only on both paths (W8A8 above, on the dense one alone).
    x = torch.randn(16, HIDDEN, generator=torch.Generator().manual_seed(2))
    partials = []
    with torch.no_grad():
        expected = whole(x)
        for rank in range(ep_size):
            block = copy.deepcopy(whole)
            experts = expert_range(NUM_EXPERTS, rank, ep_size)
            block.keep_experts(experts.start, len(experts))
            stack, full = block.stack, whole.stack
            assert isinstance(stack, W8Experts) and isinstance(full, W8Experts)
            assert block.num_local_experts == NUM_EXPERTS // ep_size
            for name in ("w13_qweight", "w13_scale", "w2_qweight", "w2_scale"):
                kept = getattr(stack, name)
                assert _same(kept, getattr(full, name)[experts.start : experts.stop]), name
                # a copy, not a view into the whole stack: the other experts' bytes are freed
                assert kept.untyped_storage().nbytes() == kept.numel() * kept.element_size()
            weights, expert_ids = route(block.gate(x), TOP_K)
            grouped = block.forward_grouped(x, weights, expert_ids)
            torch.testing.assert_close(block.forward_dense(x, weights, expert_ids), grouped, atol=1e-5, rtol=1e-5)
            partials.append(grouped)
    assert all(float(p.abs().max()) > 0 for p in partials)
    torch.testing.assert_close(sum(partials), expected, atol=1e-5, rtol=1e-5)


DEEPSEEK_SMALL = {
    "num_hidden_layers": 2, "hidden_size": 64, "intermediate_size": 128, "moe_intermediate_size": 32,
    "n_routed_experts": 8, "num_attention_heads": 4, "vocab_size": 512, "kv_lora_rank": 32,
    "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 16,
}  # fmt: skip
MODELS = {"mixtral-tiny": {}, "deepseek-v2-lite": DEEPSEEK_SMALL}


@pytest.mark.parametrize("preset", sorted(MODELS))
@pytest.mark.parametrize("method", sorted(FORMATS))
def test_dummy_loaded_moe_model_holds_one_byte_experts_and_generates(method: str, preset: str) -> None:
    """Every routed expert weight is int8 / fp8; the only full-precision tensors left in a MoE
    block are the router's and the scales (one fp32 per expert and output row)."""
    llm = LLM(preset, quantization=method, load_format="dummy", hf_overrides=MODELS[preset], device="cpu",
              dtype="float32", num_blocks=32, block_size=4, max_model_len=128)  # fmt: skip
    model: Any = llm.core.model
    blocks = moe_blocks(model)
    assert blocks
    for block in blocks:
        stack = block.stack
        assert isinstance(stack, W8Experts)
        e, two_i, d = stack.w13_qweight.shape
        assert stack.w13_qweight.dtype == stack.w2_qweight.dtype == EXPERT_DTYPES[method]
        assert tuple(stack.w2_qweight.shape) == (e, d, two_i // 2)
        # No parameter but the router's (gate; DeepSeek-V3's score bias): no unquantized expert.
        assert {n.rpartition(".")[0] for n, _ in block.named_parameters()} <= {"gate", "router"}
        full_precision = {name: t.shape for name, t in stack.named_buffers() if t.element_size() > 1}
        assert full_precision == {"w13_scale": (e, two_i), "w2_scale": (e, d)}
    out = llm.generate([[1, 5, 9, 17], [4, 8]], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True),
                       use_tqdm=False)  # fmt: skip
    assert [len(o.outputs[0].token_ids) for o in out] == [4, 4]


@pytest.mark.parametrize("method", sorted(FORMATS))
def test_quantizing_frees_the_unquantized_experts(method: str) -> None:
    """Nothing keeps the bf16 stacks alive once quantize_model has replaced them."""
    arch = ModelArchConfig.from_hf_dict(PRESETS["mixtral-tiny"])
    model = build_model(arch, torch.bfloat16, torch.device("cpu"))
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0.0, 0.02)
    stacks = [block.stack for block in moe_blocks(model)]
    unquantized = [weakref.ref(t) for s in stacks for t in (s, *s.parameters())]
    del stacks
    quantize_model(model, get_method(method))
    gc.collect()
    assert all(ref() is None for ref in unquantized), "an unquantized expert stack outlived quantize_model"
    for block in moe_blocks(model):
        bf16_bytes = 2 * block.num_experts * 3 * arch.hidden_size * block.intermediate_size
        stack_bytes = sum(t.numel() * t.element_size() for t in block.stack.buffers())
        assert stack_bytes < 0.55 * bf16_bytes  # 1-byte weights plus an fp32 scale per row


def test_fp8_experts_on_cuda_need_dimensions_divisible_by_16() -> None:
    """Checked before anything is allocated on the device (torch._scaled_mm's constraint)."""
    with pytest.raises(ValueError, match="divisible by 16.*use quantization 'int8'"):
        W8Experts(FP8_EXPERTS, 2, 24, 40, torch.device("cuda"))
    W8Experts(INT8_EXPERTS, 2, 24, 40, torch.device("cpu"))
