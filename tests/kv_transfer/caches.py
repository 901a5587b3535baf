"""Tiny random KV caches shared by the tests and by the sender subprocess they start."""

from __future__ import annotations

import torch

MODEL = "tiny-test-model"


def random_caches(
    seed: int,
    num_layers: int = 2,
    num_blocks: int = 16,
    block_size: int = 4,
    dtype: torch.dtype = torch.float32,
) -> list[torch.Tensor]:
    """One [num_blocks, 2, block_size, 2 heads, 8 dims] tensor per layer, the same for a seed."""
    generator = torch.Generator().manual_seed(seed)
    return [
        torch.randn(num_blocks, 2, block_size, 2, 8, generator=generator).to(dtype)
        for _ in range(num_layers)
    ]


def zero_caches(like: list[torch.Tensor]) -> list[torch.Tensor]:
    return [torch.zeros_like(cache) for cache in like]
