"""Multi-head latent attention decode alone on the GPU (kernels/attention/triton_mla_decode.py):
DeepSeek's latent 512 + rotary key 64 per token, bf16, paged blocks of 16 in shuffled order.

Reports the bandwidth the kernel achieves over the bytes it must read (every context entry
once, plus the queries and outputs) against a device-to-device copy of the same number of
bytes measured in the same run (read + write counted, as copy bandwidth is quoted), for the
default tile configuration and the best of a sweep. Each configuration's output is first
checked against the torch path (kernels/attention/mla_torch.py).

The absorbed form does 2 * (576 + 512) FLOPs per head per cached token against 1152 bytes
read: about 1.9 FLOP/B per head. With 16 heads (DeepSeek-V2-Lite, or V3's 128 heads split
8 ways) that is 30 FLOP/B, well under an H100/H200's bf16 roofline ridge (~200 FLOP/B): the
kernel is bandwidth-bound and the copy is the right yardstick. With all 128 heads on one GPU
it is 242 FLOP/B, past the ridge: there the tensor cores bound it, and the FLOP rate is
the number to read.

    PYTHONPATH=. python benchmarks/bench_mla_decode.py            # sweeps
    PYTHONPATH=. python benchmarks/bench_mla_decode.py --quick    # the default tiles only
"""

from __future__ import annotations

import argparse
import itertools
from collections.abc import Callable

import torch

from vllm_cluster.kernels.attention import mla_torch
from vllm_cluster.kernels.attention.metadata import AttentionMetadata
from vllm_cluster.kernels.attention.triton_decode import _num_sms
from vllm_cluster.kernels.attention.triton_mla_decode import (
    TileConfig,
    choose_mla_splits,
    default_tile_config,
    mla_decode_attention,
)

LATENT, ROPE, BLOCK_SIZE = 512, 64, 16
# One stage never won; three and four keep more of the context in flight per program.
SWEEP = [TileConfig(*c) for c in itertools.product((16, 32, 64), (16, 32, 64), (4, 8), (2, 3, 4))]
# A variant: tiles and a split count (None: the kernel's own choice, choose_mla_splits).
Variant = tuple[TileConfig, int | None]


def _inputs(
    batch_size: int, seq_len: int, num_heads: int, device: torch.device, dtype: torch.dtype = torch.bfloat16
) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator(device=device).manual_seed(0)
    blocks_per_seq = seq_len // BLOCK_SIZE
    num_blocks = batch_size * blocks_per_seq
    q = torch.randn(batch_size, num_heads, LATENT + ROPE, device=device, dtype=dtype, generator=gen)
    cache = torch.randn(num_blocks, 1, BLOCK_SIZE, 1, LATENT + ROPE, device=device, dtype=dtype, generator=gen)
    tables = torch.randperm(num_blocks, device=device, generator=gen).view(batch_size, blocks_per_seq).int()
    seq_lens = torch.full((batch_size,), seq_len, device=device, dtype=torch.int32)
    return q, cache, tables, seq_lens


def _check(run: Callable[[], torch.Tensor], q: torch.Tensor, cache: torch.Tensor, tables: torch.Tensor,
           seq_lens: torch.Tensor, scale: float) -> None:  # fmt: skip
    """The kernel's first two sequences against the torch path (bf16: loose tolerance)."""
    rows = 2
    meta = AttentionMetadata(
        slot_mapping=torch.zeros(rows, dtype=torch.long, device=q.device),
        block_tables=tables[:rows],
        seq_lens=seq_lens[:rows],
        query_start_loc=torch.arange(rows + 1, dtype=torch.int32, device=q.device),
        max_query_len=1,
        max_seq_len=int(seq_lens.max()),
    )
    expected = mla_torch.mla_attention(q[:rows], cache, meta, scale, LATENT)
    torch.testing.assert_close(run()[:rows].float(), expected.float(), atol=3e-2, rtol=3e-2)


def _describe(variant: Variant) -> str:
    tiles, splits = variant
    return (f"block_h={tiles.block_h} tile_n={tiles.tile_n} warps={tiles.num_warps} stages={tiles.num_stages} "
            f"splits={'auto' if splits is None else splits}")  # fmt: skip


def bench(batch_size: int, seq_len: int, num_heads: int, sweep: list[Variant]) -> list[Variant]:
    """Prints the default's and each swept variant's time, bandwidth and FLOP rate; returns
    the variants fastest first."""
    from triton.testing import do_bench

    q, cache, tables, seq_lens = _inputs(batch_size, seq_len, num_heads, torch.device("cuda"))
    scale = (128 + ROPE) ** -0.5
    num_bytes = cache.numel() * cache.element_size() + q.numel() * 2 + batch_size * num_heads * LATENT * 2
    flops = 2 * batch_size * seq_len * num_heads * (LATENT + ROPE + LATENT)
    src = torch.empty(num_bytes, dtype=torch.uint8, device=q.device)
    dst = torch.empty_like(src)
    copy_ms = do_bench(lambda: dst.copy_(src))
    copy_gbps = 2 * num_bytes / copy_ms / 1e6  # read + write
    default: Variant = (default_tile_config(num_heads), None)
    block_h = min(default[0].block_h, max(16, num_heads))
    auto_splits = choose_mla_splits(batch_size, num_heads, -(-num_heads // block_h), seq_len, _num_sms(q.device))
    print(f"B={batch_size} L={seq_len} H={num_heads} R={LATENT} P={ROPE} block={BLOCK_SIZE} bf16: "
          f"{num_bytes / 2**20:.0f} MiB read, {flops / num_bytes:.0f} FLOP/B; "
          f"copy of the same bytes {copy_gbps:.0f} GB/s; default splits {auto_splits}")  # fmt: skip
    results = []
    for variant in dict.fromkeys([default, *sweep]):

        def run(variant: Variant = variant) -> torch.Tensor:
            tiles, splits = variant
            return mla_decode_attention(
                q, cache, tables, seq_lens, scale, LATENT, max_seq_len=seq_len, num_splits=splits, tiles=tiles
            )

        try:
            _check(run, q, cache, tables, seq_lens, scale)
            ms = do_bench(run)
        except Exception as e:  # a configuration that does not compile (registers, shared memory)
            print(f"  {_describe(variant)}: {type(e).__name__}")
            continue
        gbps = num_bytes / ms / 1e6
        results.append((gbps, variant, ms))
        tag = " (default)" if variant == default else ""
        print(f"  {_describe(variant)}{tag}: {ms * 1e3:.1f} us, {gbps:.0f} GB/s = {gbps / copy_gbps:.2f} of copy, "
              f"{flops / ms / 1e9:.0f} TFLOP/s")  # fmt: skip
    results.sort(key=lambda r: -r[0])
    if results:
        gbps, best, ms = results[0]
        print(f"  best: {_describe(best)}: {ms * 1e3:.1f} us, {gbps:.0f} GB/s = {gbps / copy_gbps:.2f} of copy, "
              f"{flops / ms / 1e9:.0f} TFLOP/s")  # fmt: skip
    return [variant for _, variant, _ in results]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="the default tiles only")
    args = parser.parse_args()
    assert torch.cuda.is_available(), "the benchmark needs a CUDA device"
    small_heads: list[Variant] = [(t, None) for t in SWEEP if t.block_h == 16]
    ranked = bench(64, 2048, 16, [] if args.quick else small_heads)  # bandwidth-bound: the headline
    if not args.quick:  # the split count, for the two best tile configurations
        ranked = bench(64, 2048, 16, [(t, n) for t, _ in ranked[:2] for n in (1, 2, 4, 8, 16)])
    bench(32, 8192, 16, ranked[:3])
    bench(128, 1024, 16, ranked[:3])
    all_heads: list[Variant] = [(t, None) for t in SWEEP if t.block_h >= 32 and t.tile_n <= 32]
    bench(64, 2048, 128, [] if args.quick else all_heads)  # compute-bound: read the FLOP rate


if __name__ == "__main__":
    main()
