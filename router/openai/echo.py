"""Completions' `echo`: the prompt ahead of a choice's text and, with `logprobs`, its tokens'
logprobs ahead of the generated ones (the first prompt token's null), as OpenAI's legacy
API and vLLM shape them. With `max_tokens: 0` (CompletionRequest.echo_only) the one token
generated is dropped and the prompt alone comes back."""

from __future__ import annotations

from typing import Any

from vllm_cluster.proto import cluster_pb2 as pb
from vllm_cluster.router.openai.errors import bad_request
from vllm_cluster.router.openai.logprobs import completion_logprobs, echo_logprobs
from vllm_cluster.router.openai.protocol import CompletionRequest


def completion_piece(
    tokenizer: Any,
    body: CompletionRequest,
    text: str,
    logprobs: list[pb.TokenLogprob],
    offset: int,
    echoed: tuple[str, list[int], list[pb.TokenLogprob]] | None = None,
) -> tuple[str, dict[str, Any] | None]:
    """(text, logprobs object) of a choice's piece whose text starts at character `offset`.
    `echoed`: (prompt text, prompt token ids, their logprobs) to put first: the choice's
    first piece, with echo."""
    if body.echo_only:
        text, logprobs = "", []
    if echoed is None:
        return text, completion_logprobs(tokenizer, logprobs, offset) if body.logprobs is not None else None
    prompt_text, prompt_ids, prompt_logprobs = echoed
    if body.logprobs is None:
        return prompt_text + text, None
    return prompt_text + text, echo_logprobs(tokenizer, prompt_ids, prompt_logprobs, logprobs)


def prompt_texts(tokenizer: Any, body: CompletionRequest) -> list[str]:
    """The text echoed for each prompt of the batch (none without echo): a text prompt as
    sent, token ids decoded."""
    if not body.echo:
        return []
    if tokenizer is None and any(isinstance(p, list) for p in body.prompts()):
        raise bad_request("echo of a token-id prompt needs the model's tokenizer, which this server lacks", "echo")
    return [p if isinstance(p, str) else str(tokenizer.decode(p)) for p in body.prompts()]
