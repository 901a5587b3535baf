"""The range and logits-field checks of a completions or chat body (router/openai/protocol.py),
done at the HTTP front so that the 400 names the field; the engine checks them again."""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from typing import TYPE_CHECKING

from vllm_cluster.proto import cluster_pb2 as pb
from vllm_cluster.router.openai.errors import bad_request

if TYPE_CHECKING:
    from vllm_cluster.router.openai.protocol import _SamplingFields

INT32 = 2**31
_TOKEN_ID_KEY = re.compile(r"0|[1-9][0-9]{0,9}")

# name: (is the value allowed?, what is allowed)
RANGES: dict[str, tuple[Callable[[float], bool], str]] = {
    "temperature": (lambda v: v >= 0.0, ">= 0 (0 means greedy)"),
    "top_p": (lambda v: 0.0 < v <= 1.0, "in (0, 1]"),
    "min_p": (lambda v: 0.0 <= v <= 1.0, "in [0, 1]"),
    "presence_penalty": (lambda v: -2.0 <= v <= 2.0, "in [-2, 2]"),
    "frequency_penalty": (lambda v: -2.0 <= v <= 2.0, "in [-2, 2]"),
    "repetition_penalty": (lambda v: 0.0 < v <= 2.0, "in (0, 2] (1 means none)"),
}


def logits_fields(body: _SamplingFields, msg: pb.SamplingParams) -> None:
    """logit_bias, allowed_token_ids, bad_words and truncate_prompt_tokens into `msg`; 400
    naming the field. Token ids past the vocabulary are refused by the engine."""
    for key, bias in (body.logit_bias or {}).items():
        token_id = int(key) if _TOKEN_ID_KEY.fullmatch(key) else -1  # as /openapi.json spells them
        if not 0 <= token_id < INT32:
            raise bad_request(f"Found token_id `{key}` in logit_bias but token_id must be an integer or string "
                              "representing an integer", "logit_bias")
        if not math.isfinite(bias):
            raise bad_request(f"logit_bias values must be finite numbers, got {bias} for {key}", "logit_bias")
        msg.logit_bias[token_id] = min(100.0, max(-100.0, bias))  # clamped, as OpenAI and vLLM do
    if body.allowed_token_ids is not None:
        if not body.allowed_token_ids:
            raise bad_request("allowed_token_ids is empty: give at least one token id", "allowed_token_ids")
        if any(not 0 <= t < INT32 for t in body.allowed_token_ids):
            raise bad_request("allowed_token_ids must be token ids (0 <= id < 2**31)", "allowed_token_ids")
        msg.allowed_token_ids.extend(body.allowed_token_ids)
    if any(not w.strip() for w in body.bad_words or []):
        raise bad_request("bad_words must be non-blank strings", "bad_words")
    msg.bad_words.extend(body.bad_words or [])
    k = body.truncate_prompt_tokens
    if k is not None:
        if k == 0 or not -1 <= k < INT32:
            raise bad_request(f"truncate_prompt_tokens must be >= 1, or -1 for max_model_len; got {k}",
                              "truncate_prompt_tokens")
        msg.truncate_prompt_tokens = k
    if not -INT32 <= body.priority < INT32:
        raise bad_request(f"priority is out of range: {body.priority}", "priority")

def check_ranges(body: _SamplingFields) -> None:
    """The engine's ranges (engine/sampling_params.py), checked here too so that the
    400 names the field."""
    for name, (in_range, allowed) in RANGES.items():
        value = getattr(body, name)
        if value is None:
            continue
        if not math.isfinite(value):
            raise bad_request(f"{name} must be a finite number, got {value}", name)
        if not in_range(value):
            raise bad_request(f"{name} must be {allowed}, got {value}", name)
    if body.top_k is not None and body.top_k < -1:
        raise bad_request(f"top_k must be -1 or 0 (no top-k) or a positive integer, got {body.top_k}", "top_k")
