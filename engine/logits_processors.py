"""The per-request logits processors vLLM's SamplingParams name: logit_bias, allowed_token_ids
and bad_words. The sampler calls `apply_logits_processors` once per step, after penalties
and min_tokens masking, on the logits it samples from (logprobs stay those of the raw
model distribution, as vLLM reports them by default).

Each processor gathers what it changes over the whole batch on the host, then touches the
logits with one indexed write: a step in which no request uses them costs one check per
request and no device work. Bad words need the generated tokens on the host each step, so
their requests run synchronously under async scheduling (engine/async_stepper.py).
"""

from __future__ import annotations

import torch

from vllm_cluster.engine.request import Request

_NEG_INF = float("-inf")


def apply_logits_processors(logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
    """logits: [N, V] float, one row per request. Returns them, changed on a copy if any
    request uses a processor (the caller's tensor may be the raw model output)."""
    users = [i for i, r in enumerate(requests) if r.sampling_params.has_logits_processors]
    if not users:
        return logits
    logits = logits.clone()
    _bias(logits, requests, users)
    _allow_only(logits, requests, users)
    _ban_bad_words(logits, requests, users)
    return logits


def _bias(logits: torch.Tensor, requests: list[Request], users: list[int]) -> None:
    rows, cols, values = [], [], []
    for i in users:
        for token_id, bias in (requests[i].sampling_params.logit_bias or {}).items():
            rows.append(i)
            cols.append(token_id)
            values.append(bias)
    if rows:
        index = _index(rows, cols, logits.device)
        logits.index_put_(index, _to_device(torch.tensor(values, dtype=logits.dtype), logits.device), accumulate=True)


def _allow_only(logits: torch.Tensor, requests: list[Request], users: list[int]) -> None:
    masked = [i for i in users if requests[i].sampling_params.allowed_token_ids is not None]
    if not masked:
        return
    rows, cols = [], []
    for k, i in enumerate(masked):
        allowed = requests[i].sampling_params.allowed_token_ids or []
        rows += [k] * len(allowed)
        cols += allowed
    keep = torch.zeros(len(masked), logits.shape[1], dtype=torch.bool, device=logits.device)  # [M, V]
    keep[_index(rows, cols, logits.device)] = True
    row_ids = _to_device(torch.tensor(masked), logits.device)
    logits[row_ids] = logits[row_ids].masked_fill(~keep, _NEG_INF)


def _ban_bad_words(logits: torch.Tensor, requests: list[Request], users: list[int]) -> None:
    rows, cols = [], []
    for i in users:
        for token_id in banned_token_ids(requests[i]):
            rows.append(i)
            cols.append(token_id)
    if rows:
        logits[_index(rows, cols, logits.device)] = _NEG_INF


def banned_token_ids(request: Request) -> list[int]:
    """vLLM's rule: a bad word's last token is banned when the generated tokens end with all
    the tokens before it (a one-token word is always banned). Only generated tokens count."""
    output = request.output_token_ids
    banned = []
    for word in request.sampling_params.bad_words_token_ids:
        prefix = word[:-1]
        if len(prefix) <= len(output) and (not prefix or output[-len(prefix):] == prefix):
            banned.append(word[-1])
    return banned


def _index(rows: list[int], cols: list[int], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    index = _to_device(torch.tensor([rows, cols], dtype=torch.long), device)  # [2, K]: one copy
    return index[0], index[1]


def _to_device(values: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on `device` through pinned memory, without waiting for queued work."""
    return values if device.type == "cpu" else values.pin_memory().to(device, non_blocking=True)
