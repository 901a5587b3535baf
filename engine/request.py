"""A request inside the engine and its lifecycle.

WAITING -> RUNNING -> (PREEMPTED -> WAITING -> RUNNING)* -> FINISHED_*.
In the decode role a request enters as TRANSFERRING and becomes WAITING once its KV has
landed. Everything after PREEMPTED is finished; only the scheduler changes `status`.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NewType

import torch

from vllm_cluster.engine.block_hash import BlockHash, hash_block_tokens
from vllm_cluster.engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from vllm_cluster.engine.structured_output import RequestGrammar

RequestId = NewType("RequestId", str)


class RequestStatus(enum.IntEnum):
    WAITING = enum.auto()
    TRANSFERRING = enum.auto()
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()
    # Everything after PREEMPTED is finished.
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH_CAPPED = enum.auto()
    FINISHED_ABORTED = enum.auto()

    @property
    def is_finished(self) -> bool:
        return self > RequestStatus.PREEMPTED

    @property
    def finish_reason(self) -> str | None:
        return _FINISH_REASONS.get(self)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH_CAPPED: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
}


@dataclass(slots=True)
class TokenLogprobs:
    """Logprobs of one generated token: the sampled one and the top-N alternatives."""

    token_id: int
    logprob: float
    rank: int  # 1 = the most likely token
    top: dict[int, float]  # token id -> logprob, most likely first


@dataclass(slots=True, eq=False)
class Request:
    request_id: RequestId
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_id: int | None
    max_tokens: int  # resolved: never past max_model_len
    extra_keys: tuple[str, ...] = ()  # tenant salt, LoRA id: part of every block hash
    lora_name: str | None = None  # the LoRA adapter it runs under; None: the base model
    # scheduling_policy priority: lower is served first, ties by arrival (vLLM's `priority`)
    priority: int = 0
    arrival_time: float = field(default_factory=time.monotonic)
    first_scheduled_time: float | None = None
    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    output_logprobs: list[TokenLogprobs] = field(default_factory=list)
    # SamplingParams.prompt_logprobs: entry i is prompt token i + 1's, given the tokens before it
    prompt_logprobs: list[TokenLogprobs] = field(default_factory=list)
    num_computed_tokens: int = 0
    # Async scheduling: tokens that launched steps are sampling, not yet in output_token_ids
    # (their positions already count in num_computed_tokens once scheduled past them).
    num_pending_tokens: int = 0
    num_cached_tokens: int = -1  # prefix-cache hit at first schedule; -1 until then
    num_preemptions: int = 0
    stop_reason: int | str | None = None
    block_hashes: list[BlockHash] = field(default_factory=list)
    generator: torch.Generator | None = None
    grammar: RequestGrammar | None = None  # structured output: the matcher every output token passes

    def __post_init__(self) -> None:
        if self.sampling_params.seed is not None:
            self.generator = torch.Generator().manual_seed(self.sampling_params.seed)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    def token_slice(self, start: int, end: int) -> list[int]:
        """all_token_ids[start:end] without building all_token_ids (a per-step hot path)."""
        num_prompt = len(self.prompt_token_ids)
        if start >= num_prompt:
            return self.output_token_ids[start - num_prompt : end - num_prompt]
        if end <= num_prompt:
            return self.prompt_token_ids[start:end]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - num_prompt]

    def update_block_hashes(self, block_size: int) -> None:
        """Extend `block_hashes` over every full block of the known tokens."""
        num_hashed = len(self.block_hashes)
        if self.num_tokens // block_size <= num_hashed:
            return
        parent = self.block_hashes[-1] if self.block_hashes else None
        start = num_hashed * block_size
        tokens = self.token_slice(start, self.num_tokens)
        self.block_hashes += hash_block_tokens(tokens, block_size, self.extra_keys, parent)

    def append_output_token(self, token_id: int, logprobs: TokenLogprobs | None) -> None:
        self.output_token_ids.append(token_id)
        if self.grammar is not None:
            self.grammar.accept(token_id)
        if logprobs is not None:
            self.output_logprobs.append(logprobs)
