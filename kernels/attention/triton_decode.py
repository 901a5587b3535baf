"""Paged decode attention in Triton: flash-decoding over the paged KV cache, GQA-grouped.

Semantics are those of `kernels.attention.reference.decode_attention`. Two launches:
  1. `decode_split_kernel` (kernels/attention/triton_decode_kernel.py), grid (B, num_kv_heads,
     num_splits): one program serves all the query heads of one KV head (each K/V tile is read
     once for the group) over one split, a contiguous range of the sequence's tokens, in
     tiles of TILE_N tokens that may span KV blocks (each token finds its block through the
     block table). It keeps an fp32 online
     softmax and writes a partial (max, sum, acc) per query head, or, when there is one
     split, the normalised output directly (and launch 2 is skipped).
  2. `combine_splits_kernel` (kernels/attention/triton_decode_combine.py), grid (B, Hq): rescales the
     partials to a common max and sums.
On Hopper both start early and wait for the kernel before (PDL, kernels/sync/pdl.py).

`rotary_decode_attention` (what the engine runs for a decode-only batch on CUDA) folds the
rotary + KV write launch of the new token into launch 1: every split rotates q and the new
k in registers, attends over the cached tokens (the new token's slot excluded) and then
over the new token itself, and the first split of each KV head stores the new k and v in
the cache (the rotary helpers live in kernels/attention/triton_rotary_kv.py). One launch fewer per
layer: -56 us a batch-1 step for bf16, -69 for int8 on the H200 (docs/benchmarks.md). Its
splits also load their first tile of cached K/V before the PDL wait (EARLY_FIRST_TILE).

Launch shapes depend only on tensor shapes and `max_seq_len` (never on the values in
`seq_lens`), and nothing syncs with the host, so the call can be captured in a CUDA graph.
A split whose range is empty (a short sequence, a padding row) writes (-inf, 0, 0); a
sequence of length 0 gets zeros. An fp8 cache (kernels/attention/fp8_kv.py) is upcast to q's dtype
(exact) as it is loaded; k_scale is folded into the softmax scale and v_scale into the
partial sums, both read from device memory (a CUDA graph replays them). A sliding window
(a layer's, or None) limits each row to its last `sliding_window` tokens: the splits share
out only those, so a long context costs what the window does. A soft-cap (a layer's
attn_logit_softcapping, or None) caps every score before the softmax
(kernels/attention/triton_softcap.py).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch
import triton

from vllm_cluster.kernels.attention.fp8_kv import is_fp8
from vllm_cluster.kernels.attention.triton_decode_combine import combine_splits_kernel
from vllm_cluster.kernels.attention.triton_decode_kernel import decode_split_kernel
from vllm_cluster.kernels.sync import pdl

_MIN_TOKENS_PER_SPLIT = 128  # below this a split's fixed cost (q load, partial write) shows
_MAX_NUM_SPLITS = 64  # bounds the combine kernel's [splits, head_dim] register tile
_PROGRAMS_PER_SM = 4  # resident programs per SM to hide HBM latency
# rotary_decode_attention: each split loads its first tile of cached K/V (and the sequence's
# length and block table entries) before waiting for the qkv projection (PDL), so those
# loads overlap the projection's tail. Safe there (and only there): the cached tokens, the
# lengths and the block tables are written by ordinary launches that finish before the
# PDL chain's first kernel starts (kernels/sync/pdl.py), and the one slot this step writes (the
# new token's) is not among the tokens read. bf16 -77 us a batch-1 step, fp8 -60 on the
# H200 (docs/benchmarks.md).
EARLY_FIRST_TILE = True


def _tile_config(head_dim_pad: int, kv_fp8: bool, q_dtype: torch.dtype) -> tuple[int, int, bool]:
    """(TILE_N, num_stages, FP16_DOT). An fp8 cache moves half the bytes per tile, so it takes
    twice the tokens and one more stage to keep as many bytes in flight, and upcasts to fp16
    (one conversion instruction per two values, exact for e4m3) rather than bf16. Measured on
    the H200, batch 64 x 2k context (docs/benchmarks.md): fp8 121 us with these, 151 us with
    bf16 dots, 189 us with the bf16 cache's tiles; the bf16 cache 137 us (93% of copy).
    fp32 queries keep fp32 dots (the tests' precision)."""
    if kv_fp8:
        return (128 if head_dim_pad <= 128 else 64), 3, q_dtype != torch.float32
    return (64 if head_dim_pad <= 128 else 32), 2, False


_DEFAULT_NUM_SMS = 132  # H100/H200; used when q is not on a CUDA device


@dataclass(frozen=True, slots=True)
class NewTokens:
    """Each sequence's new token for `rotary_decode_attention`: k and v [B, Hkv, D] not yet
    rotated, cos / sin [B, D / 2] fp32, slot_mapping [B] (-1: not cached)."""

    k: torch.Tensor
    v: torch.Tensor
    cos: torch.Tensor
    sin: torch.Tensor
    slot_mapping: torch.Tensor


@functools.lru_cache(maxsize=8)
def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return _DEFAULT_NUM_SMS
    return torch.cuda.get_device_properties(device).multi_processor_count


def choose_num_splits(batch_size: int, num_kv_heads: int, max_seq_len: int, num_sms: int) -> int:
    """Enough splits that B * Hkv * splits fills the SMs a few programs deep, but none
    shorter than _MIN_TOKENS_PER_SPLIT tokens."""
    num_programs = max(1, batch_size * num_kv_heads)
    by_occupancy = round(_PROGRAMS_PER_SM * num_sms / num_programs)
    by_length = triton.cdiv(max(1, max_seq_len), _MIN_TOKENS_PER_SPLIT)
    return max(1, min(by_occupancy, by_length, _MAX_NUM_SPLITS))


def decode_attention(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    num_splits: int | None = None,
    max_seq_len: int | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """q: [B, Hq, D], one new token per sequence -> [B, Hq, D] in q's dtype.

    kv_cache: [num_blocks, 2, block_size, Hkv, D] contiguous, q's dtype or fp8 (then with
    k_scale, v_scale: [1] fp32); block_tables: [B, max_num_blocks] int32 (int64 works too);
    seq_lens: [B] (0 = padding row, zeros out). `max_seq_len` bounds the context lengths and
    only steers the automatic `num_splits`; for CUDA graphs pass the same value at capture
    and replay.
    """
    return _decode(
        q, kv_cache, block_tables, seq_lens, scale, num_splits, max_seq_len, k_scale, v_scale, None, sliding_window,
        softcap,
    )


def rotary_decode_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    num_splits: int | None = None,
    max_seq_len: int | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """`rotary_write_kv_cache` (kernels/attention/dispatch.py) of the new tokens, then `decode_attention`, with no
    launch between them: q [B, Hq, D], k and v [B, Hkv, D] (not rotated; views of the qkv
    projection do), cos / sin [B, D / 2] fp32, slot_mapping [B]: the slot of each sequence's
    new token, which is its position seq_lens[b] - 1 (-1 with seq_lens[b] = 0: a padding
    row). Every split rotates q and the new k in registers and attends over the cached
    tokens plus the new one; the first split of each KV head writes the new k and v into
    the cache, with the roundings of `rotary_write_kv_cache`. q, k and v are not modified.
    """
    num_tokens, _, head_dim = q.shape
    num_kv_heads = kv_cache.shape[3]
    assert k.shape == v.shape == (num_tokens, num_kv_heads, head_dim), (k.shape, v.shape, q.shape)
    assert k.stride(-1) == 1 and v.stride(-1) == 1, "k and v need contiguous heads"
    assert head_dim % 2 == 0, f"head_dim {head_dim} must be even for rotate-half rotary"
    assert slot_mapping.shape == (num_tokens,) and seq_lens.shape == (num_tokens,), "one new token per sequence"
    cos = cos.reshape(num_tokens, head_dim // 2)
    sin = sin.reshape(num_tokens, head_dim // 2)
    assert cos.stride(-1) == 1 and sin.stride(-1) == 1
    new = NewTokens(k, v, cos, sin, slot_mapping)
    return _decode(
        q, kv_cache, block_tables, seq_lens, scale, num_splits, max_seq_len, k_scale, v_scale, new, sliding_window,
        softcap,
    )


def _new_partials(
    q: torch.Tensor, num_splits: int, head_dim_pad: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Uninitialised split partials (max, sum, acc) for q [B, Hq, D]: fp32 [B, Hq, S], [B, Hq,
    S] and [B, Hq, S, head_dim_pad]. Every split writes its own, an empty one (-inf, 0, 0)."""
    part_max = q.new_empty((*q.shape[:2], num_splits), dtype=torch.float32)
    return part_max, torch.empty_like(part_max), q.new_empty((*part_max.shape, head_dim_pad), dtype=torch.float32)


def _decode(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    num_splits: int | None,
    max_seq_len: int | None,
    k_scale: torch.Tensor | None,
    v_scale: torch.Tensor | None,
    new: NewTokens | None,
    sliding_window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Both launches; `new`: rotate and cache the new tokens first (`rotary_decode_attention`)."""
    batch_size, num_heads, head_dim = q.shape
    _, _, block_size, num_kv_heads, kv_head_dim = kv_cache.shape
    assert kv_head_dim == head_dim and num_heads % num_kv_heads == 0
    assert kv_cache.is_contiguous() and q.stride(-1) == 1
    assert block_tables.shape[0] == batch_size and seq_lens.shape == (batch_size,)
    kv_fp8 = is_fp8(kv_cache.dtype)
    assert kv_fp8 or kv_cache.dtype == q.dtype, f"kv_cache is {kv_cache.dtype}, q is {q.dtype}"
    assert not kv_fp8 or (k_scale is not None and v_scale is not None), "an fp8 cache needs k_scale and v_scale"
    assert sliding_window is None or sliding_window >= 1, f"sliding window {sliding_window}"
    assert softcap is None or softcap > 0, f"softcap {softcap}"
    if max_seq_len is None:
        max_seq_len = block_tables.shape[1] * block_size
    head_dim_pad = max(16, triton.next_power_of_2(head_dim))
    tile_n, num_stages, fp16_dot = _tile_config(head_dim_pad, kv_fp8, q.dtype)
    if num_splits is None:
        # With a window the splits share at most window + one partial tile of tokens.
        max_read = max_seq_len if sliding_window is None else min(max_seq_len, sliding_window + tile_n)
        num_splits = choose_num_splits(batch_size, num_kv_heads, max_read, _num_sms(q.device))
    assert num_splits >= 1

    group = num_heads // num_kv_heads
    out = torch.empty_like(q)
    if num_splits == 1:
        part_max = part_sum = part_acc = out  # unused by the kernel
    else:
        part_max, part_sum, part_acc = _new_partials(q, num_splits, head_dim_pad)
    use_pdl = pdl.enabled(q)
    rotary = new if new is not None else NewTokens(q, q, q, q, seq_lens)  # any tensors: not read
    decode_split_kernel[(batch_size, num_kv_heads, num_splits)](
        q, kv_cache, block_tables, seq_lens, out, part_max, part_sum, part_acc,
        scale * math.log2(math.e),
        k_scale if kv_fp8 else seq_lens, v_scale if kv_fp8 else seq_lens,  # any pointer: not read
        rotary.k, rotary.v, rotary.cos, rotary.sin, rotary.slot_mapping, sliding_window or 0,
        q.stride(0), q.stride(1), rotary.k.stride(0), rotary.k.stride(1), rotary.v.stride(0), rotary.v.stride(1),
        rotary.cos.stride(0), rotary.sin.stride(0), out.stride(0), out.stride(1),
        kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3),
        block_tables.stride(0),
        GROUP=group,
        GROUP_PAD=max(16, triton.next_power_of_2(group)),
        HEAD_DIM=head_dim,
        HEAD_DIM_PAD=head_dim_pad,
        BLOCK_SIZE=block_size,
        TILE_N=tile_n,
        NUM_SPLITS=num_splits,
        # fp32 callers want fp32 results, not TF32; 16-bit inputs ignore this.
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        KV_FP8=kv_fp8,
        FP16_DOT=fp16_dot,
        PDL=use_pdl,
        ROTARY=new is not None,
        EARLY_TILE=new is not None and EARLY_FIRST_TILE,
        SLIDING=sliding_window is not None,
        SOFTCAP=float(softcap or 0.0),
        num_warps=4,
        num_stages=num_stages,
        launch_pdl=use_pdl,
    )  # fmt: skip
    if num_splits > 1:
        combine_splits_kernel[(batch_size, num_heads)](
            out, part_max, part_sum, part_acc, out.stride(0), out.stride(1),
            HEAD_DIM=head_dim,
            HEAD_DIM_PAD=head_dim_pad,
            NUM_SPLITS=num_splits,
            SPLITS_PAD=triton.next_power_of_2(num_splits),
            PDL=use_pdl,
            num_warps=4,
            launch_pdl=use_pdl,
        )  # fmt: skip
    return out
