"""Migration: what the router keeps of a request in flight so that, when its decode
instance is lost mid-stream, the rest can be replayed on another one and the client's
stream goes on (router/servicer.py decides when; this is the bookkeeping, pure).

The continuation's prompt is the original prompt plus every token already relayed; its
limits (max_tokens, min_tokens) shrink by those tokens; text the lost instance held back
(a possible stop-string start) is sent ahead of the new instance's first text. It asks for
no prompt logprobs: the client had them with its first message.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from vllm_cluster.engine.detokenizer import num_unfinished_tokens
from vllm_cluster.proto import cluster_pb2 as pb


@dataclass
class Progress:
    """What the client has been sent: a request replayed elsewhere continues from here."""

    prompt: list[int]
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    pending_text: str = ""  # held back by a lost instance; goes out ahead of the next text
    migrations: int = 0
    prompt_logprobs: list[pb.TokenLogprob] = field(default_factory=list)  # from prefill, for the first message


class DecodeLost(Exception):
    """The decode leg broke mid-stream in a way another instance can recover from."""


def continuation(request: pb.WorkerRequest, progress: Progress) -> pb.WorkerRequest:
    """The rest of `request`: its prompt plus the tokens relayed, the limits reduced by them."""
    leg = pb.WorkerRequest()
    leg.CopyFrom(request)
    leg.request_id = f"{request.request_id}~m{progress.migrations}"  # new on every instance
    leg.prompt_token_ids.extend(progress.token_ids)
    params = leg.sampling_params
    done = len(progress.token_ids)
    if not params.max_tokens_unlimited:
        params.max_tokens = max(0, (params.max_tokens if params.HasField("max_tokens") else 16) - done)
    params.min_tokens = max(0, params.min_tokens - done)
    if params.HasField("structured_outputs"):  # the new instance's grammar replays the relayed tokens
        params.structured_outputs.num_generated_prompt_tokens += done
    params.ClearField("prompt_logprobs")  # the client has them; the new prompt is not the client's
    return leg


def remaining_tokens(leg: pb.WorkerRequest) -> int | None:
    params = leg.sampling_params
    return None if params.max_tokens_unlimited else params.max_tokens


def held_back_text(tokenizer: Any, request: pb.WorkerRequest, progress: Progress) -> str:
    """Text of tokens already relayed that the lost instance still held back (it might
    have begun a stop string): sent ahead of the next leg's text."""
    if tokenizer is None or not progress.token_ids:
        return ""
    params = request.sampling_params
    skip = params.skip_special_tokens if params.HasField("skip_special_tokens") else True
    prompt_text = tokenizer.decode(progress.prompt, skip_special_tokens=skip)
    # Tokens that end inside a character are the next leg's to send: its detokenizer counts
    # them as unread, so the token that completes the character brings all of it.
    relayed = progress.prompt + progress.token_ids
    relayed = relayed[: len(relayed) - num_unfinished_tokens(tokenizer, relayed, skip)]
    full = tokenizer.decode(relayed, skip_special_tokens=skip)
    generated = full[len(prompt_text):] if full.startswith(prompt_text) else ""
    sent = progress.text + progress.pending_text
    return generated[len(sent):] if generated.startswith(sent) else ""
