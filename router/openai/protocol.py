"""The OpenAI request bodies we accept, and how each becomes the cluster's SamplingParams.

Fields follow OpenAI's API plus vLLM's extras (top_k, min_p, min_tokens, ignore_eos,
stop_token_ids, repetition_penalty, ...). Unknown fields are ignored, as vLLM does, except
the ones whose silent loss would change the answer (tools, logit_bias, echo, suffix,
best_of, structured output): those are refused with a 400 naming the field.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from vllm_cluster.proto import cluster_pb2 as pb
from vllm_cluster.router.openai.errors import ApiError, bad_request

MAX_N = 64  # choices per request; each is its own sequence on a decode instance
MAX_PROMPTS = 64  # prompts in one /v1/completions batch
MAX_LOGPROBS = 20
_INT32 = 2**31


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore")


class _Body(_Request):
    """A whole request body. Its text must be well-formed Unicode: JSON's `\\ud800` escape
    decodes to a lone surrogate, which no tokenizer, protobuf string or UTF-8 response can
    hold, so it is refused here, naming the field, before anything reads the text."""

    @model_validator(mode="before")
    @classmethod
    def _well_formed_text(cls, data: Any) -> Any:
        found = lone_surrogate(data)
        if found is not None:
            where, text, index = found
            raise ApiError(
                400,
                f"{where or 'a field name'} is not valid UTF-8 text: it holds a lone surrogate "
                f"(U+{ord(text[index]):04X}) at character {index}. Send {where or 'the body'} as well-formed "
                "Unicode: a surrogate escape such as \\ud83d only together with its pair (\\ude00), "
                "or the character itself",
                where or None,
            )
        return data


def lone_surrogate(value: Any) -> tuple[str, str, int] | None:
    """The first text in decoded JSON that UTF-8 cannot encode: (its dotted field path, the
    text, the index of the lone surrogate). A dict key is reported at the dict's path."""
    stack: list[tuple[tuple[str | int, ...], Any]] = [((), value)]
    while stack:
        path, item = stack.pop()
        if isinstance(item, str):
            try:
                item.encode("utf-8")
            except UnicodeEncodeError as e:
                return ".".join(str(p) for p in path), item, e.start
        elif isinstance(item, dict):
            children = [(path, key) for key in item] + [((*path, key), v) for key, v in item.items()]
            stack.extend(reversed(children))
        elif isinstance(item, list):
            stack.extend(reversed([((*path, i), v) for i, v in enumerate(item)]))
    return None


class LoRAAdapterRequest(_Body):
    """vLLM's body of /v1/load_lora_adapter (lora_path unused by /v1/unload_lora_adapter)."""

    lora_name: str = ""
    lora_path: str = ""


class StreamOptions(_Request):
    include_usage: bool = False
    continuous_usage_stats: bool = False


# name: (is the value allowed?, what is allowed)
_RANGES: dict[str, tuple[Callable[[float], bool], str]] = {
    "temperature": (lambda v: v >= 0.0, ">= 0 (0 means greedy)"),
    "top_p": (lambda v: 0.0 < v <= 1.0, "in (0, 1]"),
    "min_p": (lambda v: 0.0 <= v <= 1.0, "in [0, 1]"),
    "presence_penalty": (lambda v: -2.0 <= v <= 2.0, "in [-2, 2]"),
    "frequency_penalty": (lambda v: -2.0 <= v <= 2.0, "in [-2, 2]"),
    "repetition_penalty": (lambda v: 0.0 < v <= 2.0, "in (0, 2] (1 means none)"),
}


class _SamplingFields(_Body):
    """What completions and chat completions share."""

    model: str | None = None
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # vLLM's extras
    top_k: int | None = None
    min_p: float | None = None
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    repetition_penalty: float | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    # vLLM's `cache_salt`: requests with different salts never share cached prompt blocks.
    cache_salt: str | None = None
    # Refused when set: silently dropping them would change the answer.
    logit_bias: dict[str, float] | None = None
    best_of: int | None = None
    response_format: dict[str, Any] | None = None
    guided_json: Any = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None

    def _refuse_unsupported(self) -> None:
        if self.logit_bias:
            raise bad_request("logit_bias is not supported by this server; drop it", "logit_bias")
        if self.best_of is not None and self.best_of != self.n:
            raise bad_request("best_of is not supported; use n", "best_of")
        if self.response_format and self.response_format.get("type", "text") != "text":
            raise bad_request(
                "structured output (response_format) is not supported; use type 'text'", "response_format"
            )
        for name in ("guided_json", "guided_regex", "guided_choice"):
            if getattr(self, name) is not None:
                raise bad_request(f"{name} (structured output) is not supported; drop it", name)

    def sampling_params(self, max_tokens: int | None, num_logprobs: int | None) -> pb.SamplingParams:
        """Validated here (the router validates again): 400 naming the parameter."""
        self._refuse_unsupported()
        if not 1 <= self.n <= MAX_N:
            raise bad_request(f"n must be between 1 and {MAX_N}, got {self.n}", "n")
        self._check_ranges()
        if max_tokens is not None and max_tokens < 1:
            raise bad_request(f"max_tokens must be >= 1, got {max_tokens}", "max_tokens")
        if max_tokens is not None and self.min_tokens > max_tokens:
            raise bad_request(f"min_tokens ({self.min_tokens}) must be <= max_tokens ({max_tokens})", "min_tokens")
        if num_logprobs is not None and not 0 <= num_logprobs <= MAX_LOGPROBS:
            raise bad_request(f"logprobs must be between 0 and {MAX_LOGPROBS}, got {num_logprobs}", "logprobs")
        for name, value in (("max_tokens", max_tokens), ("min_tokens", self.min_tokens), ("top_k", self.top_k)):
            if value is not None and not -_INT32 <= value < _INT32:
                raise bad_request(f"{name} is out of range: {value}", name)
        if self.seed is not None and not -(2**63) <= self.seed < 2**63:
            raise bad_request(f"seed must fit in 64 bits, got {self.seed}", "seed")
        if any(not 0 <= t < _INT32 for t in self.stop_token_ids or []):
            raise bad_request("stop_token_ids must be token ids (0 <= id < 2**31)", "stop_token_ids")
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        msg = pb.SamplingParams(
            top_k=0 if self.top_k in (None, -1) else self.top_k,
            min_p=self.min_p or 0.0,
            min_tokens=self.min_tokens,
            stop=stop,
            stop_token_ids=self.stop_token_ids or [],
            include_stop_str_in_output=self.include_stop_str_in_output,
            ignore_eos=self.ignore_eos,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            skip_special_tokens=self.skip_special_tokens,
        )
        if self.temperature is not None:
            msg.temperature = self.temperature
        if self.top_p is not None:
            msg.top_p = self.top_p
        if self.seed is not None:
            msg.seed = self.seed
        if self.repetition_penalty is not None:
            msg.repetition_penalty = self.repetition_penalty
        if max_tokens is None:
            msg.max_tokens_unlimited = True
        else:
            msg.max_tokens = max_tokens
        if num_logprobs is not None:
            msg.logprobs = num_logprobs
        return msg

    def _check_ranges(self) -> None:
        """The engine's ranges (engine/sampling_params.py), checked here too so that the
        400 names the field."""
        for name, (in_range, allowed) in _RANGES.items():
            value = getattr(self, name)
            if value is None:
                continue
            if not math.isfinite(value):
                raise bad_request(f"{name} must be a finite number, got {value}", name)
            if not in_range(value):
                raise bad_request(f"{name} must be {allowed}, got {value}", name)
        if self.top_k is not None and self.top_k < -1:
            raise bad_request(f"top_k must be -1 or 0 (no top-k) or a positive integer, got {self.top_k}", "top_k")

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(_SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None

    def prompts(self) -> list[str | list[int]]:
        """One entry per prompt of a batch: text, or token ids."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if not p:
            raise bad_request("prompt is empty; send a string, a list of strings or token ids", "prompt")
        if all(isinstance(x, int) for x in p):
            return [list(p)]  # type: ignore[arg-type]
        if len(p) > MAX_PROMPTS:
            raise bad_request(f"{len(p)} prompts in one request; send at most {MAX_PROMPTS} per request", "prompt")
        return list(p)  # type: ignore[arg-type]

    def to_sampling_params(self) -> pb.SamplingParams:
        if self.echo:
            raise bad_request("echo is not supported by this server; drop it", "echo")
        if self.suffix:
            raise bad_request("suffix is not supported by this server; drop it", "suffix")
        return self.sampling_params(self.max_tokens, self.logprobs)


class ContentPart(_Request):
    type: str
    text: str | None = None


class ChatMessage(_Request):
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        texts = []
        for part in self.content:
            if part.type not in ("text", "input_text", "output_text") or part.text is None:
                raise bad_request(
                    f"content part of type {part.type!r} is not supported: this model reads text only", "messages"
                )
            texts.append(part.text)
        return "".join(texts)


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    add_generation_prompt: bool = True

    def to_sampling_params(self) -> pb.SamplingParams:
        if self.tools:
            raise bad_request("tool calling is not supported by this server; drop tools", "tools")
        if self.top_logprobs is not None and not 0 <= self.top_logprobs <= MAX_LOGPROBS:
            raise bad_request(
                f"top_logprobs must be between 0 and {MAX_LOGPROBS}, got {self.top_logprobs}", "top_logprobs"
            )
        if self.top_logprobs and not self.logprobs:
            raise bad_request("top_logprobs needs logprobs: true", "top_logprobs")
        max_tokens = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        return self.sampling_params(max_tokens, (self.top_logprobs or 0) if self.logprobs else None)

    def chat(self) -> list[dict[str, str]]:
        return [{"role": m.role, "content": m.text()} for m in self.messages]


class ResponsesInputMessage(_Request):
    role: str
    content: str | list[ContentPart]
    type: Literal["message"] | None = None


class ResponsesRequest(_Body):
    """OpenAI's Responses API, text in and text out."""

    model: str | None = None
    input: str | list[ResponsesInputMessage]
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stream: bool = False
    user: str | None = None
    tools: list[dict[str, Any]] | None = None
    previous_response_id: str | None = None

    def to_chat_request(self) -> ChatCompletionRequest:
        if self.tools:
            raise bad_request("tools are not supported by this server; drop them", "tools")
        if self.previous_response_id:
            raise bad_request(
                "previous_response_id is not supported: responses are not stored; send the whole input",
                "previous_response_id",
            )
        messages = [ChatMessage(role="system", content=self.instructions)] if self.instructions else []
        if isinstance(self.input, str):
            messages.append(ChatMessage(role="user", content=self.input))
        else:
            messages += [ChatMessage(role=m.role, content=m.content) for m in self.input]
        if not messages:
            raise bad_request("input is empty", "input")
        return ChatCompletionRequest(
            model=self.model, messages=messages, max_completion_tokens=self.max_output_tokens,
            temperature=self.temperature, top_p=self.top_p,
        )


class TokenizeRequest(_Body):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class DetokenizeRequest(_Body):
    model: str | None = None
    tokens: list[int]
