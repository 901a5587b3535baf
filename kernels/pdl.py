"""Programmatic dependent launch (PDL, compute capability 9.0+) for the batch-1 decode chain.

A batch-1 decode step is a chain of ~300 small kernels, each waiting for the one before to
finish, drain and hand over before its first load is even issued. With PDL a kernel
launched with `launch_pdl=True` may start while the kernel before it is still running; it
issues the loads that do not depend on that kernel (a GEMV's weights) and then blocks in
`gdc_wait()` until the kernel before has finished and its writes are visible. The kernel
before lets it start early by calling `gdc_launch_dependents()`; without that call the
dependent starts once every program of the one before has exited.

Here the GEMVs (kernels/triton_linear.py, kernels/triton_gemv.py, kernels/triton_int4_rows.py)
are the dependents: each loads its first weight tile before `gdc_wait()`. The kernels that
feed them (fused add + RMS norm, SiLU-and-mul, the decode-attention combine) call
`gdc_launch_dependents()` as they start, so the GEMV's weight stream overlaps them.
Correctness never rests on the early start: a dependent reads nothing of its inputs before
`gdc_wait()`, and a kernel launched without PDL ignores both instructions.

`VLLM_CLUSTER_PDL=0` turns it off (benchmarks compare both in one run through `ENABLED`).
"""

from __future__ import annotations

import functools
import os

import torch

ENABLED = os.environ.get("VLLM_CLUSTER_PDL", "1") != "0"


@functools.cache
def _device_supports(index: int) -> bool:
    return torch.cuda.get_device_capability(index) >= (9, 0)


def enabled(t: torch.Tensor) -> bool:
    """Whether kernels on t's device use PDL: CUDA, compute capability 9.0+, not turned off."""
    return ENABLED and t.is_cuda and _device_supports(t.device.index if t.device.index is not None else 0)
