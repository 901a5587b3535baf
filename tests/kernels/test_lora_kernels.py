"""Batched LoRA shrink/expand (kernels/lora/triton_shrink_expand.py, and the CPU path of kernels/lora/dispatch.py)
against the per-token reference, over a batch that mixes adapters and base tokens (-1).
Without a GPU the Triton kernels run under the interpreter on tiny fp32/fp16 shapes; the
token-block tests shrink the tiles so that a few dozen tokens span several blocks and K
several splits, whose partials the expand sums. The fused-part tests give one expand
several parts (q/k/v, gate/up) whose column ranges straddle column blocks."""

from __future__ import annotations

from types import ModuleType

import pytest
import torch

from vllm_cluster.kernels.lora import dispatch as lora_ops
from vllm_cluster.kernels.lora import reference as lora_reference
from vllm_cluster.kernels.lora import triton_shrink_expand
from vllm_cluster.kernels.lora.dispatch import SlotGroups

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOLERANCES = {torch.float32: 1e-5, torch.float16: 2e-3}
SLOTS = [2, -1, 0, 0, 2, -1, 1]  # 7 tokens: three adapters, two base tokens


def _inputs(dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(len(SLOTS), 40, generator=gen)  # [T, K]: K not a multiple of the K block
    a = torch.randn(3, 12, 40, generator=gen) / 6  # [L, N, K]
    b = torch.randn(3, 24, 6, generator=gen)  # [L, M, R]
    y = torch.randn(len(SLOTS), 30, generator=gen)  # [T, 30]: the expand writes columns 3..27
    return tuple(t.to(dtype) for t in (x, a, b, y))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("path", ["triton", "torch"])
def test_shrink_expand_match_reference(dtype: torch.dtype, path: str) -> None:
    impl: ModuleType = lora_ops
    if path == "triton":
        pytest.importorskip("triton")

        impl = triton_shrink_expand
    device = DEVICE if path == "triton" else "cpu"
    x, a, b, y = (t.to(device) for t in _inputs(dtype))
    slots = torch.tensor(SLOTS, device=device)
    s = impl.lora_shrink(x, a, slots)  # [S, T, N] partials
    expected_s = lora_reference.lora_shrink_reference(x, a, slots)
    torch.testing.assert_close(s.sum(0), expected_s, atol=TOLERANCES[dtype], rtol=TOLERANCES[dtype])
    assert not s[:, 1].any() and not s[:, 5].any()
    ours, expected = y.clone(), y.clone()
    impl.lora_expand_add(ours[:, 3:27], s[:, :, 2:8], b, slots)  # a rank slice, a column slice
    lora_reference.lora_expand_reference(expected[:, 3:27], expected_s[:, 2:8], b, slots)
    tol = TOLERANCES[dtype] * 10
    torch.testing.assert_close(ours, expected, atol=tol, rtol=tol)
    assert torch.equal(ours[1], y[1]) and torch.equal(ours[:, :3], y[:, :3])  # base rows, other columns
    assert not torch.equal(ours[0], y[0])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_grouped_path_matches_reference(dtype: torch.dtype) -> None:
    # The eager path: the caller hands the tokens of each slot (here on the test device).
    x, a, b, y = (t.to(DEVICE) for t in _inputs(dtype))
    slots = torch.tensor(SLOTS, device=DEVICE)
    groups: SlotGroups = [
        (slot, torch.tensor([t for t, v in enumerate(SLOTS) if v == slot], device=DEVICE)) for slot in (0, 1, 2)
    ]
    s = lora_ops.lora_shrink(x, a, slots, groups)
    expected_s = lora_reference.lora_shrink_reference(x, a, slots)
    assert s.shape == (1, *expected_s.shape)
    torch.testing.assert_close(s[0], expected_s, atol=TOLERANCES[dtype], rtol=TOLERANCES[dtype])
    ours, expected = y.clone(), y.clone()
    lora_ops.lora_expand_add(ours[:, 3:27], s[:, :, 2:8], b, slots, groups=groups)
    lora_reference.lora_expand_reference(expected[:, 3:27], expected_s[:, 2:8], b, slots)
    tol = TOLERANCES[dtype] * 10
    torch.testing.assert_close(ours, expected, atol=tol, rtol=tol)


def test_all_base_tokens_leave_output_alone() -> None:
    x, a, b, y = _inputs(torch.float32)
    slots = torch.full((len(SLOTS),), -1)
    s = lora_ops.lora_shrink(x, a, slots)
    ours = y.clone()
    lora_ops.lora_expand_add(ours[:, :24], s[:, :, :6], b, slots)
    assert not s.any() and torch.equal(ours, y)


# Token blocks of 16 (the smallest tl.dot takes), K = 40 in splits of 32 (the last ragged).
SMALL_TILES = dict(block_t=16, block_k=16, k_per_split=32)
SLOT_PATTERNS = {
    # prefill: runs of one slot crossing block edges (16, 32), then a mixed block; T = 45
    "runs": [0] * 20 + [2] * 9 + [-1] * 5 + [1] * 11,
    "one_slot": [1] * 33,  # every block uniform, the last one partly past T
    "decode": [t % 4 - 1 for t in range(18)],  # every block mixes all slots and the base
    "all_base": [-1] * 20,
}


def _block_inputs(slots: list[int], dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(len(slots), 40, generator=gen)  # [T, K]
    a = torch.randn(4, 20, 40, generator=gen) / 6  # [L, N, K]: N 20 spans two column blocks of 16
    b = torch.randn(4, 40, 6, generator=gen)  # [L, M, R]
    a[3], b[3] = float("nan"), float("nan")  # slot 3 is never used: reading it would show
    y = torch.randn(len(slots), 44, generator=gen)  # the expand writes columns 2..42
    return tuple(t.to(dtype).to(DEVICE) for t in (x, a, b, y))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("pattern", SLOT_PATTERNS)
def test_token_blocks_match_reference(dtype: torch.dtype, pattern: str) -> None:
    pytest.importorskip("triton")

    x, a, b, y = _block_inputs(SLOT_PATTERNS[pattern], dtype)
    slots = torch.tensor(SLOT_PATTERNS[pattern], device=DEVICE)
    s = triton_shrink_expand.lora_shrink(x, a, slots, triton_shrink_expand.ShrinkTiles(**SMALL_TILES))
    assert s.shape[0] == 2  # K 40 in slices of 32
    expected_s = lora_reference.lora_shrink_reference(x, a, slots)
    torch.testing.assert_close(s.sum(0), expected_s, atol=TOLERANCES[dtype], rtol=TOLERANCES[dtype])
    assert not s[:, slots < 0].any()
    s[:, slots < 0] = float("nan")  # the expand must not read a base token's s
    ours, expected = y.clone(), y.clone()
    triton_shrink_expand.lora_expand_add(ours[:, 2:42], s[:, :, 6:12], b, slots, block_t=16)
    lora_reference.lora_expand_reference(expected[:, 2:42], expected_s[:, 6:12], b, slots)
    tol = TOLERANCES[dtype] * 10
    torch.testing.assert_close(ours, expected, atol=tol, rtol=tol)
    assert torch.equal(ours[slots < 0], y[slots < 0])
    assert torch.equal(ours[:, :2], y[:, :2]) and torch.equal(ours[:, 42:], y[:, 42:])


def test_default_tiles_past_one_block() -> None:
    # 70 tokens: blocks of 64 (the prefill tiles), the second one mixed and mostly past T.
    pytest.importorskip("triton")

    pattern = [1] * 40 + [-1] * 20 + [0] * 10
    x, a, b, y = _block_inputs(pattern, torch.float32)
    slots = torch.tensor(pattern, device=DEVICE)
    assert triton_shrink_expand.shrink_tiles(len(pattern), 40).block_t == 64
    s = triton_shrink_expand.lora_shrink(x, a, slots)
    torch.testing.assert_close(s.sum(0), lora_reference.lora_shrink_reference(x, a, slots), atol=1e-5, rtol=1e-5)
    ours, expected = y.clone(), y.clone()
    triton_shrink_expand.lora_expand_add(ours[:, :40], s[:, :, :6], b, slots)
    lora_reference.lora_expand_reference(expected[:, :40], s.sum(0)[:, :6], b, slots)
    torch.testing.assert_close(ours, expected, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("num_tokens, k", [(8, 2048), (1024, 2048), (1024, 8192), (70, 40)])
def test_shrink_tiles_cover_k(num_tokens: int, k: int) -> None:
    pytest.importorskip("triton")
    from vllm_cluster.kernels.lora.triton_shrink_expand import shrink_tiles

    tiles = shrink_tiles(num_tokens, k)
    assert tiles.k_per_split % tiles.block_k == 0 and tiles.block_t >= 16
    assert shrink_tiles(num_tokens + 1000, k).k_per_split == tiles.k_per_split  # K alone sets the split


# Fused linears: q/k/v (3 parts) and gate/up (2), rank 6. Parts of 20, 7 and 13 columns
# straddle the column blocks of 16 and 32, so one block mixes parts.
FUSED_PARTS = {"qkv": (20, 7, 13), "gate_up": (21, 19)}


def _fused_inputs(slots: list[int], part_sizes: tuple[int, ...], dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(2)
    rank, m = 6, sum(part_sizes)
    x = torch.randn(len(slots), 40, generator=gen)  # [T, K]
    a = torch.randn(4, len(part_sizes) * rank, 40, generator=gen) / 6  # [L, P*R, K]: one rank block per part
    b = torch.randn(4, m, rank, generator=gen)  # [L, M, R]: the parts' columns stacked
    a[3], b[3] = float("nan"), float("nan")  # slot 3 is never used
    y = torch.randn(len(slots), m + 4, generator=gen)  # the expand writes columns 1..m
    return tuple(t.to(dtype).to(DEVICE) for t in (x, a, b, y))


def _fused_reference(y: torch.Tensor, s: torch.Tensor, b: torch.Tensor, slots: torch.Tensor,
                     part_sizes: tuple[int, ...]) -> None:
    # y: [T, M], s: [T, P*R]: each part on its own, the definition's way
    r, start = b.shape[2], 0
    for p, size in enumerate(part_sizes):
        part = slice(start, start + size)
        lora_reference.lora_expand_reference(y[:, part], s[:, p * r : (p + 1) * r], b[:, part], slots)
        start += size


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("pattern", ["runs", "decode"])
@pytest.mark.parametrize("fused", FUSED_PARTS)
def test_fused_parts_match_reference(dtype: torch.dtype, pattern: str, fused: str) -> None:
    pytest.importorskip("triton")

    part_sizes, slot_list = FUSED_PARTS[fused], SLOT_PATTERNS[pattern]
    x, a, b, y = _fused_inputs(slot_list, part_sizes, dtype)
    slots = torch.tensor(slot_list, device=DEVICE)
    tiles = triton_shrink_expand.ShrinkTiles(block_t=16, block_k=16, k_per_split=16)
    s = triton_shrink_expand.lora_shrink(x, a, slots, tiles)
    assert s.shape[0] == 3  # K 40 in slices of 16: three partials for the expand to add
    expected_s = lora_reference.lora_shrink_reference(x, a, slots)
    ours, expected = y.clone(), y.clone()
    m = sum(part_sizes)
    triton_shrink_expand.lora_expand_add(ours[:, 1 : m + 1], s, b, slots, part_sizes, block_t=16)
    _fused_reference(expected[:, 1 : m + 1], expected_s, b, slots, part_sizes)
    tol = TOLERANCES[dtype] * 10
    torch.testing.assert_close(ours, expected, atol=tol, rtol=tol)
    assert torch.equal(ours[slots < 0], y[slots < 0])
    assert torch.equal(ours[:, 0], y[:, 0]) and torch.equal(ours[:, m + 1 :], y[:, m + 1 :])


@pytest.mark.parametrize("fused", FUSED_PARTS)
def test_fused_parts_torch_path(fused: str) -> None:
    # The CPU path (grouped on the spot, and grouped by the caller) against the same definition.
    part_sizes, slot_list = FUSED_PARTS[fused], SLOT_PATTERNS["runs"]
    x, a, b, y = (t.cpu() for t in _fused_inputs(slot_list, part_sizes, torch.float32))
    slots = torch.tensor(slot_list)
    groups: SlotGroups = [(v, (slots == v).nonzero().squeeze(1)) for v in (0, 1, 2)]
    expected = y.clone()
    m = sum(part_sizes)
    _fused_reference(expected[:, :m], lora_reference.lora_shrink_reference(x, a, slots), b, slots, part_sizes)
    for given in (None, groups):
        ours = y.clone()
        s = lora_ops.lora_shrink(x, a, slots, given)
        lora_ops.lora_expand_add(ours[:, :m], s, b, slots, part_sizes, given)
        torch.testing.assert_close(ours, expected, atol=1e-4, rtol=1e-4)
    split = torch.stack([s[0] / 4, s[0] * 3 / 4])  # partials from a K split add up before the expand
    ours = y.clone()
    lora_ops.lora_expand_add(ours[:, :m], split, b, slots, part_sizes)
    torch.testing.assert_close(ours, expected, atol=1e-4, rtol=1e-4)
