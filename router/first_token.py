"""The prefill's first token, sent to the client as soon as the prefill answers.

A prefill instance samples a request's first token and hands it to the decode instance
with the KV; the decode instance sends it back once the request has joined its batch (the
`Decode` call, then its next step boundary: under load, after the step running then). The
router holds the token already, so where it can state that token's text exactly as the
decode instance will, it sends the token to the client itself, and drops it from the
decode instance's first message: time to first token is then the prefill's.

Exactly as the decode instance will: the text comes from the same incremental
detokenizer over the same prompt, and only where nothing can change it afterwards (no
stop strings that could begin in it, a whole character, not a special token, no logprobs
to carry). Anything else takes the usual path.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from vllm_cluster.engine.detokenizer import IncrementalDetokenizer
from vllm_cluster.engine.sampling_params import SamplingParams
from vllm_cluster.proto import cluster_pb2 as pb

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class EarlyToken:
    token_id: int
    text: str


def early_first_token(tokenizer: Any, request: pb.WorkerRequest, prefilled: pb.PrefillResponse) -> EarlyToken | None:
    """The prefill's first token with its text, where the router may send it ahead; else None."""
    params = request.sampling_params
    if tokenizer is None or not prefilled.HasField("first_token"):
        return None
    if params.stop or params.HasField("logprobs") or params.HasField("prompt_logprobs"):
        return None
    token_id = prefilled.first_token.token_id
    if token_id in params.stop_token_ids or token_id in tokenizer.all_special_ids:
        return None  # may end the request, or its text depends on skip_special_tokens
    skip = params.skip_special_tokens if params.HasField("skip_special_tokens") else True
    detokenizer = IncrementalDetokenizer(tokenizer, list(request.prompt_token_ids),
                                         SamplingParams(skip_special_tokens=skip))
    detokenizer.update([token_id])
    if not detokenizer.text:  # half a character (or nothing): the next token brings it
        return None
    return EarlyToken(token_id, detokenizer.text)


def drop_early_token(response: pb.GenerateResponse, early: EarlyToken) -> bool:
    """Take the token sent ahead out of the decode instance's first message; False where that
    message does not begin with it (then it is relayed as it is: never expected)."""
    if not response.token_ids or response.token_ids[0] != early.token_id or not response.text.startswith(early.text):
        logger.warning("%s: the decode instance's first message does not begin with the token sent ahead "
                       "(%d %r); relayed as it is", response.request_id, early.token_id, early.text)
        return False
    del response.token_ids[0]
    response.text = response.text[len(early.text):]
    return True
