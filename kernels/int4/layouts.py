"""INT4 layouts for decode: GPTQ's weights repacked at load so that each output's inputs are
contiguous, which is what a batch-1 GEMV wants. Two of them, both qweight int32 [N, K/8]
(row n holds output n; inputs in blocks of ROW_BLOCK = 128), zeros and scales GPTQ's, and a
reordering of the second's words:

  "rows"   nibble j (bits 4j..4j+3) of word w of block b holds input 128 b + 16 j + w:
           the j-th nibbles of a block's 16 words are 16 consecutive inputs.
  "pairs"  nibble i of word w of block b holds input 128 b + 32 (i % 4) + 2 w + i // 4:
           read as int16 halves, nibble p of half c holds input 128 b + 32 p + c, so the
           two halves of a word are adjacent inputs, what a tensor-core operand register
           holds (kernels/int4/triton_mma.py); the CUDA-core GEMV reads it too.
  "tiles"  the pairs words in the order the MMA GEMV's lanes read them, int32
           [N/16, K/128, 256]: tile r of 16 outputs, block b, lane (g, t) = (l // 4, l % 4)
           at words 8 l .. 8 l + 7 = pairs words 16 b + 4 t .. + 3 of output 16 r + g, then
           of output 16 r + g + 8. A warp's block is then 1 KB in one piece, and a tile's
           weight one run of 16 K / 2 bytes (the pairs layout has 16 runs of 64 bytes per
           block, 2 KB apart at K = 4096): the MMA GEMV 0.91-0.96x its time on the pairs
           layout on llama-3.1-8b's gate_up, 0.94-0.97x over a layer, batch-1 decode 2.110
           -> 2.044 ms (benchmarks/bench_int4_mma_gemv.py --layout tiles, benchmarks/bench_quant_gpu.py).

kernels/int4/triton_rows.py reads rows and pairs at one row of x (its `pairs` flag),
kernels/int4/triton_rows_dot.py "rows" at 2..128 rows; kernels/int4/triton_mma.py and the MMA
GEMV read "pairs" and "tiles" (`tiled`). Int4Linear repacks into DECODE_LAYOUT where the
layout fits (`tiles_layout_fits`: 16-output tiles, groups of whole blocks;
`pairs_layout_fits`: runs of 32 inputs within a group; `rows_layout_fits`: runs of 16),
else into the next of tiles, pairs, rows that fits, else keeps GPTQ's. The torch functions
here are the definition: `rows_to_gptq(gptq_to_rows(w)) == w`,
`unpack_pairs_layout(gptq_to_pairs(w)) == unpack_rows(w)`, `tiles_to_pairs(pairs_to_tiles(p))
== p`, and kernels/int4/reference.py dequantizes all three through them (the CPU path).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from vllm_cluster.kernels.int4.packing import unpack_rows

# The layout Int4Linear repacks GPTQ weights into (engine/quantization/int4_linear.py):
# "tiles", "pairs" (batch-1 3.037 ms against 3.080 for rows, and offline throughput 5,509
# tok/s against 4,256 on the H200, llama-3.1-8b; docs/benchmarks.md) or "rows".
DECODE_LAYOUT = "tiles"
ROW_BLOCK = 128  # inputs per block
TILE_ROWS = 16  # outputs per tile of the tiles layout (the MMA's 16 rows)
WORDS_PER_BLOCK = ROW_BLOCK // 8
_CHUNK = 4096  # outputs repacked at a time (bounds the int64 temporaries)


def rows_layout_fits(in_features: int, group_size: int) -> bool:
    """Whether a GPTQ weight of these inputs (groups of consecutive inputs, -1: one group)
    can be held in the rows layout: whole blocks, and no 16-input run across two groups."""
    group = in_features if group_size == -1 else group_size
    return in_features % ROW_BLOCK == 0 and group % 16 == 0 and (ROW_BLOCK % group == 0 or group % ROW_BLOCK == 0)


def _pack_last(values: torch.Tensor) -> torch.Tensor:
    """int [..., 8] values 0..15 -> int32 [...]: value j in nibble j."""
    shifts = torch.arange(0, 32, 4, dtype=torch.long, device=values.device)
    words = (values.long() << shifts).sum(dim=-1)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def _repack(qweight: torch.Tensor, words_of: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """GPTQ qweight [K/8, N] -> [N, K/8] words, _CHUNK outputs at a time: words_of maps
    values [K, n] to their words [n, K/8] in the new layout."""
    num_words, out_features = qweight.shape
    assert (num_words * 8) % ROW_BLOCK == 0, f"{num_words * 8} inputs are not whole blocks of {ROW_BLOCK}"
    parts = [words_of(unpack_rows(qweight[:, start : start + _CHUNK])) for start in range(0, out_features, _CHUNK)]
    return torch.cat(parts).contiguous()


def gptq_to_rows(qweight: torch.Tensor) -> torch.Tensor:
    """GPTQ qweight [K/8, N] -> rows qweight [N, K/8] (the same 4-bit values)."""

    def words_of(q: torch.Tensor) -> torch.Tensor:
        blocks = q.reshape(-1, 8, WORDS_PER_BLOCK, q.shape[1])  # [B, j, w, n]: input 128 b + 16 j + w
        return _pack_last(blocks.permute(3, 0, 2, 1)).reshape(q.shape[1], -1)  # [n, B, w] words

    return _repack(qweight, words_of)


def unpack_rows_layout(rows: torch.Tensor) -> torch.Tensor:
    """Rows qweight [N, K/8] -> [K, N] values 0..15 (what `unpack_rows` gives for GPTQ's)."""
    out_features, num_words = rows.shape
    shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=rows.device)
    nibbles = (rows.unsqueeze(-1) >> shifts) & 0xF  # [N, K/8, 8]: (n, 16 b + w, j)
    q = nibbles.reshape(out_features, -1, WORDS_PER_BLOCK, 8).permute(1, 3, 2, 0)  # [B, j, w, N]
    return q.reshape(num_words * 8, out_features)  # input 128 b + 16 j + w


def rows_to_gptq(rows: torch.Tensor) -> torch.Tensor:
    """Rows qweight [N, K/8] -> GPTQ qweight [K/8, N]."""
    out_features, num_words = rows.shape
    q = unpack_rows_layout(rows).reshape(num_words, 8, out_features)  # [K/8, i, N]: input 8 r + i
    return _pack_last(q.permute(0, 2, 1)).contiguous()


def pairs_layout_fits(in_features: int, group_size: int) -> bool:
    """Whether a GPTQ weight (groups of consecutive inputs, -1: one group) fits the pairs
    layout: whole blocks, and groups of whole runs of 32 inputs that tile the blocks."""
    group = in_features if group_size == -1 else group_size
    return in_features % ROW_BLOCK == 0 and group % 32 == 0 and (ROW_BLOCK % group == 0 or group % ROW_BLOCK == 0)


def gptq_to_pairs(qweight: torch.Tensor) -> torch.Tensor:
    """GPTQ qweight [K/8, N] -> pairs qweight [N, K/8] (the same 4-bit values)."""

    def words_of(q: torch.Tensor) -> torch.Tensor:
        blocks = q.reshape(-1, 4, WORDS_PER_BLOCK, 2, q.shape[1])  # [B, p, w, h, n]: input 128 b + 32 p + 2 w + h
        return _pack_last(blocks.permute(4, 0, 2, 3, 1).reshape(q.shape[1], -1, 8)).reshape(q.shape[1], -1)

    return _repack(qweight, words_of)


def unpack_pairs_layout(pairs: torch.Tensor) -> torch.Tensor:
    """Pairs qweight [N, K/8] -> [K, N] values 0..15."""
    out_features, num_words = pairs.shape
    shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=pairs.device)
    nibbles = (pairs.unsqueeze(-1) >> shifts) & 0xF  # [N, K/8, 8]: (n, 16 b + w, 4 h + p)
    q = nibbles.reshape(out_features, -1, WORDS_PER_BLOCK, 2, 4).permute(1, 4, 2, 3, 0)  # [B, p, w, h, N]
    return q.reshape(num_words * 8, out_features)


def tiles_layout_fits(in_features: int, output_sizes: list[int], group_size: int) -> bool:
    """Whether a GPTQ weight of these parts of outputs (one, or a fused layer's) fits the tiles
    layout: every part whole 16-output tiles (a SiLU-and-mul GEMV reads gate and up rows as
    tiles), and groups of whole blocks (the MMA GEMV reads one zero and scale a block)."""
    group = in_features if group_size == -1 else group_size
    whole_tiles = all(size % TILE_ROWS == 0 for size in output_sizes)
    return whole_tiles and in_features % ROW_BLOCK == 0 and group % ROW_BLOCK == 0


def pairs_to_tiles(pairs: torch.Tensor) -> torch.Tensor:
    """Pairs qweight [N, K/8] -> tiles qweight [N/16, K/128, 256] (the same words)."""
    out_features, num_words = pairs.shape
    assert out_features % TILE_ROWS == 0 and num_words % WORDS_PER_BLOCK == 0, pairs.shape
    # [r, h, g, b, t, c]: word 16 b + 4 t + c of output 16 r + 8 h + g -> [r, b, g, t, h, c]
    words = pairs.reshape(out_features // TILE_ROWS, 2, 8, num_words // WORDS_PER_BLOCK, 4, 4)
    return words.permute(0, 3, 2, 4, 1, 5).reshape(out_features // TILE_ROWS, -1, 256).contiguous()


def tiles_to_pairs(tiles: torch.Tensor) -> torch.Tensor:
    """Tiles qweight [N/16, K/128, 256] -> pairs qweight [N, K/8]."""
    num_tiles, num_blocks, _ = tiles.shape
    words = tiles.reshape(num_tiles, num_blocks, 8, 4, 2, 4).permute(0, 4, 2, 1, 3, 5)  # [r, h, g, b, t, c]
    return words.reshape(num_tiles * TILE_ROWS, num_blocks * WORDS_PER_BLOCK).contiguous()


def pairs_shape(qweight: torch.Tensor) -> tuple[int, int]:
    """(N, K) of a pairs [N, K/8] or tiles [N/16, K/128, 256] qweight."""
    if qweight.dim() == 3:
        return qweight.shape[0] * TILE_ROWS, qweight.shape[1] * ROW_BLOCK
    return qweight.shape[0], qweight.shape[1] * 8
