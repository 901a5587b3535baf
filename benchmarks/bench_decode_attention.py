"""Paged decode attention alone on the GPU (kernels/attention/triton_decode.py): batch 64 x
2k context, Hq 32 / Hkv 8, D 128, block 16, bf16, against a device-to-device copy measured
in the same run.

    PYTHONPATH=. python benchmarks/bench_decode_attention.py
"""

from __future__ import annotations

import torch

from vllm_cluster.kernels.attention.triton_decode import _num_sms, choose_num_splits, decode_attention


def bench_decode_attention() -> None:
    """Achieved HBM bandwidth of one decode attention call, and the copy bandwidth."""
    from triton.testing import do_bench

    assert torch.cuda.is_available(), "the benchmark needs a CUDA device"
    device = torch.device("cuda")
    batch_size, num_heads, num_kv_heads, head_dim, block_size = 64, 32, 8, 128, 16
    max_seq_len = 2048
    blocks_per_seq = max_seq_len // block_size
    num_blocks = batch_size * blocks_per_seq
    dtype = torch.bfloat16
    gen = torch.Generator(device=device).manual_seed(0)
    q = torch.randn(batch_size, num_heads, head_dim, device=device, dtype=dtype, generator=gen)
    kv_cache = torch.randn(
        num_blocks, 2, block_size, num_kv_heads, head_dim, device=device, dtype=dtype, generator=gen
    )
    perm = torch.randperm(num_blocks, device=device, generator=gen)
    block_tables = perm.view(batch_size, blocks_per_seq).to(torch.int32)
    seq_lens = torch.full((batch_size,), max_seq_len, device=device, dtype=torch.int32)
    scale = head_dim**-0.5

    num_splits = choose_num_splits(batch_size, num_kv_heads, max_seq_len, _num_sms(device))
    ms = do_bench(
        lambda: decode_attention(
            q, kv_cache, block_tables, seq_lens, scale, max_seq_len=max_seq_len
        )
    )
    kv_bytes = kv_cache.numel() * kv_cache.element_size()
    num_bytes = kv_bytes + 2 * q.numel() * q.element_size()

    src = torch.empty(256 * 2**20, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    copy_ms = do_bench(lambda: dst.copy_(src))
    copy_gbps = 2 * src.numel() / copy_ms / 1e6  # read + write

    gbps = num_bytes / ms / 1e6
    print(
        f"decode attention B={batch_size} L={max_seq_len} Hq={num_heads} Hkv={num_kv_heads} "
        f"D={head_dim} block={block_size} bf16 splits={num_splits}: {ms * 1e3:.1f} us, "
        f"{gbps:.0f} GB/s; copy {copy_gbps:.0f} GB/s; fraction {gbps / copy_gbps:.2f}"
    )


if __name__ == "__main__":
    bench_decode_attention()
