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


def echo_logprobs(
    tokenizer: Any, prompt_ids: list[int], prompt_logprobs: list[pb.TokenLogprob], logprobs: list[pb.TokenLogprob]
) -> dict[str, Any]:
    """Completions with echo: the prompt's tokens first (the first one with a null logprob
    and null top_logprobs: nothing predicts it), then the generated ones, one text_offset run."""
    assert len(prompt_logprobs) == len(prompt_ids) - 1, "prompt logprobs cover every prompt token after the first"
    first = token_text(tokenizer, prompt_ids[0])
    rest = completion_logprobs(tokenizer, [*prompt_logprobs, *logprobs], len(first))
    return {
        "tokens": [first, *rest["tokens"]],
        "token_logprobs": [None, *rest["token_logprobs"]],
        "top_logprobs": [None, *rest["top_logprobs"]],
        "text_offset": [0, *rest["text_offset"]],
    }


def vllm_prompt_logprobs(
    tokenizer: Any, prompt_ids: list[int], prompt_logprobs: list[pb.TokenLogprob]
) -> list[dict[str, dict[str, Any]] | None]:
    """vLLM's `prompt_logprobs` response field: per prompt token, {token id: {logprob, rank,
    decoded_token}} holding the token and the top-N at its position; None for the first."""

    def entry(logprob: float, rank: int, token_id: int) -> dict[str, Any]:
        return {"logprob": max(logprob, _MIN_LOGPROB), "rank": rank, "decoded_token": token_text(tokenizer, token_id)}

    out: list[dict[str, dict[str, Any]] | None] = [None]
    for lp in prompt_logprobs:
        position = {str(lp.token_id): entry(lp.logprob, lp.rank, lp.token_id)}
        for rank, top in enumerate(lp.top, start=1):
            position.setdefault(str(top.token_id), entry(top.logprob, rank, top.token_id))
        out.append(position)
    assert len(out) == len(prompt_ids), "prompt logprobs cover every prompt token after the first"
    return out
