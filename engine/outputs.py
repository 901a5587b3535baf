"""What the engine returns to users, shaped as vLLM's offline API returns it."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class Logprob:
    logprob: float
    rank: int
    decoded_token: str | None = None


@dataclass(slots=True)
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None  # "stop", "length" or "abort"
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    # Per generated token: {token id: Logprob}, holding the sampled token and the top-N.
    logprobs: list[dict[int, Logprob]] | None = None
    cumulative_logprob: float | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    num_cached_tokens: int = 0
    # SamplingParams.prompt_logprobs: per prompt token, {token id: Logprob} holding the token
    # and the top-N at its position; None for the first token, which nothing predicts.
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    finished: bool = False
