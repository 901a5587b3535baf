"""Programmatic dependent launch (kernels/sync/pdl.py) in the batch-1 decode chain.

Every kernel of the chain may start while the one before it is still running and reads
its inputs only after `gdc_wait()`. A missing or misplaced wait would read stale data: the
chain below (norm -> bf16 GEMV -> SiLU-and-mul -> fp8 GEMV -> norm -> bf16 qkv GEMV ->
rotary + KV write -> decode attention (split, combine) -> INT4 GEMV -> ..., every other
layer with SiLU-and-mul fused into the GEMV and the rotary + KV write into the attention,
the INT4 product in turn the rows GEMV, the tensor-core kernel and the pairs GEMV) is replayed
from one CUDA graph with PDL on and must equal, bit for bit, the same kernels launched
eagerly with PDL off. Each step's input is the previous step's output, and the residual
chain makes every stale read visible in the result. Needs compute capability 9.0 (Hopper);
elsewhere the flag is off and the kernels ignore both instructions (the other kernel tests
cover them).
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from vllm_cluster.engine.quantization.fp8 import quantize_fp8
from vllm_cluster.engine.quantization.int4_pack import pack_gptq, quantize_rtn
from vllm_cluster.kernels.attention import dispatch as attention_ops
from vllm_cluster.kernels.attention.metadata import AttentionMetadata
from vllm_cluster.kernels.elementwise import dispatch as elementwise_ops
from vllm_cluster.kernels.int4 import dispatch as int4_ops
from vllm_cluster.kernels.int4.layouts import gptq_to_pairs, gptq_to_rows
from vllm_cluster.kernels.int4.triton_mma import int4_mma, pick_mma_config
from vllm_cluster.kernels.int4.weight import Int4Weight
from vllm_cluster.kernels.linear import dispatch as linear_ops
from vllm_cluster.kernels.linear.dispatch import fp8_linear
from vllm_cluster.kernels.sync import pdl

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0),
    reason="needs a CUDA GPU of compute capability 9.0+",
)

D, INTER, HEADS, KV_HEADS, HEAD_DIM, BLOCK = 1024, 2816, 8, 2, 128, 16


def _chain(num_layers: int = 6) -> Callable[[torch.Tensor], torch.Tensor]:
    g = torch.Generator(device="cuda").manual_seed(0)

    def randn(*shape: int, std: float = 0.03) -> torch.Tensor:
        return (std * torch.randn(*shape, generator=g, device="cuda")).to(torch.bfloat16)

    norm_w = [1.0 + randn(D, std=0.1) for _ in range(2 * num_layers)]
    gate_up = [randn(2 * INTER, D) for _ in range(num_layers)]
    down = [quantize_fp8(randn(D, INTER).float()) for _ in range(num_layers)]
    qkv_proj = [randn((HEADS + 2 * KV_HEADS) * HEAD_DIM, D) for _ in range(num_layers)]
    o_int4 = []
    for _ in range(num_layers):
        packed = pack_gptq(quantize_rtn(randn(D, HEADS * HEAD_DIM).float().cpu(), 128, sym=False, min_zero=0), 0)
        repack = gptq_to_pairs if len(o_int4) % 2 else gptq_to_rows
        o_int4.append((repack(packed["qweight"]).cuda(), packed["qzeros"].cuda(), packed["scales"].cuda()))
    num_blocks, seq_len = 64, 300
    kv_cache = randn(num_blocks, 2, BLOCK, KV_HEADS, HEAD_DIM, std=1.0)
    angles = (seq_len - 1) * torch.rand(1, HEAD_DIM // 2, generator=g, device="cuda")
    cos, sin = angles.cos(), angles.sin()
    block_table = torch.randperm(num_blocks, generator=g, device="cuda").to(torch.int32)[None, :]
    last = seq_len - 1  # the new token's slot: rotary + KV write fills it, attention reads it
    meta = AttentionMetadata(
        slot_mapping=(block_table[0, last // BLOCK].long() * BLOCK + last % BLOCK).reshape(1),
        block_tables=block_table,
        seq_lens=torch.tensor([seq_len], dtype=torch.int32, device="cuda"),
        query_start_loc=torch.tensor([0, 1], dtype=torch.int32, device="cuda"),
        max_query_len=1,
        max_seq_len=4096,
    )

    def run(x: torch.Tensor) -> torch.Tensor:
        residual = None
        for i in range(num_layers):
            h, residual = elementwise_ops.fused_add_rms_norm(x, residual, norm_w[2 * i], 1e-5)
            if i % 2:  # bf16 GEMV with SiLU-and-mul fused (lets down launch after its loop)
                act = linear_ops.linear_silu_mul(h, gate_up[i])
            else:  # bf16 GEMV, then SiLU-and-mul
                act = elementwise_ops.silu_and_mul(linear_ops.linear(h, gate_up[i]))
            x = fp8_linear(act, down[i][0], down[i][1][None, :], None)  # fp8 GEMV
            h, residual = elementwise_ops.fused_add_rms_norm(x, residual, norm_w[2 * i + 1], 1e-5)
            qkv = linear_ops.linear(h, qkv_proj[i])
            q, k, v = qkv.split([HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM], dim=-1)
            q, k, v = q.view(1, HEADS, HEAD_DIM), k.view(1, KV_HEADS, HEAD_DIM), v.view(1, KV_HEADS, HEAD_DIM)
            if i % 2:  # decode attention rotating and caching the new token itself
                attn = attention_ops.rotary_paged_attention(q, k, v, cos, sin, kv_cache, meta, HEAD_DIM**-0.5)
            else:  # rotary + KV write, then decode attention (split + combine)
                q, k = attention_ops.rotary_write_kv_cache(q, k, v, cos, sin, kv_cache, meta.slot_mapping)
                attn = attention_ops.paged_attention(q, k, k, kv_cache, meta, HEAD_DIM**-0.5)
            qweight, qzeros, scales = o_int4[i]
            weight = Int4Weight(qweight, qzeros, scales, None, 128, "pairs" if i % 2 else "rows", 0)
            if i % 4 == 1:  # the INT4 tensor-core kernel (reads its first weights before the wait)
                config = pick_mma_config(1, D, HEADS * HEAD_DIM, 132, early=True)
                x = int4_mma(attn.view(1, -1), weight, None, config)
            else:  # the INT4 GEMV on the rows layout, or (i % 4 == 3) on the pairs layout
                x = int4_ops.int4_gemm(attn.view(1, -1), weight)
        return x + residual

    return run


def test_chain_replayed_with_pdl_equals_eager_without(monkeypatch: pytest.MonkeyPatch) -> None:
    run = _chain()
    x = torch.randn(1, D, generator=torch.Generator(device="cuda").manual_seed(1), device="cuda").to(torch.bfloat16)
    monkeypatch.setattr(pdl, "ENABLED", False)
    expected = run(x)
    monkeypatch.setattr(pdl, "ENABLED", True)
    assert pdl.enabled(x)
    static_x = x.clone()
    run(static_x)  # compile the PDL variants outside the capture
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
        static_out = run(static_x)
    torch.cuda.current_stream().wait_stream(stream)
    for _ in range(20):
        static_x.copy_(torch.randn_like(x, dtype=torch.float32).to(x.dtype))
        graph.replay()
        torch.testing.assert_close(static_out, run_eager_without_pdl(run, static_x, monkeypatch), atol=0, rtol=0)
    static_x.copy_(x)
    graph.replay()
    torch.testing.assert_close(static_out, expected, atol=0, rtol=0)


def run_eager_without_pdl(
    run: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, monkeypatch: pytest.MonkeyPatch
) -> torch.Tensor:
    monkeypatch.setattr(pdl, "ENABLED", False)
    try:
        return run(x)
    finally:
        monkeypatch.setattr(pdl, "ENABLED", True)
