"""The OpenAI request bodies we accept, and how each becomes the cluster's SamplingParams.

Fields follow OpenAI's API plus vLLM's extras (top_k, min_p, min_tokens, ignore_eos,
stop_token_ids, repetition_penalty, ...). Unknown fields are ignored, as vLLM does; known ones
are parsed strictly, within the ranges /openapi.json states (field_types.py). Every
field a model declares is accounted for in REQUEST_FIELDS (router/openai/fields.py): it
changes what the server does, or it is refused with a 400 naming it (suffix, best_of,
...); a test walks the models against that table.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator
from pydantic.json_schema import SkipJsonSchema

from vllm_cluster.proto import cluster_pb2 as pb
from vllm_cluster.router.openai import field_types as ft
from vllm_cluster.router.openai.errors import ApiError, bad_request, lone_surrogate
from vllm_cluster.router.openai.sampling_checks import check_ranges, logits_fields
from vllm_cluster.router.openai.structured_output import response_format_of, structured_outputs
from vllm_cluster.router.openai.tools import (
    ToolChoice,
    from_responses_tool_choice,
    from_responses_tools,
    template_tool_calls,
    tool_choice,
)

MAX_PROMPTS = 64  # prompts in one /v1/completions batch
_TokenIds = Annotated[list[ft.TokenId], Field(min_length=1)]


class _Request(BaseModel):
    # strict: a value of another JSON type is refused, not converted (`"stream": 0` is not false),
    # so that the server accepts what /openapi.json states and nothing else.
    model_config = ConfigDict(extra="ignore", strict=True)


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
    """vLLM's body of /v1/load_lora_adapter."""

    lora_name: str = Field(min_length=1)
    lora_path: str = Field(min_length=1)


class UnloadLoRAAdapterRequest(_Body):
    """vLLM's body of /v1/unload_lora_adapter."""

    lora_name: str = Field(min_length=1)


class StreamOptions(_Request):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class _SamplingFields(_Body):
    """What completions and chat completions share."""

    model: str | None = None
    n: ft.NumChoices = 1
    temperature: ft.Temperature | None = None
    top_p: ft.TopP | None = None
    seed: ft.Seed | None = None
    stop: str | list[str] | None = None
    presence_penalty: ft.Penalty = 0.0
    frequency_penalty: ft.Penalty = 0.0
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # vLLM's extras
    top_k: ft.TopK | None = None
    min_p: ft.MinP | None = None
    min_tokens: ft.Count = 0
    ignore_eos: bool = False
    stop_token_ids: list[ft.StopTokenId] | None = None
    repetition_penalty: ft.RepetitionPenalty | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    # vLLM's `cache_salt`: requests with different salts never share cached prompt blocks.
    cache_salt: str | None = None
    # vLLM's `prompt_logprobs`: top-N per prompt token, in the response's `prompt_logprobs`.
    prompt_logprobs: ft.NumLogprobs | None = None
    # OpenAI's logit_bias and vLLM's logits processors (engine/logits_processors.py).
    logit_bias: ft.LogitBias | None = None
    allowed_token_ids: Annotated[list[ft.TokenId], Field(min_length=1)] | None = None
    bad_words: list[ft.NonBlank] | None = None
    # vLLM's: keep the last k prompt tokens (-1: max_model_len); served in serving._job.
    truncate_prompt_tokens: Literal[-1] | Annotated[int, Field(ge=1, lt=ft.INT32)] | None = None
    # vLLM's: lower is served first on instances with scheduling_policy: priority.
    priority: ft.Int32 = 0
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
        """Validated here (the router validates again): 400 naming the parameter. Ranges of
        single fields are the field types' (field_types.py); these are the rules across fields."""
        self._refuse_unsupported()
        check_ranges(self)
        if max_tokens is not None and max_tokens < 1:
            raise bad_request(f"max_tokens must be >= 1, got {max_tokens}", "max_tokens")
        if max_tokens is not None and self.min_tokens > max_tokens:
            raise bad_request(f"min_tokens ({self.min_tokens}) must be <= max_tokens ({max_tokens})", "min_tokens")
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
        logits_fields(self, msg)
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
            if self.stream:
                raise bad_request("prompt_logprobs are not available when stream is true", "prompt_logprobs")
            msg.prompt_logprobs = self.prompt_logprobs
        return msg

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    @property
    def continuous_usage(self) -> bool:
        """Usage on every streamed chunk: continuous_usage_stats with include_usage, as in vLLM."""
        return self.include_usage and self.stream_options is not None and self.stream_options.continuous_usage_stats


class CompletionRequest(_SamplingFields):
    prompt: (str | Annotated[list[str], Field(min_length=1, max_length=MAX_PROMPTS)] | _TokenIds
             | Annotated[list[_TokenIds], Field(min_length=1, max_length=MAX_PROMPTS)])
    max_tokens: ft.CompletionMaxTokens | None = 16  # 0 only with echo (echo_only)
    logprobs: ft.NumLogprobs | None = None
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
    # The document states what ChatMessage.text() reads: a text part, with its text. Another
    # part is refused there, with a message saying this model reads text only.
    model_config = ConfigDict(json_schema_extra=lambda schema: schema.update(required=["type", "text"], properties={
        "type": {"enum": ["text", "input_text", "output_text"], "type": "string"}, "text": {"type": "string"}}))
    type: str
    text: str | None = None


class FunctionCall(_Request):
    name: str
    arguments: str | dict[str, Any] = "{}"  # JSON text (OpenAI's), or the object itself


class ToolCall(_Request):
    id: str = ""
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Request):
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None  # the participant's name, given to the chat template as vLLM does
    tool_calls: list[ToolCall] | None = None  # an assistant message's calls (tools.py)
    tool_call_id: str | None = None  # a tool message: the call whose result it holds

    def template_message(self) -> dict[str, Any]:
        """The message as the chat template reads it."""
        message: dict[str, Any] = {"role": self.role, "content": self.text()}
        if self.name is not None:
            message["name"] = self.name
        if self.tool_calls:
            message["tool_calls"] = template_tool_calls([call.model_dump() for call in self.tool_calls])
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
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
    max_tokens: ft.MaxTokens | None = None
    max_completion_tokens: ft.MaxTokens | None = None
    logprobs: bool = False
    top_logprobs: ft.NumLogprobs | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    add_generation_prompt: bool = True
    # vLLM's: extra variables of the chat template render (e.g. Qwen3's enable_thinking).
    chat_template_kwargs: dict[str, Any] | None = None

    def to_sampling_params(self) -> pb.SamplingParams:
        if self.top_logprobs and not self.logprobs:
            raise bad_request("top_logprobs needs logprobs: true", "top_logprobs")
        max_tokens = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        params = self.sampling_params(max_tokens, (self.top_logprobs or 0) if self.logprobs else None)
        constraint = self.tool_use().constraint()  # tool_choice required or named: enforced
        if constraint is not None:
            if params.HasField("structured_outputs"):
                raise bad_request("tool_choice required or a named function constrains the output, and so does the "
                                  "request's structured output: send only one of them", "tool_choice")
            params.structured_outputs.CopyFrom(constraint)
        return params

    def tool_use(self) -> ToolChoice:
        return tool_choice(self.tools, self.tool_choice, self.parallel_tool_calls)

    def chat(self) -> list[dict[str, Any]]:
        return [m.template_message() for m in self.messages]


class ResponsesInputMessage(_Request):
    """An input item: a message, a function call the model made, that call's output, or an
    earlier turn's reasoning (dropped: chat templates leave past reasoning out of the prompt)."""

    type: Literal["message", "function_call", "function_call_output", "reasoning"] | None = None
    role: str | None = None
    content: str | list[ContentPart] | None = None
    call_id: str | None = None
    name: str | None = None  # a function_call's
    arguments: str | None = None  # a function_call's, JSON text
    output: str | None = None  # a function_call_output's

    def chat_message(self) -> ChatMessage | None:
        if self.type == "reasoning":
            return None
        if self.type == "function_call":
            if self.call_id is None or self.name is None:
                raise bad_request("a function_call input item needs call_id, name and arguments", "input")
            call = ToolCall(id=self.call_id, function=FunctionCall(name=self.name, arguments=self.arguments or "{}"))
            return ChatMessage(role="assistant", tool_calls=[call])
        if self.type == "function_call_output":
            if self.call_id is None or self.output is None:
                raise bad_request("a function_call_output input item needs call_id and output", "input")
            return ChatMessage(role="tool", content=self.output, tool_call_id=self.call_id)
        if self.role is None or self.content is None:
            raise bad_request("a message input item needs role and content", "input")
        return ChatMessage(role=self.role, content=self.content)


class ResponsesRequest(_Body):
    """OpenAI's Responses API, text in and text out."""

    model: str | None = None
    input: str | list[ResponsesInputMessage]
    instructions: str | None = None
    max_output_tokens: ft.MaxTokens | None = None
    temperature: ft.Temperature | None = None
    top_p: ft.TopP | None = None
    stream: bool = False
    user: str | None = None
    tools: list[dict[str, Any]] | None = None  # function tools: {"type": "function", "name", "parameters"}
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    previous_response_id: str | None = None
    text: dict[str, Any] | None = None  # {"format": {"type": "text" | "json_object" | "json_schema", ...}}
    reasoning: dict[str, Any] | None = None  # {"effort": ...}: the chat template's reasoning_effort

    def to_chat_request(self) -> ChatCompletionRequest:
        if self.previous_response_id:
            raise bad_request(
                "previous_response_id is not supported: responses are not stored; send the whole input",
                "previous_response_id",
            )
        messages = [ChatMessage(role="system", content=self.instructions)] if self.instructions else []
        if isinstance(self.input, str):
            messages.append(ChatMessage(role="user", content=self.input))
        else:
            messages += [m for m in (item.chat_message() for item in self.input) if m is not None]
        if not messages:
            raise bad_request("input is empty", "input")
        effort = (self.reasoning or {}).get("effort")
        return ChatCompletionRequest(
            model=self.model, messages=messages, max_completion_tokens=self.max_output_tokens,
            temperature=self.temperature, top_p=self.top_p, tools=from_responses_tools(self.tools),
            tool_choice=from_responses_tool_choice(self.tool_choice), parallel_tool_calls=self.parallel_tool_calls,
            response_format=response_format_of(self.text),
            chat_template_kwargs={"reasoning_effort": effort} if effort is not None else None,
        )


class TokenizeRequest(_Body):
    """Exactly one of prompt and messages (neither is null when sent)."""

    model_config = ConfigDict(json_schema_extra={"oneOf": [{"required": ["prompt"]}, {"required": ["messages"]}]})
    model: str | None = None
    prompt: str | SkipJsonSchema[None] = None
    messages: Annotated[list[ChatMessage], Field(min_length=1)] | SkipJsonSchema[None] = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeRequest:
        sent_null = any(getattr(self, name) is None for name in self.model_fields_set & {"prompt", "messages"})
        if (self.prompt is None) == (self.messages is None) or sent_null:
            raise bad_request("send exactly one of prompt (a string) or messages (a list), not null", "prompt")
        return self


class DetokenizeRequest(_Body):
    model: str | None = None
    tokens: list[ft.TokenId]
