"""One step's sampled token ids while they are still on the device (async scheduling):
the next step's inputs take them from here, the host reads them a step later."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vllm_cluster.engine.request import RequestId


@dataclass(frozen=True, slots=True)
class DeviceTokens:
    token_ids: torch.Tensor  # [N] long, on the model's device
    rows: dict[RequestId, int]  # request -> its row in token_ids


@dataclass(frozen=True, slots=True)
class PlaceholderFill:
    """Where a step's placeholder tokens come from: input position dst[i] takes
    prev.token_ids[src[i]]."""

    dst: list[int]  # flat input positions, increasing
    src: list[int]  # rows of prev.token_ids
    prev: DeviceTokens

    @property
    def is_prefix(self) -> bool:
        """The first k inputs take the first k rows (the steady decode batch): one plain copy."""
        k = len(self.dst)
        return self.dst[-1] == k - 1 and self.src == self.dst
