"""A gRPC client for the cluster's Generation API (the router).

    with Client("127.0.0.1:50051", api_key="...") as client:
        with client.stream(chat=[{"role": "user", "content": "Hi"}], max_tokens=32) as stream:
            for piece in stream:                 # stream.cancel() hangs up: both legs are aborted
                print(piece.text, end="")
        result = client.generate("The capital of France is", max_tokens=8, temperature=0)

Every failure is a `ClientError` whose `.code` is the grpc.StatusCode:
  INVALID_ARGUMENT    bad sampling parameters, an empty or too long prompt: change the request
  NOT_FOUND           `model` is not the one this cluster serves (see `list_models()`)
  RESOURCE_EXHAUSTED  no decode instance has room for the request now: retry later
  UNAVAILABLE         the router, or the instances behind it, cannot be reached
  DEADLINE_EXCEEDED   the call's `timeout_s` or the request's `deadline_s` passed
  UNAUTHENTICATED     the router wants an API key and this one is missing or wrong
  CANCELLED           the request was aborted (`abort(request_id)` by the Client that started it)
  ALREADY_EXISTS      a request with this `request_id` is in flight
A stream cancelled by its own caller just ends: that is not an error.

Two deadlines: `timeout_s` is the gRPC deadline of one call (the client gives up, the
router sees the hang-up and aborts the request); `deadline_s` travels in the request and
the router aborts it itself once that many seconds have passed.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc

from vllm_cluster.proto import cluster_pb2 as pb
from vllm_cluster.proto import cluster_pb2_grpc as pb_grpc
from vllm_cluster.worker.rpc import CHANNEL_OPTIONS, retry_after_s


class ClientError(Exception):
    """A failed call: `code` (grpc.StatusCode), the server's `message` and, when the cluster
    was full (RESOURCE_EXHAUSTED), `retry_after_s`: the router's estimate of when to retry."""

    def __init__(self, code: grpc.StatusCode, message: str, retry_after_s: int | None = None) -> None:
        super().__init__(f"{code.name}: {message}")
        self.code = code
        self.message = message
        self.retry_after_s = retry_after_s


@dataclass(slots=True)
class Completion:
    request_id: str
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str = ""  # "stop", "length", "abort"; "" when the stream was cancelled
    stop_reason: str = ""
    usage: pb.Usage | None = None
    timings: pb.Timings | None = None
    # prompt_logprobs asked for: prompt tokens 1, 2, ... (the first has none)
    prompt_logprobs: list[pb.TokenLogprob] = field(default_factory=list)

    def add(self, piece: pb.GenerateResponse) -> None:
        self.text += piece.text
        self.token_ids += piece.token_ids
        self.prompt_logprobs += piece.prompt_logprobs
        if piece.finish_reason:
            self.finish_reason = piece.finish_reason
            self.stop_reason = piece.stop_reason
            self.usage = piece.usage
            self.timings = piece.timings


class Stream:
    """One Generate call. Iterate it for the pieces (the last one carries finish_reason,
    usage and timings); `cancel()` hangs up, from any thread, and the iteration then ends."""

    def __init__(self, call: Any, request_id: str) -> None:
        self._call = call
        self.request_id = request_id
        self.cancelled = False

    def __iter__(self) -> Iterator[pb.GenerateResponse]:
        try:
            yield from self._call
        except grpc.RpcError as e:
            if not self.cancelled:
                raise _client_error(e) from None

    def cancel(self) -> None:
        self.cancelled = True
        self._call.cancel()

    def collect(self) -> Completion:
        """The rest of the stream as one Completion."""
        result = Completion(self.request_id)
        for piece in self:
            result.add(piece)
        return result

    def __enter__(self) -> Stream:
        return self

    def __exit__(self, *exc: object) -> None:
        if self._call.is_active():  # left early: free the request's blocks now
            self.cancel()


class Client:
    """The router's client API. `api_key` is sent as `authorization: Bearer <key>` on every
    call; `timeout_s` is the default gRPC deadline of each call (None: none). `tls_ca`: a
    PEM file of the CA (or the self-signed certificate) to trust, for a router serving TLS
    (True: the system's trust store)."""

    def __init__(
        self, address: str, api_key: str | None = None, timeout_s: float | None = None,
        tls_ca: str | Path | bool | None = None,
    ) -> None:
        self.address = address
        self.timeout_s = timeout_s
        self._metadata = (("authorization", f"Bearer {api_key}"),) if api_key else ()
        if tls_ca:
            roots = None if tls_ca is True else Path(tls_ca).read_bytes()
            credentials = grpc.ssl_channel_credentials(root_certificates=roots)
            self._channel = grpc.secure_channel(address, credentials, options=CHANNEL_OPTIONS)
        else:
            self._channel = grpc.insecure_channel(address, options=CHANNEL_OPTIONS)
        self._stub = pb_grpc.GenerationStub(self._channel)

    def stream(
        self,
        text: str | None = None,
        *,
        token_ids: list[int] | None = None,
        chat: list[dict[str, Any]] | None = None,
        model: str = "",
        request_id: str = "",
        deadline_s: float = 0.0,
        timeout_s: float | None = None,
        tenant_salt: str = "",
        priority: int = 0,
        chat_template_kwargs: dict[str, Any] | None = None,
        tools: list[dict[str, Any]] | None = None,
        **sampling: Any,
    ) -> Stream:
        """Start a generation. The prompt is one of `text`, `token_ids` or `chat` (a list of
        {"role", "content"} messages, templated by the router). `sampling` takes the
        SamplingParams fields: max_tokens=64, temperature=0, stop=["\\n"], ...
        `request_id` ("": a fresh one) is what `abort` takes; the Stream carries it.
        `priority`: lower is served first by instances with scheduling_policy: priority.
        `chat_template_kwargs`: extra variables of the chat template (e.g. enable_thinking).
        `tools`: OpenAI's function tools, given to the chat template (an assistant message
        may carry `tool_calls` and a tool message `tool_call_id`, as in OpenAI's API); the
        calls the model writes come back as text."""
        if sum(p is not None for p in (text, token_ids, chat)) != 1:
            raise TypeError("give exactly one prompt: text, token_ids or chat")
        request = pb.GenerateRequest(
            request_id=request_id or uuid.uuid4().hex,
            model=model,
            sampling_params=_sampling_params(sampling),
            deadline_s=deadline_s,
            tenant_salt=tenant_salt,
            priority=priority,
        )
        if text is not None:
            request.text = text
        elif token_ids is not None:
            request.token_ids.ids.extend(token_ids)
        elif chat is not None:
            request.chat.messages.extend(_chat_message(m) for m in chat)
            if chat_template_kwargs:
                request.chat.chat_template_kwargs_json = json.dumps(chat_template_kwargs)
            if tools:
                request.chat.tools_json = json.dumps(tools)
        call = self._stub.Generate(request, timeout=self._timeout(timeout_s), metadata=self._metadata)
        return Stream(call, request.request_id)

    def generate(self, *args: Any, **kwargs: Any) -> Completion:
        """The whole completion; takes the arguments of `stream`."""
        with self.stream(*args, **kwargs) as stream:
            return stream.collect()

    def abort(self, request_id: str, timeout_s: float | None = None) -> bool:
        """Abort a request in flight (its stream ends with CANCELLED); False if none is that
        this caller may abort: the router aborts a client-chosen id only for the connection
        that started it, so abort through the Client that streams it."""
        try:
            reply = self._stub.Abort(pb.AbortRequest(request_id=request_id), timeout=self._timeout(timeout_s),
                                     metadata=self._metadata)
        except grpc.RpcError as e:
            raise _client_error(e) from None
        return bool(reply.found)

    def list_models(self, timeout_s: float | None = None) -> list[pb.ModelCard]:
        try:
            reply = self._stub.ListModels(pb.ListModelsRequest(), timeout=self._timeout(timeout_s),
                                          metadata=self._metadata)
        except grpc.RpcError as e:
            raise _client_error(e) from None
        return list(reply.models)

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _timeout(self, timeout_s: float | None) -> float | None:
        return self.timeout_s if timeout_s is None else timeout_s


def _chat_message(message: dict[str, Any]) -> pb.ChatMessage:
    msg = pb.ChatMessage(role=message["role"], content=message.get("content") or "",
                         tool_call_id=message.get("tool_call_id") or "")
    if message.get("tool_calls"):
        msg.tool_calls_json = json.dumps(message["tool_calls"])
    return msg


def _sampling_params(fields: dict[str, Any]) -> pb.SamplingParams:
    try:
        return pb.SamplingParams(**fields)
    except ValueError as e:  # an unknown field name
        raise TypeError(f"{e}: sampling parameters are the fields of SamplingParams in proto/cluster.proto") from None


def _client_error(e: grpc.RpcError) -> ClientError:
    code = e.code() if isinstance(e, grpc.Call) else grpc.StatusCode.UNKNOWN
    details = e.details() if isinstance(e, grpc.Call) else str(e)
    return ClientError(code, details or code.name.lower(), retry_after_s(e))
