"""Programmatic dependent launch (PDL, compute capability 9.0+) for the batch-1 decode chain.

A batch-1 decode step is a chain of ~300 small kernels, each waiting for the one before to
finish, drain and hand over before its first load is even issued. With PDL a kernel
launched with `launch_pdl=True` may start while the kernel before it is still running; it
issues the loads that do not depend on that kernel (a GEMV's weights) and then blocks in
`gdc_wait()` until the kernel before has finished and its writes are visible. The kernel
before lets it start early by calling `gdc_launch_dependents()`; without that call the
dependent starts once every program of the one before has exited.

Every kernel of the batch-1 decode chain is launched so. The GEMVs
(kernels/linear/triton_gemv.py, kernels/linear/triton_w8_gemv.py; at 2..128 rows the INT4
kernels/int4/triton_mma.py) load their first weight tile before `gdc_wait()` (the INT4 GEMV
of kernels/int4/triton_rows.py waits before its pipelined loop); the small kernels between
them (fused add + RMS norm, rotary + KV write, the two decode-attention kernels,
SiLU-and-mul) start with `dependent_start`: they let the next kernel launch, then wait. At
batch 1 the norm between two GEMVs has no launch: the GEMV before adds into a sum that the
GEMV after reads once its wait returns, and both read or write the residual only after
their waits (kernels/linear/triton_add_norm.py). The decode attention that rotates and
caches the new token itself (kernels/attention/triton_decode.py) loads its first tile of
cached K/V before its wait, as the GEMVs load weights. The bf16 and 1-byte GEMVs let theirs
launch as they start too, except the gate_up GEMV with SiLU-and-mul fused, whose successor
is the down GEMV: it lets down launch only once its own weight loop is done (at its start,
down's early weight loads competed with gate_up's: int8 +30 us a step). The INT4 GEMV at
1-8 rows (kernels/int4/triton_mma_gemv.py) does the same for every projection: triggering
at its start cost gptq 490 us a batch-1 step, after its weight loop it saves 150; the bf16
and 1-byte GEMVs are the other way round (after their loop: +0.13 ms a step for bf16 and
fp8; each measured by benchmarks/bench_quant_gpu.py on the H200, batch-1 decode of
llama-3.1-8b); the other INT4 kernels never let theirs launch early. So while a GEMV
streams, the norm or rotary after it is resident, waiting, and the GEMV after that is
loading weights while the norm runs.

Correctness never rests on the early start: before its wait a kernel writes nothing and
reads only what no kernel of the chain writes (weights; for the decode attention that
rotates the new token itself, the sequence lengths, block tables and already-cached
tokens: host copies, earlier steps, and the graph's int32 copy of the lengths, all
ordinary launches that finish before the chain's first kernel starts), the wait covers
every kernel before it by induction, and a kernel launched without PDL ignores both
instructions. A kernel launches only once every program
of the one before has started, so the waiting kernels never hold back one that must finish
first.

`VLLM_CLUSTER_PDL=0` turns it off (benchmarks compare both in one run through `ENABLED`).
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

ENABLED = os.environ.get("VLLM_CLUSTER_PDL", "1") != "0"
# The SiLU-fused gate_up GEMV lets the down GEMV launch once it has read its weights (True),
# or not at all (False: down launches as gate_up's last programs exit). True: 14-32 us a
# batch-1 step less for bf16, fp8 and int8 on the H200 (docs/benchmarks.md).
SILU_MUL_LATE_TRIGGER = True


@functools.cache
def _device_supports(index: int) -> bool:
    return torch.cuda.get_device_capability(index) >= (9, 0)


@triton.jit
def dependent_start(PDL: tl.constexpr):
    """The first statement of a small kernel of the chain launched with launch_pdl=PDL: let
    the next kernel launch, then wait for the one before (its writes are visible after)."""
    if PDL:
        gdc_launch_dependents()
        gdc_wait()


def enabled(t: torch.Tensor) -> bool:
    """Whether kernels on t's device use PDL: CUDA, compute capability 9.0+, not turned off."""
    return ENABLED and t.is_cuda and _device_supports(t.device.index if t.device.index is not None else 0)
