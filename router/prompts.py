"""What the router makes of a client's prompt and sampling parameters before routing: the
prompt's token ids (text through the tokenizer, a chat through the template with the
client's chat_template_kwargs and tools, or ids as sent), truncated to `truncate_prompt_tokens`, and
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
        messages = [template_message(m) for m in msg.chat.messages]
        if not messages:
            raise InvalidRequestError("the chat has no messages: send at least one")
        tools = _json(msg.chat.tools_json, list, "chat.tools_json") if msg.chat.tools_json else None
        return list(apply_chat_template(tokenizer, messages, template_kwargs(msg.chat), tools))
    raise InvalidRequestError("the request has no prompt: set text, token_ids or chat")


def template_message(m: pb.ChatMessage) -> dict[str, Any]:
    """A chat message as templates read it: a tool call's arguments as an object (Qwen's and
    Hermes' templates write them with `tojson`), as vLLM gives them."""
    message: dict[str, Any] = {"role": m.role, "content": m.content}
    if m.tool_calls_json:
        calls = _json(m.tool_calls_json, list, "tool_calls_json")
        for call in calls:
            function = call.get("function") if isinstance(call, dict) else None
            if not isinstance(function, dict) or not isinstance(function.get("name"), str):
                raise InvalidRequestError("tool_calls_json: each call needs function.name and function.arguments")
            if isinstance(function.get("arguments"), str):
                function["arguments"] = _json(function["arguments"] or "{}", dict, "a tool call's arguments")
        message["tool_calls"] = calls
    if m.tool_call_id:
        message["tool_call_id"] = m.tool_call_id
    return message


def template_kwargs(chat: pb.ChatPrompt) -> dict[str, Any] | None:
    if not chat.chat_template_kwargs_json:
        return None
    kwargs: dict[str, Any] = _json(chat.chat_template_kwargs_json, dict, "chat_template_kwargs_json")
    return kwargs


def _json(text: str, kind: type, where: str) -> Any:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise InvalidRequestError(f"{where} is not JSON: {e}") from None
    if not isinstance(value, kind):
        raise InvalidRequestError(f"{where} must be a JSON {'object' if kind is dict else 'array'}")
    return value
