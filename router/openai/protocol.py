"""The OpenAI request bodies we accept, and how each becomes the cluster's SamplingParams.

Fields follow OpenAI's API plus vLLM's extras (top_k, min_p, min_tokens, ignore_eos,
stop_token_ids, repetition_penalty, ...). Unknown fields are ignored, as vLLM does. Every
field a model declares is accounted for in REQUEST_FIELDS (router/openai/fields.py): it
changes what the server does, or it is refused with a 400 naming it (tools, suffix,
best_of, ...); a test walks the models against that table.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from vllm_cluster.proto import cluster_pb2 as pb
from vllm_cluster.router.openai.errors import ApiError, bad_request, lone_surrogate
from vllm_cluster.router.openai.structured_output import structured_outputs

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
    # vLLM's `prompt_logprobs`: top-N per prompt token, in the response's `prompt_logprobs`.
    prompt_logprobs: int | None = None
    # OpenAI's logit_bias and vLLM's logits processors (engine/logits_processors.py).
    logit_bias: dict[str, float] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    # vLLM's: keep the last k prompt tokens (-1: max_model_len); served in serving._job.
    truncate_prompt_tokens: int | None = None
    # vLLM's: lower is served first on instances with scheduling_policy: priority.
    priority: int = 0
    # Refused when set: silently dropping them would change the answer.
    best_of: int | None = None
    # Structured output (router/openai/structured_output.py): OpenAI's, vLLM's, vLLM's older.
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: Any = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

    def _refuse_unsupported(self) -> None:
        if self.best_of is not None and self.best_of != self.n:
            raise bad_request("best_of is not supported; use n", "best_of")

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
        self._logits_fields(msg)
        constraint = structured_outputs(self)
        if constraint is not None:
            msg.structured_outputs.CopyFrom(constraint)
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
        if self.prompt_logprobs is not None:
            if not 0 <= self.prompt_logprobs <= MAX_LOGPROBS:
                raise bad_request(f"prompt_logprobs must be between 0 and {MAX_LOGPROBS}, got {self.prompt_logprobs}",
                                  "prompt_logprobs")
            if self.stream:
                raise bad_request("prompt_logprobs are not available when stream is true", "prompt_logprobs")
            msg.prompt_logprobs = self.prompt_logprobs
        return msg

    def _logits_fields(self, msg: pb.SamplingParams) -> None:
        """logit_bias, allowed_token_ids, bad_words and truncate_prompt_tokens into `msg`; 400
        naming the field. Token ids past the vocabulary are refused by the engine."""
        for key, bias in (self.logit_bias or {}).items():
            try:
                token_id = int(key)
            except ValueError:
                token_id = -1
            if not 0 <= token_id < _INT32:
                raise bad_request(f"Found token_id `{key}` in logit_bias but token_id must be an integer or string "
                                  "representing an integer", "logit_bias")
            if not math.isfinite(bias):
                raise bad_request(f"logit_bias values must be finite numbers, got {bias} for {key}", "logit_bias")
            msg.logit_bias[token_id] = min(100.0, max(-100.0, bias))  # clamped, as OpenAI and vLLM do
        if self.allowed_token_ids is not None:
            if not self.allowed_token_ids:
                raise bad_request("allowed_token_ids is empty: give at least one token id", "allowed_token_ids")
            if any(not 0 <= t < _INT32 for t in self.allowed_token_ids):
                raise bad_request("allowed_token_ids must be token ids (0 <= id < 2**31)", "allowed_token_ids")
            msg.allowed_token_ids.extend(self.allowed_token_ids)
        if any(not w.strip() for w in self.bad_words or []):
            raise bad_request("bad_words must be non-blank strings", "bad_words")
        msg.bad_words.extend(self.bad_words or [])
        k = self.truncate_prompt_tokens
        if k is not None:
            if k == 0 or not -1 <= k < _INT32:
                raise bad_request(f"truncate_prompt_tokens must be >= 1, or -1 for max_model_len; got {k}",
                                  "truncate_prompt_tokens")
            msg.truncate_prompt_tokens = k
        if not -_INT32 <= self.priority < _INT32:
            raise bad_request(f"priority is out of range: {self.priority}", "priority")

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

    @property
    def continuous_usage(self) -> bool:
        """Usage on every streamed chunk: continuous_usage_stats with include_usage, as in vLLM."""
        return self.include_usage and self.stream_options is not None and self.stream_options.continuous_usage_stats


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

    @property
    def echo_only(self) -> bool:
        """echo with max_tokens 0 (how lm-eval scores a continuation): the prompt and its
        logprobs come back, nothing generated. One token is generated and dropped, as vLLM does."""
        return self.echo and self.max_tokens == 0

    def to_sampling_params(self) -> pb.SamplingParams:
        if self.suffix:
            raise bad_request("suffix is not supported by this server; drop it", "suffix")
        params = self.sampling_params(1 if self.echo_only else self.max_tokens, self.logprobs)
        if self.echo and self.logprobs is not None and not params.HasField("prompt_logprobs"):
            params.prompt_logprobs = self.logprobs  # echoed prompt tokens carry their logprobs too
        return params


class ContentPart(_Request):
    type: str
    text: str | None = None


class ChatMessage(_Request):
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None  # the participant's name, given to the chat template as vLLM does

    def template_message(self) -> dict[str, str]:
        """The message as the chat template reads it."""
        message = {"role": self.role, "content": self.text()}
        if self.name is not None:
            message["name"] = self.name
        return message

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
    # vLLM's: extra variables of the chat template render (e.g. Qwen3's enable_thinking).
    chat_template_kwargs: dict[str, Any] | None = None

    def to_sampling_params(self) -> pb.SamplingParams:
        if self.tools:
            raise bad_request("tool calling is not supported by this server; drop tools", "tools")
        if self.tool_choice not in (None, "none", "auto"):
            raise bad_request("tool calling is not supported by this server; drop tool_choice", "tool_choice")
        if self.top_logprobs is not None and not 0 <= self.top_logprobs <= MAX_LOGPROBS:
            raise bad_request(
                f"top_logprobs must be between 0 and {MAX_LOGPROBS}, got {self.top_logprobs}", "top_logprobs"
            )
        if self.top_logprobs and not self.logprobs:
            raise bad_request("top_logprobs needs logprobs: true", "top_logprobs")
        max_tokens = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        return self.sampling_params(max_tokens, (self.top_logprobs or 0) if self.logprobs else None)

    def chat(self) -> list[dict[str, str]]:
        return [m.template_message() for m in self.messages]


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
