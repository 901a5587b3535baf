"""Device-resident int32 semaphores for kernels whose last program to arrive finishes the
work of all (the split-K INT4 GEMVs' reduction).

Each set lives for the process and is all 0 between launches: the last program sets its
semaphore back to 0, so a CUDA graph replays the kernel as is, with no zeroing launch.
One set per (owner, device): kernels of different owners may run at once under PDL (a
dependent starts before the kernel before it ends) and must not share semaphores. Two
launches of one owner must not run at once on two streams of a device; the engine runs one
stream.
"""

from __future__ import annotations

import torch

SETS: dict[tuple[str, torch.device], torch.Tensor] = {}
# Sets replaced by a larger one stay alive: CUDA graphs captured earlier still point at them.
_RETIRED: list[torch.Tensor] = []


def semaphores(owner: str, device: torch.device, count: int) -> torch.Tensor:
    """At least `count` int32 semaphores of `owner` on `device`, all 0 between launches."""
    current = SETS.get((owner, device))
    if current is None or current.numel() < count:
        if current is not None:
            _RETIRED.append(current)
        current = torch.zeros(max(count, 1 << 14), dtype=torch.int32, device=device)
        SETS[owner, device] = current
    return current
