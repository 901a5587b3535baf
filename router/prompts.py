"""What the router makes of a client's prompt and sampling parameters before routing: the
prompt's token ids (text through the tokenizer, a chat through the template with the
client's chat_template_kwargs, or ids as sent), truncated to `truncate_prompt_tokens`, and
bad words turned into token ids. From here on only integers travel."""

from __future__ import annotations

import json
from typing import Any

from vllm_cluster.engine.errors import InvalidRequestError
from vllm_cluster.engine.sampling_params import truncate_prompt
from vllm_cluster.engine.tokenizer import apply_chat_template, encode_bad_words
from vllm_cluster.proto import cluster_pb2 as pb
from vllm_cluster.worker.convert import sampling_params_from_proto


def prepare(tokenizer: Any, msg: pb.GenerateRequest, max_model_len: int) -> tuple[list[int], pb.SamplingParams]:
    """The prompt's token ids and the sampling parameters the workers get; raises
    InvalidRequestError (or ModelLoadError from the tokenizer) with a message for the client."""
    sampling_params = pb.SamplingParams()
    sampling_params.CopyFrom(msg.sampling_params)
    params = sampling_params_from_proto(sampling_params)  # validate here, with a clear message
    prompt = truncate_prompt(prompt_token_ids(tokenizer, msg), params.truncate_prompt_tokens, max_model_len)
    sampling_params.ClearField("truncate_prompt_tokens")  # done: a migrated leg's prompt is longer
    if params.bad_words and not params.bad_words_token_ids:
        if tokenizer is None:
            raise InvalidRequestError("bad_words need a tokenizer, and this model has none: drop them")
        words = encode_bad_words(tokenizer, params.bad_words)
        sampling_params.bad_words_token_ids.extend(pb.TokenIds(ids=ids) for ids in words)
    return prompt, sampling_params


def prompt_token_ids(tokenizer: Any, msg: pb.GenerateRequest) -> list[int]:
    kind = msg.WhichOneof("prompt")
    if kind == "token_ids":
        return list(msg.token_ids.ids)
    if tokenizer is None:
        raise InvalidRequestError("this model has no tokenizer: send token_ids")
    if kind == "text":
        return list(tokenizer.encode(msg.text))
    if kind == "chat":
        messages = [{"role": m.role, "content": m.content} for m in msg.chat.messages]
        if not messages:
            raise InvalidRequestError("the chat has no messages: send at least one")
        return list(apply_chat_template(tokenizer, messages, template_kwargs(msg.chat)))
    raise InvalidRequestError("the request has no prompt: set text, token_ids or chat")


def template_kwargs(chat: pb.ChatPrompt) -> dict[str, Any] | None:
    if not chat.chat_template_kwargs_json:
        return None
    try:
        kwargs = json.loads(chat.chat_template_kwargs_json)
    except json.JSONDecodeError as e:
        raise InvalidRequestError(f"chat_template_kwargs_json is not JSON: {e}") from None
    if not isinstance(kwargs, dict):
        raise InvalidRequestError("chat_template_kwargs_json must be a JSON object")
    return kwargs
