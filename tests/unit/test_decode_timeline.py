"""benchmarks/decode_timeline.py's accounting, on a synthetic trace (the profile itself needs a GPU)."""

from __future__ import annotations

from typing import Any

from benchmarks.decode_timeline import one_step, role


def _layer_kernels(t: float) -> list[tuple[str, float, float]]:
    """One layer's launches as (name, start, duration), the GEMV after a norm starting
    (PDL) while the norm runs."""
    return [
        ("_fused_add_rms_norm_kernel", t, 2), ("_mma_gemv_kernel", t + 1, 6), ("_decode_split_kernel", t + 7, 5),
        ("combine_splits_kernel", t + 8, 6), ("_mma_gemv_kernel", t + 13, 4), ("_fused_add_rms_norm_kernel", t + 17, 2),
        ("_mma_gemv_kernel", t + 18, 20), ("_mma_gemv_kernel", t + 38, 12),
    ]  # fmt: skip


def _trace(steps: int, layers: int) -> list[dict[str, Any]]:
    events, t = [], 0.0
    for _ in range(steps):
        for _ in range(layers):
            events += [{"name": n, "ts": s, "dur": d} for n, s, d in _layer_kernels(t)]
            t += 50
        events += [{"name": "_fused_add_rms_norm_kernel", "ts": t, "dur": 2}, {"name": "_mma_gemv_kernel", "ts": t + 1, "dur": 30}]
        t += 31 + 10  # lm_head, then a 10 us gap: the host between steps
        events.append({"name": "argmax_kernel", "ts": t, "dur": 1})
        t += 1
    return events


def test_roles_follow_the_layer_order() -> None:
    assert [role("_mma_gemv_kernel", i, 2) for i in range(9)] == ["qkv", "o", "gate_up", "down"] * 2 + ["lm_head"]
    assert role("combine_splits_kernel", 0, 2) == "attention combine"
    assert role("void cublasLt::splitKreduce_kernel<32>", 0, 2) == "lm_head"
    assert role("void at::native::reduce_kernel", 0, 2) == "other: void at::native::reduce_kernel"


def test_advances_add_up_to_the_step_and_skip_overlap() -> None:
    totals = one_step(_trace(steps=4, layers=2), layers=2)
    step = sum(t[2] for t in totals.values())
    assert step == 142  # from one step's first norm to the next's: 2 layers of 50, then 31 + 10 + 1
    # norms: 5 of 2 us, each moving the end by its whole length (the GEMV starts inside it)
    assert totals["norm"] == [5, 10, 10]
    assert totals["qkv"][2] == 2 * 5  # 6 us long, the first 1 under the norm
    assert totals["attention combine"] == [2, 12, 2 * 2]  # 6 us long, 2 past the attention's end
    assert totals["o"][2] == 2 * 3 and totals["gate_up"][2] == 2 * 19 and totals["down"][2] == 2 * 12
    assert totals["lm_head"] == [1, 30, 29]
    assert totals["other: argmax_kernel"][2] == 10 + 1  # the idle gap before it counts to it
