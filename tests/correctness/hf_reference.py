"""What the tiny-checkpoint comparisons with HF transformers share: random weights large
enough that greedy choices are not ties, and HF's own greedy tokens and their logprobs."""

from __future__ import annotations

from typing import Any

import torch


def randomise(model: torch.nn.Module) -> None:
    """The default init (std 0.02) makes nearly uniform logits and router scores, where argmax
    and top-k ties hide bugs: norms near 1, every other weight with std 0.2."""
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=generator)
            param.copy_(1.0 + 0.1 * noise if name.endswith("norm.weight") else 0.2 * noise)


def hf_greedy(model: Any, prompt: list[int], max_new_tokens: int) -> tuple[list[int], list[float]]:
    """HF's greedy tokens and their logprobs, by full forward passes (no HF cache, so HF's own
    mask is all that limits attention)."""
    ids = torch.tensor([prompt])
    tokens: list[int] = []
    logprobs: list[float] = []
    with torch.no_grad():
        for _ in range(max_new_tokens):
            logits = model(ids).logits[0, -1].float()
            token = int(logits.argmax())
            tokens.append(token)
            logprobs.append(float(torch.log_softmax(logits, dim=-1)[token]))
            ids = torch.cat([ids, torch.tensor([[token]])], dim=1)
    return tokens, logprobs
