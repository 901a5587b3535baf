"""Pipeline parallelism, applied to a built model from outside: each stage keeps a
contiguous run of decoder layers (the first also the embedding, the last also the final
norm and lm_head) and runs them on the hidden states (and residual) the previous stage
sent. The step's batch is cut into micro-batches, so that while a stage works on one the
next stage works on the one before.

Micro-batches are contiguous runs of the scheduled requests, in order, and every stage
runs them in that order. That keeps prefix caching correct: a request may reuse blocks
that an earlier request of the same step is computing (the scheduler caches full blocks
as it allocates them), and on each stage the earlier micro-batch has written each layer's
KV before the later one reads it.
"""

from __future__ import annotations

import torch
from torch import nn

from vllm_cluster.engine.models import CausalLM
from vllm_cluster.engine.parallel.topology import Placement
from vllm_cluster.engine.scheduler_output import ScheduledRequest
from vllm_cluster.kernels.attention.metadata import AttentionMetadata


def apply_pp(model: CausalLM, place: Placement) -> None:
    """Keep only this stage's layers (and embedding / final norm / lm_head), in place."""
    decoder = model.model
    if len(place.layers) != len(decoder.layers):
        decoder.layers = nn.ModuleList(decoder.layers[i] for i in place.layers)
    if not place.is_first_stage:
        del decoder.embed_tokens
    if not place.is_last_stage:
        del decoder.norm
        del model.lm_head


def run_stage(
    model: CausalLM,
    place: Placement,
    input_ids: torch.Tensor,
    positions: torch.Tensor,
    received: torch.Tensor | None,
    kv_caches: list[torch.Tensor],
    meta: AttentionMetadata,
) -> tuple[torch.Tensor, torch.Tensor]:
    """This stage's layers over one micro-batch -> (x, residual), each [T, D]. The first
    stage embeds `input_ids`; the others start from `received` ([2, T, D]: x, residual)."""
    decoder = model.model
    residual: torch.Tensor | None
    if place.is_first_stage:
        x, residual = decoder.embed(input_ids), None
    else:
        assert received is not None
        x, residual = received[0], received[1]
    rope = decoder.rotary(positions)
    for layer, kv_cache in zip(decoder.layers, kv_caches, strict=True):
        x, residual = layer(rope, x, residual, kv_cache, meta)
    assert residual is not None  # every stage has at least one layer
    return x, residual


def split_micro_batches(scheduled: list[ScheduledRequest], num: int) -> list[list[ScheduledRequest]]:
    """Up to `num` contiguous, non-empty runs of `scheduled`, about equal in tokens."""
    num = min(num, len(scheduled))
    total = sum(len(item.token_ids) for item in scheduled)
    chunks: list[list[ScheduledRequest]] = []
    current: list[ScheduledRequest] = []
    done = 0
    for index, item in enumerate(scheduled):
        current.append(item)
        done += len(item.token_ids)
        chunks_left = num - len(chunks) - 1
        items_left = len(scheduled) - index - 1
        if chunks_left > 0 and (done * num >= total * (len(chunks) + 1) or items_left == chunks_left):
            chunks.append(current)
            current = []
    if current:
        chunks.append(current)
    return chunks
