"""Token log-probabilities in OpenAI's two shapes: chat's `content` entries and the legacy
completions' parallel lists. JSON has no -inf, so a logprob is floored at _MIN_LOGPROB."""

from __future__ import annotations

from typing import Any

from vllm_cluster.proto import cluster_pb2 as pb

_MIN_LOGPROB = -9999.0


def token_text(tokenizer: Any, token_id: int) -> str:
    return str(tokenizer.decode([token_id])) if tokenizer is not None else f"token_id:{token_id}"


def chat_logprobs(tokenizer: Any, logprobs: list[pb.TokenLogprob]) -> dict[str, Any]:
    def entry(token_id: int, logprob: float) -> dict[str, Any]:
        text = token_text(tokenizer, token_id)
        return {"token": text, "logprob": max(logprob, _MIN_LOGPROB), "bytes": list(text.encode())}

    return {"content": [
        {**entry(lp.token_id, lp.logprob), "top_logprobs": [entry(t.token_id, t.logprob) for t in lp.top]}
        for lp in logprobs
    ]}


def completion_logprobs(tokenizer: Any, logprobs: list[pb.TokenLogprob], offset: int) -> dict[str, Any]:
    """offset: characters of the choice's text before these tokens (their `text_offset`)."""
    tokens, offsets = [], []
    for lp in logprobs:
        text = token_text(tokenizer, lp.token_id)
        tokens.append(text)
        offsets.append(offset)
        offset += len(text)
    return {
        "tokens": tokens,
        "token_logprobs": [max(lp.logprob, _MIN_LOGPROB) for lp in logprobs],
        "top_logprobs": [
            {token_text(tokenizer, t.token_id): max(t.logprob, _MIN_LOGPROB) for t in lp.top} for lp in logprobs
        ],
        "text_offset": offsets,
    }
