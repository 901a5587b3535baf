"""Batched LoRA shrink/expand (kernels/triton_lora.py, and the CPU path of kernels/lora.py)
against the per-token reference, over a batch that mixes adapters and base tokens (-1).
Without a GPU the Triton kernels run under the interpreter on tiny fp32/fp16 shapes."""

from __future__ import annotations

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
    if path == "triton":
        pytest.importorskip("triton")
        from kernels import triton_lora as impl
    else:
        impl = lora  # type: ignore[assignment]
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
    groups = [(slot, torch.tensor([t for t, v in enumerate(SLOTS) if v == slot], device=DEVICE)) for slot in (0, 1, 2)]
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
