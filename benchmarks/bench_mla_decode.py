"""Multi-head latent attention decode alone on the GPU (kernels/attention/triton_mla_decode.py),
DeepSeek-V3's shapes: 128 heads, latent 512 + rotary key 64 per token, bf16, paged blocks of
16 in shuffled order. Reports the bandwidth the kernel achieves over the latent cache it reads
(every context entry once; the queries and outputs are counted too) against a
device-to-device copy of the same number of bytes measured in the same run (read + write
counted, as copy bandwidth is quoted), for the engine's default tile configuration and for
the best of a small sweep. Each configuration's output is first checked against the torch
path (kernels/attention/mla_torch.py).

    PYTHONPATH=. python benchmarks/bench_mla_decode.py            # B=64, L=2048 and B=32, L=8192
    PYTHONPATH=. python benchmarks/bench_mla_decode.py --quick    # the default configuration only
"""

from __future__ import annotations

import argparse
import itertools
from collections.abc import Callable

import torch

from vllm_cluster.kernels.attention import mla_torch
from vllm_cluster.kernels.attention.metadata import AttentionMetadata
from vllm_cluster.kernels.attention.triton_mla_decode import mla_decode_attention

NUM_HEADS, LATENT, ROPE, BLOCK_SIZE = 128, 512, 64, 16
# (block_h, tile_n, num_warps, num_stages); the first is mla_decode_attention's default.
DEFAULT = (32, 32, 8, 2)
SWEEP = [DEFAULT, *itertools.product((16, 32, 64), (16, 32, 64), (4, 8), (1, 2))]
Config = tuple[int, int, int, int]


def _inputs(
    batch_size: int, seq_len: int, num_heads: int, device: torch.device, dtype: torch.dtype = torch.bfloat16
) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator(device=device).manual_seed(0)
    blocks_per_seq = seq_len // BLOCK_SIZE
    num_blocks = batch_size * blocks_per_seq
    q = torch.randn(batch_size, num_heads, LATENT + ROPE, device=device, dtype=dtype, generator=gen)
    cache = torch.randn(
        num_blocks, 1, BLOCK_SIZE, 1, LATENT + ROPE, device=device, dtype=dtype, generator=gen
    )
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


def bench(batch_size: int, seq_len: int, configs: list[Config], num_heads: int) -> list[Config]:
    """Prints each configuration's time and bandwidth; returns them fastest first."""
    from triton.testing import do_bench

    q, cache, tables, seq_lens = _inputs(batch_size, seq_len, num_heads, torch.device("cuda"))
    scale = (128 + ROPE) ** -0.5
    num_bytes = cache.numel() * cache.element_size() + q.numel() * 2 + batch_size * num_heads * LATENT * 2
    src = torch.empty(num_bytes, dtype=torch.uint8, device=q.device)
    dst = torch.empty_like(src)
    copy_ms = do_bench(lambda: dst.copy_(src))
    copy_gbps = 2 * num_bytes / copy_ms / 1e6  # read + write
    print(f"B={batch_size} L={seq_len} H={num_heads} R={LATENT} P={ROPE} block={BLOCK_SIZE} bf16: "
          f"{num_bytes / 2**20:.0f} MiB read; copy of the same bytes {copy_gbps:.0f} GB/s")  # fmt: skip
    results = []
    for block_h, tile_n, num_warps, num_stages in dict.fromkeys(configs):

        def run(bh: int = block_h, tn: int = tile_n, nw: int = num_warps, ns: int = num_stages) -> torch.Tensor:
            return mla_decode_attention(
                q, cache, tables, seq_lens, scale, LATENT, max_seq_len=seq_len,
                block_h=bh, tile_n=tn, num_warps=nw, num_stages=ns,
            )  # fmt: skip

        try:
            _check(run, q, cache, tables, seq_lens, scale)
            ms = do_bench(run)
        except Exception as e:  # a configuration that does not compile (registers, shared memory)
            print(f"  block_h={block_h} tile_n={tile_n} warps={num_warps} stages={num_stages}: {type(e).__name__}")
            continue
        gbps = num_bytes / ms / 1e6
        results.append((gbps, (block_h, tile_n, num_warps, num_stages), ms))
        tag = " (default)" if (block_h, tile_n, num_warps, num_stages) == DEFAULT else ""
        print(f"  block_h={block_h} tile_n={tile_n} warps={num_warps} stages={num_stages}{tag}: "
              f"{ms * 1e3:.1f} us, {gbps:.0f} GB/s, {gbps / copy_gbps:.2f} of copy")  # fmt: skip
    results.sort(reverse=True)
    if results:
        gbps, best, ms = results[0]
        print(f"  best: block_h={best[0]} tile_n={best[1]} warps={best[2]} stages={best[3]}: {ms * 1e3:.1f} us, "
              f"{gbps:.0f} GB/s, {gbps / copy_gbps:.2f} of copy")  # fmt: skip
    return [config for _, config, _ in results]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="the default configuration only")
    args = parser.parse_args()
    assert torch.cuda.is_available(), "the benchmark needs a CUDA device"
    ranked = bench(64, 2048, [DEFAULT] if args.quick else SWEEP, NUM_HEADS)
    bench(32, 8192, [DEFAULT, *ranked[:4]], NUM_HEADS)
    bench(64, 2048, [DEFAULT, (16, 32, 4, 2), (16, 64, 4, 2), *ranked[:2]], 16)  # DeepSeek-V2-Lite's 16 heads


if __name__ == "__main__":
    main()
