"""Batched LoRA shrink/expand (kernels/triton_lora.py, and the CPU path of kernels/lora.py)
against the per-token reference, over a batch that mixes adapters and base tokens (-1).
Without a GPU the Triton kernels run under the interpreter on tiny fp32/fp16 shapes; the
token-block tests shrink the tiles so that a few dozen tokens span several blocks and K
several splits."""

from __future__ import annotations

from types import ModuleType

import pytest
import torch

from kernels import lora

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
    impl: ModuleType = lora
    if path == "triton":
        pytest.importorskip("triton")
        from kernels import triton_lora

        impl = triton_lora
    device = DEVICE if path == "triton" else "cpu"
    x, a, b, y = (t.to(device) for t in _inputs(dtype))
    slots = torch.tensor(SLOTS, device=device)
    s = impl.lora_shrink(x, a, slots)
    expected_s = lora.lora_shrink_reference(x, a, slots)
    torch.testing.assert_close(s, expected_s, atol=TOLERANCES[dtype], rtol=TOLERANCES[dtype])
    assert not s[1].any() and not s[5].any()
    ours, expected = y.clone(), y.clone()
    impl.lora_expand_add(ours[:, 3:27], s[:, 2:8], b, slots)  # a rank slice, a column slice
    lora.lora_expand_reference(expected[:, 3:27], expected_s[:, 2:8], b, slots)
    tol = TOLERANCES[dtype] * 10
    torch.testing.assert_close(ours, expected, atol=tol, rtol=tol)
    assert torch.equal(ours[1], y[1]) and torch.equal(ours[:, :3], y[:, :3])  # base rows, other columns
    assert not torch.equal(ours[0], y[0])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_grouped_path_matches_reference(dtype: torch.dtype) -> None:
    # The eager path: the caller hands the tokens of each slot (here on the test device).
    x, a, b, y = (t.to(DEVICE) for t in _inputs(dtype))
    slots = torch.tensor(SLOTS, device=DEVICE)
    groups: lora.SlotGroups = [(slot, torch.tensor([t for t, v in enumerate(SLOTS) if v == slot], device=DEVICE)) for slot in (0, 1, 2)]
    s = lora.lora_shrink(x, a, slots, groups)
    expected_s = lora.lora_shrink_reference(x, a, slots)
    torch.testing.assert_close(s, expected_s, atol=TOLERANCES[dtype], rtol=TOLERANCES[dtype])
    ours, expected = y.clone(), y.clone()
    lora.lora_expand_add(ours[:, 3:27], s[:, 2:8], b, slots, groups)
    lora.lora_expand_reference(expected[:, 3:27], expected_s[:, 2:8], b, slots)
    tol = TOLERANCES[dtype] * 10
    torch.testing.assert_close(ours, expected, atol=tol, rtol=tol)


def test_all_base_tokens_leave_output_alone() -> None:
    x, a, b, y = _inputs(torch.float32)
    slots = torch.full((len(SLOTS),), -1)
    s = lora.lora_shrink(x, a, slots)
    ours = y.clone()
    lora.lora_expand_add(ours[:, :24], s[:, :6], b, slots)
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
    from kernels import triton_lora

    x, a, b, y = _block_inputs(SLOT_PATTERNS[pattern], dtype)
    slots = torch.tensor(SLOT_PATTERNS[pattern], device=DEVICE)
    s = triton_lora.lora_shrink(x, a, slots, triton_lora.ShrinkTiles(**SMALL_TILES))
    expected_s = lora.lora_shrink_reference(x, a, slots)
    torch.testing.assert_close(s, expected_s, atol=TOLERANCES[dtype], rtol=TOLERANCES[dtype])
    assert not s[slots < 0].any()
    s[slots < 0] = float("nan")  # the expand must not read a base token's s
    ours, expected = y.clone(), y.clone()
    triton_lora.lora_expand_add(ours[:, 2:42], s[:, 6:12], b, slots, block_t=16)
    lora.lora_expand_reference(expected[:, 2:42], expected_s[:, 6:12], b, slots)
    tol = TOLERANCES[dtype] * 10
    torch.testing.assert_close(ours, expected, atol=tol, rtol=tol)
    assert torch.equal(ours[slots < 0], y[slots < 0])
    assert torch.equal(ours[:, :2], y[:, :2]) and torch.equal(ours[:, 42:], y[:, 42:])


def test_default_tiles_past_one_block() -> None:
    # 70 tokens: blocks of 64 (the prefill tiles), the second one mixed and mostly past T.
    pytest.importorskip("triton")
    from kernels import triton_lora

    pattern = [1] * 40 + [-1] * 20 + [0] * 10
    x, a, b, y = _block_inputs(pattern, torch.float32)
    slots = torch.tensor(pattern, device=DEVICE)
    assert triton_lora.shrink_tiles(len(pattern), 40).block_t == 64
    s = triton_lora.lora_shrink(x, a, slots)
    torch.testing.assert_close(s, lora.lora_shrink_reference(x, a, slots), atol=1e-5, rtol=1e-5)
    ours, expected = y.clone(), y.clone()
    triton_lora.lora_expand_add(ours[:, :40], s[:, :6], b, slots)
    lora.lora_expand_reference(expected[:, :40], s[:, :6], b, slots)
    torch.testing.assert_close(ours, expected, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("num_tokens, k", [(8, 2048), (1024, 2048), (1024, 8192), (70, 40)])
def test_shrink_tiles_cover_k(num_tokens: int, k: int) -> None:
    pytest.importorskip("triton")
    from kernels.triton_lora import shrink_tiles

    tiles = shrink_tiles(num_tokens, k)
    assert tiles.k_per_split % tiles.block_k == 0 and tiles.block_t >= 16
    assert shrink_tiles(num_tokens + 1000, k).k_per_split == tiles.k_per_split  # K alone sets the split
