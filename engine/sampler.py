"""Turns the last-position logits of each sampling request into its next token.

Order: penalties -> min_tokens masking -> logits processors (engine/logits_processors.py) ->
(greedy argmax) | (temperature -> top-k -> top-p -> min-p -> sample). Logprobs are those of
the raw model distribution, as vLLM reports them by default. A request with a seed draws
from its own generator, so its tokens do not depend on what else is in the batch. Before
all of it, structured output sets the logits a constrained request's grammar forbids to
-inf (engine/structured_output.py); such a request's logprobs are those of the masked
distribution, as in vLLM.

`token_ids` queues the sampling on the device and never waits for it (async scheduling
fetches the ids a step later); `__call__` also fetches them and adds logprobs. Host-side
values reach the device through pinned memory, without a synchronising copy.
"""

from __future__ import annotations

import functools

import torch

from vllm_cluster.engine.logits_processors import apply_logits_processors
from vllm_cluster.engine.request import Request, TokenLogprobs
from vllm_cluster.engine.scheduler import SampledToken
from vllm_cluster.engine.structured_output import apply_grammar_bitmask

_NEG_INF = float("-inf")


class Sampler:
    def __call__(self, logits: torch.Tensor, requests: list[Request]) -> list[SampledToken]:
        # logits: [N, V], one row per request
        token_list = self.token_ids(logits, requests).tolist()  # the step's one device-to-host sync
        if all(r.sampling_params.logprobs is None for r in requests):
            return [SampledToken(t, None) for t in token_list]
        raw_logprobs = torch.log_softmax(logits.float(), dim=-1)
        out = []
        for i, request in enumerate(requests):
            token_id = token_list[i]
            logprobs = None
            if raw_logprobs is not None and request.sampling_params.logprobs is not None:
                logprobs = _token_logprobs(raw_logprobs[i], token_id, request.sampling_params.logprobs)
            out.append(SampledToken(token_id, logprobs))
        return out

    def token_ids(self, logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
        """The next token of each request, [N] long on the logits' device; nothing waits."""
        # logits: [N, V]
        apply_grammar_bitmask(logits, requests)  # structured output, in place; nothing without a grammar
        if all(_is_plain_greedy(r) for r in requests):
            return argmax_rows(logits)
        logits = apply_logits_processors(self._apply_penalties_and_masks(logits.float(), requests), requests)
        token_ids = argmax_rows(logits)
        random_rows = [i for i, r in enumerate(requests) if not r.sampling_params.is_greedy]
        if random_rows:
            rows = _to_device(torch.tensor(random_rows), logits.device)
            token_ids[rows] = self._sample(logits[rows], [requests[i] for i in random_rows])
        return token_ids

    @staticmethod
    def _apply_penalties_and_masks(logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
        cloned = False
        for i, request in enumerate(requests):
            params = request.sampling_params
            # A grammar decides where its answer ends: min_tokens does not hold it open (it would
            # ban the only token a complete grammar allows).
            needs_min_tokens = request.grammar is None and _num_outputs_before(request) < params.min_tokens
            if not (params.has_penalties or needs_min_tokens):
                continue
            if not cloned:
                logits, cloned = logits.clone(), True
            row = logits[i]
            if params.has_penalties:
                _apply_penalties(row, request)
            if needs_min_tokens:
                banned = list(params.stop_token_ids)
                if request.eos_token_id is not None and not params.ignore_eos:
                    banned.append(request.eos_token_id)
                if banned:
                    row[_to_device(torch.tensor(banned), row.device)] = _NEG_INF
        return logits

    @staticmethod
    def _sample(logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
        # logits: [R, V] -> token ids [R]
        params = [r.sampling_params for r in requests]
        vocab_size = logits.shape[1]
        # One host tensor, one copy: [4, R] = temperature, top_k, top_p, min_p.
        values = torch.tensor(
            [[p.temperature, p.top_k if p.top_k > 0 else vocab_size, p.top_p, p.min_p] for p in params]
        )
        temperature, top_k, top_p, min_p = _to_device(values.T.contiguous(), logits.device)
        logits = logits / temperature.unsqueeze(1)
        # The sort that top-k / top-p need costs more than the rest of sampling: skipped when no row truncates.
        if any(0 < p.top_k < vocab_size or p.top_p < 1.0 for p in params):
            logits = _top_k_top_p(logits, top_k.long(), top_p)
        probs = torch.softmax(logits, dim=-1)
        if any(p.min_p > 0 for p in params):
            keep = probs >= min_p.unsqueeze(1) * probs.max(dim=-1, keepdim=True).values
            probs = torch.where(keep, probs, 0.0)
        # Exponential race (Gumbel-max in disguise): argmax(p / E) samples from p. The noise
        # comes from each request's CPU generator, so a seed gives the same draws on any device.
        noise = torch.empty(probs.shape)
        for i, request in enumerate(requests):
            noise[i].exponential_(generator=request.generator)
        return argmax_rows(probs / _to_device(noise, logits.device))


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """x.argmax(dim=-1) for [N, V]: the first index of each row's maximum.

    On CUDA a long row is reduced in two stages (the maximum of each of C chunks, then the
    first chunk holding the row's maximum), since torch's one-stage argmax gives a row of
    128k logits to one thread block (27 us at batch 1 on the H200, against 13 us). Ties
    resolve as in torch: within a chunk and across chunks, the lower index wins.
    """
    chunks = _argmax_chunks(x.shape[-1]) if x.is_cuda and x.dim() == 2 else 0
    return chunked_argmax(x, chunks) if chunks else x.argmax(dim=-1)


def chunked_argmax(x: torch.Tensor, chunks: int) -> torch.Tensor:
    """argmax_rows in two stages over `chunks` equal chunks of each row (V % chunks == 0)."""
    n, v = x.shape
    chunk_max, within = x.reshape(n, chunks, v // chunks).max(dim=-1)  # [N, C] each
    best = chunk_max.argmax(dim=-1, keepdim=True)  # [N, 1]
    return (best * (v // chunks) + within.gather(1, best)).squeeze(1)


@functools.cache
def _argmax_chunks(vocab_size: int) -> int:
    """A number of equal chunks (128..1024 of them) for a row of vocab_size; 0 if none fits."""
    if vocab_size < 16384:
        return 0
    return next((c for c in range(256, 1025) if vocab_size % c == 0), 0) or next(
        (c for c in range(255, 127, -1) if vocab_size % c == 0), 0
    )


def _to_device(values: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on `device` without waiting for the work queued there."""
    if device.type == "cpu":
        return values
    return values.pin_memory().to(device, non_blocking=True)


def _num_outputs_before(request: Request) -> int:
    """Output tokens before the one sampled now (async scheduling: some still in flight)."""
    return request.num_output_tokens + request.num_pending_tokens


def _is_plain_greedy(request: Request) -> bool:
    params = request.sampling_params
    return (
        params.is_greedy
        and params.logprobs is None
        and not params.has_penalties
        and not params.has_logits_processors
        and _num_outputs_before(request) >= params.min_tokens
    )


def _apply_penalties(row: torch.Tensor, request: Request) -> None:
    params = request.sampling_params
    vocab_size = row.shape[0]
    if params.repetition_penalty != 1.0:
        seen = torch.tensor(sorted(set(request.all_token_ids)), dtype=torch.long, device=row.device)
        seen = seen[seen < vocab_size]
        values = row[seen]
        row[seen] = torch.where(values > 0, values / params.repetition_penalty, values * params.repetition_penalty)
    if request.output_token_ids and (params.frequency_penalty or params.presence_penalty):
        output_ids = torch.tensor(request.output_token_ids, device=row.device)
        counts = torch.bincount(output_ids, minlength=vocab_size)[:vocab_size]
        row -= params.frequency_penalty * counts + params.presence_penalty * (counts > 0)


def _top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    ranks = torch.arange(logits.shape[1], device=logits.device).unsqueeze(0)
    mask = ranks >= top_k.unsqueeze(1)
    sorted_logits = sorted_logits.masked_fill(mask, _NEG_INF)
    probs = sorted_logits.softmax(dim=-1)
    # Drop a token once the tokens before it already cover top_p; the first always stays.
    mask = (probs.cumsum(dim=-1) - probs) >= top_p.unsqueeze(1)
    sorted_logits = sorted_logits.masked_fill(mask, _NEG_INF)
    return torch.full_like(logits, _NEG_INF).scatter(1, order, sorted_logits)


def _token_logprobs(logprobs: torch.Tensor, token_id: int, num_top: int) -> TokenLogprobs:
    # logprobs: [V]
    value = logprobs[token_id]
    rank = int((logprobs > value).sum()) + 1
    top: dict[int, float] = {}
    if num_top > 0:
        values, ids = logprobs.topk(num_top)
        top = {int(t): float(v) for t, v in zip(ids, values, strict=True)}
    return TokenLogprobs(token_id=token_id, logprob=float(value), rank=rank, top=top)
