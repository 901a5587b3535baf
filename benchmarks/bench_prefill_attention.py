"""Prefill attention on the GPU: the Triton kernel (kernels/attention/triton_prefill.py) on a
fresh prompt, its default tiles and a sweep of others, against torch SDPA on the same context.

    PYTHONPATH=. python benchmarks/bench_prefill_attention.py
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

import torch
import triton
from triton.testing import do_bench

from vllm_cluster.kernels.attention.triton_prefill import PrefillTileConfig, default_tile_config, prefill_attention

SWEEP = (
    PrefillTileConfig(128, 32, num_warps=4, num_stages=3),
    PrefillTileConfig(128, 64, num_warps=4, num_stages=3),
    PrefillTileConfig(128, 64, num_warps=8, num_stages=2),
    PrefillTileConfig(64, 32, num_warps=4, num_stages=2),
    PrefillTileConfig(256, 32, num_warps=8, num_stages=2),
)


def bench(seq_len: int = 2048, num_heads: int = 32, num_kv_heads: int = 8, head_dim: int = 128,
          block_size: int = 16) -> None:
    """A fresh seq_len-token prompt: this kernel (default tiles, then a sweep) against SDPA."""
    device, dtype = "cuda", torch.bfloat16
    num_blocks = triton.cdiv(seq_len, block_size)
    torch.manual_seed(0)
    kv_cache = torch.randn(num_blocks, 2, block_size, num_kv_heads, head_dim, device=device,
                           dtype=dtype)
    block_tables = torch.randperm(num_blocks, device=device, dtype=torch.int32)[None, :]
    q = torch.randn(seq_len, num_heads, head_dim, device=device, dtype=dtype)
    query_start_loc = torch.tensor([0, seq_len], device=device, dtype=torch.int32)
    seq_lens = torch.tensor([seq_len], device=device, dtype=torch.int32)
    scale = 1.0 / math.sqrt(head_dim)
    out = torch.empty_like(q)

    # SDPA on the same context, gathered into [1, H, L, D] outside the timed region.
    blocks = kv_cache[block_tables[0].long()]  # [nb, 2, BS, Hkv, D]
    k = blocks[:, 0].flatten(0, 1).transpose(0, 1)[None].contiguous()  # [1, Hkv, L, D]
    v = blocks[:, 1].flatten(0, 1).transpose(0, 1)[None].contiguous()
    q_sdpa = q.transpose(0, 1)[None].contiguous()  # [1, Hq, L, D]

    def sdpa() -> torch.Tensor:
        return torch.nn.functional.scaled_dot_product_attention(
            q_sdpa, k, v, is_causal=True, scale=scale, enable_gqa=True)

    def run(config: PrefillTileConfig | None) -> torch.Tensor:
        return prefill_attention(q, kv_cache, block_tables, query_start_loc, seq_lens, scale,
                                 seq_len, out=out, config=config)

    max_err = (run(None).float() - sdpa()[0].transpose(0, 1).float()).abs().max().item()
    flops = 2 * 2 * num_heads * head_dim * seq_len * seq_len / 2

    def report(name: str, fn: Callable[[], torch.Tensor]) -> None:
        ms = do_bench(fn)
        print(f"{name:<36} {ms * 1e3:8.1f} us  {flops / (ms * 1e-3) / 1e12:6.1f} TFLOP/s")

    def label(c: PrefillTileConfig) -> str:
        return f"M{c.block_m} N{c.block_n} warps {c.num_warps} stages {c.num_stages}"

    print(f"prompt {seq_len} tokens, Hq={num_heads} Hkv={num_kv_heads} D={head_dim} bf16, "
          f"block {block_size}; max |triton - sdpa| = {max_err:.3e}")
    report("torch sdpa (is_causal, enable_gqa)", sdpa)
    default = default_tile_config(head_dim, dtype, seq_len, num_heads // num_kv_heads)
    report(f"triton {label(default)} (default)",
           lambda: run(None))
    for config in SWEEP:
        report(f"triton {label(config)}", functools.partial(run, config))


if __name__ == "__main__":
    if not torch.cuda.is_available():
        raise SystemExit("the benchmark needs a CUDA GPU; the tests cover CPU (TRITON_INTERPRET=1)")
    bench()
