"""What the scheduler hands the model runner each step: typed, frozen, no Request objects."""

from __future__ import annotations

from dataclasses import dataclass

from vllm_cluster.engine.block_pool import BlockId
from vllm_cluster.engine.request import RequestId

# Async scheduling: a token that the step in flight is still sampling. The model runner
# fills it in on the device from that step's sampled ids.
PLACEHOLDER_TOKEN_ID = -1


@dataclass(frozen=True, slots=True)
class ScheduledRequest:
    request_id: RequestId
    token_ids: list[int]  # the tokens computed this step, at positions num_computed_tokens...
    num_computed_tokens: int  # tokens already in the KV cache before this step
    # A request new to the runner (first schedule or resumed after preemption) carries its
    # whole block table; a running one only the blocks allocated this step.
    new_block_ids: list[BlockId]
    is_new: bool
    samples: bool  # every known token is computed after this step: sample the next one
    lora_slot: int = -1  # the resident slot of the request's LoRA adapter; -1: the base model
    # SamplingParams.prompt_logprobs: the logits of this many leading positions of the step
    # (prompt tokens whose successor is a prompt token) come back too, ahead of its sampling row
    num_prompt_logits: int = 0


@dataclass(frozen=True, slots=True)
class SchedulerOutput:
    scheduled: list[ScheduledRequest]
    num_scheduled_tokens: int
    # The runner forgets these requests' state (finished, aborted or preempted).
    removed_request_ids: frozenset[RequestId]

    @property
    def is_empty(self) -> bool:
        return not self.scheduled
