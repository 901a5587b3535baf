"""OpenAI's completions, chat completions and responses, over the cluster's Generate calls.

Each handler turns its body into token ids (the chat template is applied here, so the
context-length check sees the real prompt), fans out one Generate call per choice (`n`
and batched prompts), and folds the streamed pieces into OpenAI's shapes: whole objects,
or SSE chunks ending in `data: [DONE]` (responses: typed events). An error before the
first token is an HTTP error; one after it is a final `data: {"error": ...}` frame.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Iterable
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Any

from vllm_cluster.engine.errors import InvalidRequestError
from vllm_cluster.engine.sampling_params import truncate_prompt
from vllm_cluster.engine.tokenizer import apply_chat_template
from vllm_cluster.proto import cluster_pb2 as pb
from vllm_cluster.router.openai.backend import Backend, Piece
from vllm_cluster.router.openai.chat_output import ChatOutput
from vllm_cluster.router.openai.echo import completion_piece, prompt_texts
from vllm_cluster.router.openai.errors import ApiError, bad_request, error_body
from vllm_cluster.router.openai.logprobs import chat_logprobs, vllm_prompt_logprobs
from vllm_cluster.router.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    ResponsesRequest,
    _SamplingFields,
)
from vllm_cluster.router.openai.responses import output_items, response_events, response_object
from vllm_cluster.router.openai.tool_parsers import ToolParser

_MAX_SEQUENCES = 256  # Generate calls one HTTP request may fan out to (prompts x n)


def sse(data: Any) -> str:
    return f"data: {json.dumps(data, ensure_ascii=False)}\n\n"


@dataclass
class _Choice:
    """What one choice has produced so far."""

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[pb.TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: str | None = None
    usage: pb.Usage | None = None
    prompt_logprobs: list[pb.TokenLogprob] = field(default_factory=list)  # prompt tokens 1, 2, ...

    def add(self, response: pb.GenerateResponse) -> None:
        self.text += response.text
        self.token_ids += response.token_ids
        self.logprobs += response.logprobs
        self.prompt_logprobs += response.prompt_logprobs
        if response.finish_reason:
            self.finish_reason = response.finish_reason
            self.stop_reason = response.stop_reason or None
            self.usage = response.usage


@dataclass
class _Job:
    """One HTTP request: its Generate calls (choice i*n + j: prompt i, sample j)."""

    id: str
    created: int
    requests: list[pb.GenerateRequest]
    prompt_lengths: list[int]
    n: int
    choices: list[_Choice]
    model: str  # what responses name: the adapter the request asked for, else the served model
    continuous_usage: bool = False  # stream_options.continuous_usage_stats: usage on every chunk


class OpenAIServing:
    def __init__(
        self, backend: Backend, tokenizer: Any, model_name: str, max_model_len: int, reasoning_parser: str = "",
        tool_call_parser: str = "", enable_auto_tool_choice: bool = False,
    ) -> None:
        self.backend = backend
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.max_model_len = max_model_len
        self.reasoning_parser = reasoning_parser  # "": none; else one of reasoning.PARSERS
        self.tool_call_parser = tool_call_parser  # "": none; else one of tool_parsers.TOOL_CALL_PARSERS
        self.enable_auto_tool_choice = enable_auto_tool_choice  # tool_choice auto allowed

    # ---- completions

    async def completions(self, body: CompletionRequest, request_id: str) -> dict[str, Any] | AsyncIterator[str]:
        params = body.to_sampling_params()
        prompts = [self._encode(p) for p in body.prompts()]
        echoed_texts = prompt_texts(self.tokenizer, body)
        job = self._job(f"cmpl-{request_id}", body, prompts, params)
        if body.stream:
            return await self._start_stream(job, lambda p: self._completion_chunks(job, body, p, echoed_texts))
        await self._collect(job)
        choices = []
        for c in job.choices:
            prompt_ids = list(job.requests[c.index].token_ids.ids)
            echoed = (echoed_texts[c.index // job.n], prompt_ids, c.prompt_logprobs) if body.echo else None
            text, logprobs = completion_piece(self.tokenizer, body, c.text, c.logprobs, 0, echoed)
            choices.append({"index": c.index, "text": text, "finish_reason": c.finish_reason,
                            "stop_reason": c.stop_reason, "logprobs": logprobs})
            if body.prompt_logprobs is not None:
                choices[-1]["prompt_logprobs"] = vllm_prompt_logprobs(self.tokenizer, prompt_ids, c.prompt_logprobs)
        return {
            "id": job.id, "object": "text_completion", "created": job.created, "model": job.model,
            "choices": choices, "usage": self._usage(job),
        }

    async def _completion_chunks(
        self, job: _Job, body: CompletionRequest, pieces: AsyncGenerator[Piece, None], echoed_texts: list[str]
    ) -> AsyncGenerator[str, None]:
        offsets = [0] * len(job.choices)
        echo_pending = [body.echo] * len(job.choices)  # the prompt goes ahead of a choice's first piece
        async with aclosing(pieces):
            async for piece in pieces:
                r, i = piece.response, piece.index
                echoed = None
                if echo_pending[i]:
                    echo_pending[i] = False
                    echoed = (echoed_texts[i // job.n], list(job.requests[i].token_ids.ids), list(r.prompt_logprobs))
                text, logprobs = completion_piece(self.tokenizer, body, r.text, list(r.logprobs), offsets[i], echoed)
                offsets[i] += len(text)
                choice = {"index": i, "text": text, "finish_reason": r.finish_reason or None,
                          "stop_reason": r.stop_reason or None, "logprobs": logprobs}
                yield sse(self._chunk(job, "text_completion", choice, body.include_usage))
        if body.include_usage:
            yield sse({"id": job.id, "object": "text_completion", "created": job.created, "model": job.model,
                       "choices": [], "usage": self._usage(job)})

    # ---- chat completions

    async def chat(self, body: ChatCompletionRequest, request_id: str) -> dict[str, Any] | AsyncIterator[str]:
        params = body.to_sampling_params()
        tools = body.tool_use()
        parser = tools.parser(self.tool_call_parser, self.enable_auto_tool_choice)
        prompt = self._encode_chat(body.chat(), body.add_generation_prompt, body.chat_template_kwargs,
                                   tools.template_tools)
        job = self._job(f"chatcmpl-{request_id}", body, [prompt], params)
        if body.stream:
            return await self._start_stream(job, lambda pieces: self._chat_chunks(job, body, pieces, parser))
        await self._collect(job)
        choices = []
        for c in job.choices:
            output = self.chat_output(parser, tools.parallel)
            message = output.message(c.text)  # before finish_reason: whether calls were made
            choices.append({"index": c.index, "message": message,
                            "finish_reason": output.finish_reason(c.finish_reason), "stop_reason": c.stop_reason,
                            "logprobs": chat_logprobs(self.tokenizer, c.logprobs) if body.logprobs else None})
        response = {"id": job.id, "object": "chat.completion", "created": job.created, "model": job.model,
                    "choices": choices, "usage": self._usage(job)}
        if body.prompt_logprobs is not None:  # vLLM's extra: one prompt (as served: truncated), on the response
            served = list(job.requests[0].token_ids.ids)
            response["prompt_logprobs"] = vllm_prompt_logprobs(self.tokenizer, served, job.choices[0].prompt_logprobs)
        return response

    def chat_output(self, parser: ToolParser | None, parallel_tool_calls: bool = True) -> ChatOutput:
        """One choice's message or deltas, through this server's reasoning parser and `parser`."""
        return ChatOutput(self.reasoning_parser, parser, parallel_tool_calls)

    async def _chat_chunks(
        self, job: _Job, body: ChatCompletionRequest, pieces: AsyncGenerator[Piece, None], parser: ToolParser | None
    ) -> AsyncGenerator[str, None]:
        started = [False] * len(job.choices)
        outputs = [self.chat_output(parser, body.parallel_tool_calls is not False) for _ in job.choices]
        async with aclosing(pieces):
            async for piece in pieces:
                r, output = piece.response, outputs[piece.index]
                delta = output.delta(r.text, bool(r.finish_reason))
                if not started[piece.index]:
                    started[piece.index] = True
                    delta["role"] = "assistant"
                finish_reason = output.finish_reason(r.finish_reason or None)
                choice = {"index": piece.index, "delta": delta, "finish_reason": finish_reason,
                          "logprobs": chat_logprobs(self.tokenizer, list(r.logprobs)) if body.logprobs else None}
                if r.finish_reason:
                    choice["stop_reason"] = r.stop_reason or None
                yield sse(self._chunk(job, "chat.completion.chunk", choice, body.include_usage))
        if body.include_usage:
            yield sse({"id": job.id, "object": "chat.completion.chunk", "created": job.created,
                       "model": job.model, "choices": [], "usage": self._usage(job)})

    # ---- responses

    async def responses(self, body: ResponsesRequest, request_id: str) -> dict[str, Any] | AsyncIterator[str]:
        chat = body.to_chat_request()
        params = chat.to_sampling_params()
        tools = chat.tool_use()
        parser = tools.parser(self.tool_call_parser, self.enable_auto_tool_choice)
        prompt = self._encode_chat(chat.chat(), True, None, tools.template_tools)
        job = self._job(f"resp_{request_id}", chat, [prompt], params)
        output = ChatOutput(self.reasoning_parser, parser, tools.parallel)
        if body.stream:
            return await self._start_stream(
                job, lambda pieces: response_events(job, body, pieces, output, self._count_tokens), done_marker=False
            )
        await self._collect(job)
        message = output.message(job.choices[0].text)
        return response_object(job, body, "completed", output_items(job, message),
                               self._count_tokens(message.get("reasoning_content") or ""))

    # ---- tokenizer routes

    def tokenize(self, prompt: str | None, messages: list[dict[str, Any]] | None, add_special_tokens: bool,
                 add_generation_prompt: bool) -> dict[str, Any]:
        if (prompt is None) == (messages is None):
            raise bad_request("send exactly one of prompt or messages", "prompt")
        tokenizer = self._need_tokenizer()
        if messages is not None:
            tokens = self._encode_chat(messages, add_generation_prompt)
        else:
            tokens = list(tokenizer.encode(prompt, add_special_tokens=add_special_tokens))
        return {"count": len(tokens), "max_model_len": self.max_model_len, "tokens": tokens}

    def detokenize(self, tokens: list[int]) -> dict[str, Any]:
        tokenizer = self._need_tokenizer()
        self._check_vocab(tokens, "tokens")
        return {"prompt": tokenizer.decode(tokens)}

    # ---- shared

    async def check_model(self, model: str | None) -> None:
        """404 for a model that is neither the served one nor a loaded LoRA adapter (tokenizer
        routes: every adapter shares the base model's tokenizer)."""
        if model and model != self.model_name and model not in {c.id for c in await self.backend.list_models()}:
            raise ApiError(404, f"The model `{model}` does not exist.", "model")

    def _count_tokens(self, text: str) -> int:
        return len(self.tokenizer.encode(text, add_special_tokens=False)) if text and self.tokenizer else 0

    def _check_vocab(self, token_ids: Iterable[int], field: str) -> None:
        """Token ids past the tokenizer's vocabulary (/openapi.json states the bound) are a 400."""
        bad = [t for t in token_ids if self.tokenizer is not None and t >= len(self.tokenizer)]
        if bad:
            raise bad_request(f"token ids {bad[:5]} are outside the vocabulary [0, {len(self.tokenizer)})", field)

    def _need_tokenizer(self) -> Any:
        if self.tokenizer is None:
            raise bad_request("this model has no tokenizer: send token ids")
        return self.tokenizer

    def _encode(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, list):
            if any(not 0 <= t < 2**31 for t in prompt):
                raise bad_request("prompt token ids must be >= 0 and < 2**31", "prompt")
            return prompt
        return list(self._need_tokenizer().encode(prompt))

    def _encode_chat(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool,
        template_kwargs: dict[str, Any] | None = None, tools: list[dict[str, Any]] | None = None,
    ) -> list[int]:
        """`template_kwargs`: chat_template_kwargs, which may override add_generation_prompt (as in vLLM).
        `tools`: the functions offered, as the template reads them."""
        tokenizer = self._need_tokenizer()
        if not getattr(tokenizer, "chat_template", None):
            raise bad_request("this model has no chat template: use /v1/completions", "messages")
        if not messages:
            raise bad_request("messages is empty: send at least one message", "messages")
        try:
            return apply_chat_template(
                tokenizer, messages, {"add_generation_prompt": add_generation_prompt, **(template_kwargs or {})}, tools
            )
        except InvalidRequestError as e:
            raise bad_request(str(e), "chat_template_kwargs") from None

    def _job(self, job_id: str, body: _SamplingFields, prompts: list[list[int]], params: pb.SamplingParams) -> _Job:
        # Another name than the base model's names a LoRA adapter; the router says 404
        # ("The model `x` does not exist.") when no instance has it.
        model = body.model if body.model and body.model != self.model_name else ""
        if len(prompts) * body.n > _MAX_SEQUENCES:
            raise bad_request(f"{len(prompts)} prompts x n={body.n} is {len(prompts) * body.n} sequences; "
                              f"send at most {_MAX_SEQUENCES} per request", "n")
        for prompt in prompts:
            self._check_vocab(prompt, "prompt")
        self._check_vocab(params.allowed_token_ids, "allowed_token_ids")
        self._check_vocab(params.logit_bias.keys(), "logit_bias")
        prompts = [self._truncated(p, params) for p in prompts]
        requests = []
        for i, prompt in enumerate(prompts):
            self._check_context(prompt, params)
            for j in range(body.n):
                request = pb.GenerateRequest(
                    request_id=f"{job_id}-{i}-{j}", token_ids=pb.TokenIds(ids=prompt), sampling_params=params,
                    tenant_salt=body.cache_salt or "", model=model, priority=body.priority,
                )
                if params.HasField("seed") and body.n > 1:
                    request.sampling_params.seed = params.seed + j  # n samples, reproducible, not identical
                requests.append(request)
        choices = [_Choice(k) for k in range(len(requests))]
        return _Job(
            job_id, int(time.time()), requests, [len(p) for p in prompts], body.n, choices, model or self.model_name,
            continuous_usage=body.continuous_usage,
        )

    def _truncated(self, prompt: list[int], params: pb.SamplingParams) -> list[int]:
        """truncate_prompt_tokens, here so that the context check and usage see the prompt served."""
        k = params.truncate_prompt_tokens if params.HasField("truncate_prompt_tokens") else None
        try:
            return truncate_prompt(prompt, k, self.max_model_len)
        except InvalidRequestError as e:
            raise bad_request(str(e), "truncate_prompt_tokens") from None

    def _check_context(self, prompt: list[int], params: pb.SamplingParams) -> None:
        if not prompt:
            raise bad_request("the prompt is empty; send at least one token", "prompt")
        if len(prompt) >= self.max_model_len:
            raise bad_request(
                f"This model's maximum context length is {self.max_model_len} tokens. However, your request has "
                f"{len(prompt)} input tokens. Please reduce the length of the input messages.", "messages")
        if params.HasField("max_tokens") and len(prompt) + params.max_tokens > self.max_model_len:
            raise bad_request(
                f"This model's maximum context length is {self.max_model_len} tokens. However, you requested "
                f"{len(prompt) + params.max_tokens} tokens ({len(prompt)} in the messages, {params.max_tokens} in the "
                "completion). Please reduce the length of the messages or completion.", "max_tokens")

    def _pieces(self, job: _Job) -> AsyncGenerator[Piece, None]:
        return _folded(job, self.backend.generate(job.requests))

    async def _collect(self, job: _Job) -> None:
        async with aclosing(self._pieces(job)) as pieces:
            async for _ in pieces:
                pass

    async def _start_stream(
        self, job: _Job, make_events: Callable[[AsyncGenerator[Piece, None]], AsyncGenerator[str, None]],
        done_marker: bool = True,
    ) -> AsyncIterator[str]:
        """Wait for the first token, so an error before it (overload, a bad parameter the
        workers refuse) is a plain HTTP error rather than a 200 with an error frame."""
        pieces = self._pieces(job)
        try:
            first = await anext(pieces)
        except BaseException:
            await pieces.aclose()
            raise
        return _stream(make_events(_prepend(first, pieces)), done_marker)

    def _chunk(self, job: _Job, kind: str, choice: dict[str, Any], include_usage: bool) -> dict[str, Any]:
        chunk = {"id": job.id, "object": kind, "created": job.created, "model": job.model, "choices": [choice]}
        if include_usage:
            chunk["usage"] = self._choice_usage(job, choice["index"]) if job.continuous_usage else None
        return chunk

    def _choice_usage(self, job: _Job, index: int) -> dict[str, Any]:
        """One choice's usage so far (continuous_usage_stats, as vLLM counts it: per choice)."""
        prompt_tokens, completion = job.prompt_lengths[index // job.n], len(job.choices[index].token_ids)
        return {"prompt_tokens": prompt_tokens, "completion_tokens": completion,
                "total_tokens": prompt_tokens + completion}

    def _usage(self, job: _Job) -> dict[str, Any]:
        # The prompt is counted once per prompt, not once per choice (as OpenAI does).
        prompt_tokens = sum(job.prompt_lengths)
        completion = sum(c.usage.completion_tokens for c in job.choices if c.usage is not None)
        firsts = [job.choices[i * job.n].usage for i in range(len(job.prompt_lengths))]
        cached = sum(u.cached_tokens for u in firsts if u is not None)
        return {"prompt_tokens": prompt_tokens, "completion_tokens": completion,
                "total_tokens": prompt_tokens + completion, "prompt_tokens_details": {"cached_tokens": cached}}


# Each layer closes the one below it when it is closed (client gone), down to the backend,
# which cancels the Generate calls: aclosing makes that happen now, not at garbage collection.

async def _folded(job: _Job, pieces: AsyncGenerator[Piece, None]) -> AsyncGenerator[Piece, None]:
    async with aclosing(pieces):
        async for piece in pieces:
            job.choices[piece.index].add(piece.response)
            yield piece


async def _prepend(first: Piece, rest: AsyncGenerator[Piece, None]) -> AsyncGenerator[Piece, None]:
    async with aclosing(rest):
        yield first
        async for piece in rest:
            yield piece


async def _stream(events: AsyncGenerator[str, None], done_marker: bool) -> AsyncIterator[str]:
    async with aclosing(events):
        try:
            async for event in events:
                yield event
        except ApiError as e:
            yield sse(error_body(e))
    if done_marker:
        yield "data: [DONE]\n\n"

