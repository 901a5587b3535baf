"""What a benchmark sends requests to: our cluster's gRPC client API, or any
OpenAI-compatible HTTP endpoint (ours, vLLM, SGLang, ...), so both can be measured alike.

A target sends one SampleRequest, streaming, and times it on the client: time to the
first token, the gap between streamed pieces (inter-token latency), end to end. A piece
may carry several tokens (a server coalesces the tokens of a stream whose consumer lags);
as in vLLM's `bench serve`, each piece after the first adds one gap, and the output length
is the count the server reports (gRPC: usage, else the token ids received; HTTP: usage,
else one token per piece with text). Our gRPC API also reports where the server spent the
time to first token (`server_timings`). Failures are results, never exceptions: `error`
says what kind ("RESOURCE_EXHAUSTED", "HTTP 429", "timeout", ...). A `TargetSpec` is what
builds a target, as plain data that crosses to a client process as JSON.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any, Protocol

import aiohttp
import grpc

from vllm_cluster.loadtest.datasets import SampleRequest
from vllm_cluster.loadtest.metrics import RequestResult
from vllm_cluster.proto import cluster_pb2 as pb
from vllm_cluster.proto import cluster_pb2_grpc as pb_grpc
from vllm_cluster.worker.rpc import CHANNEL_OPTIONS

_TIMING_FIELDS = ("router_s", "prefill_queue_s", "prefill_compute_s", "transfer_s", "decode_queue_s")


def prompt_path(timings: pb.Timings) -> str:
    """Who computed the prompt (metrics.PROMPT_PATHS), from the router's timings."""
    if timings.recomputed:
        return "recomputed"
    if timings.num_kv_blocks_pulled:
        return "pulled"
    return "decode" if timings.prefill_skipped else "prefill"


class Target(Protocol):
    async def start(self) -> None: ...

    async def send(self, request: SampleRequest, start_s: float) -> RequestResult:
        """`start_s`: when it was sent, relative to the run's start (kept on the result)."""

    async def close(self) -> None: ...


@dataclass(frozen=True, slots=True)
class TargetSpec:
    backend: str  # "grpc", "openai" (/v1/completions) or "openai-chat" (/v1/chat/completions)
    address: str  # host:port (grpc) or the base URL (openai*)
    model: str
    api_key: str = ""
    timeout_s: float = 600.0
    sampling: dict[str, Any] = field(default_factory=dict)

    def build(self) -> Target:
        if self.backend == "grpc":
            return GrpcTarget(self.address, self.model, self.api_key, self.timeout_s, self.sampling)
        if self.backend not in ("openai", "openai-chat"):
            raise ValueError(f"backend must be 'grpc', 'openai' or 'openai-chat', got {self.backend!r}")
        endpoint = "chat" if self.backend == "openai-chat" else "completions"
        return OpenAITarget(self.address, self.model, endpoint, self.api_key, self.timeout_s, self.sampling)


class GrpcTarget:
    """The cluster's `Generation.Generate` over gRPC (grpc.aio)."""

    def __init__(self, address: str, model: str = "", api_key: str = "", timeout_s: float = 600.0,
                 sampling: dict[str, Any] | None = None) -> None:
        self._address = address
        self._model = model
        self._metadata = (("authorization", f"Bearer {api_key}"),) if api_key else ()
        self._timeout_s = timeout_s
        self._sampling = {"temperature": 0.0, "ignore_eos": True, **(sampling or {})}
        self._channel: grpc.aio.Channel | None = None
        self._stub: Any = None

    async def start(self) -> None:
        self._channel = grpc.aio.insecure_channel(self._address, options=CHANNEL_OPTIONS)
        self._stub = pb_grpc.GenerationStub(self._channel)

    async def close(self) -> None:
        if self._channel is not None:
            await self._channel.close()

    async def send(self, request: SampleRequest, start_s: float) -> RequestResult:
        msg = pb.GenerateRequest(model=self._model, sampling_params=pb.SamplingParams(
            max_tokens=request.output_len, **self._sampling))
        if isinstance(request.prompt, str):
            msg.text = request.prompt
        else:
            msg.token_ids.ids.extend(request.prompt)
        result = RequestResult(success=False, prompt_len=request.prompt_len, start_s=start_s)
        sent = last = time.perf_counter()
        num_tokens = 0
        try:
            async for piece in self._stub.Generate(msg, metadata=self._metadata, timeout=self._timeout_s):
                now = time.perf_counter()
                num_piece_tokens = len(piece.token_ids)
                if num_piece_tokens:
                    num_tokens += num_piece_tokens
                    if result.ttft_s == 0.0:
                        result.ttft_s = now - sent
                    else:
                        result.itl_s.append(now - last)
                    last = now
                if piece.finish_reason:
                    result.output_len = piece.usage.completion_tokens
                    result.prompt_len = piece.usage.prompt_tokens or request.prompt_len
                    result.server_timings = {f: getattr(piece.timings, f) for f in _TIMING_FIELDS}
                    result.prompt_path = prompt_path(piece.timings)
            result.output_len = result.output_len or num_tokens
            result.e2e_s = time.perf_counter() - sent
            result.success = result.output_len > 0
            if not result.success:
                result.error = "no tokens"
        except grpc.RpcError as e:
            result.error = e.code().name
        return result


class OpenAITarget:
    """An OpenAI-compatible `/v1/completions` or `/v1/chat/completions`, streamed (SSE)."""

    def __init__(self, base_url: str, model: str, endpoint: str = "completions", api_key: str = "",
                 timeout_s: float = 600.0, sampling: dict[str, Any] | None = None) -> None:
        if endpoint not in ("completions", "chat"):
            raise ValueError(f"endpoint must be 'completions' or 'chat', got {endpoint!r}")
        path = "/v1/chat/completions" if endpoint == "chat" else "/v1/completions"
        self._url = base_url.rstrip("/").removesuffix("/v1") + path
        self._model = model
        self._chat = endpoint == "chat"
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._timeout = aiohttp.ClientTimeout(total=timeout_s)
        self._sampling = {"temperature": 0.0, "ignore_eos": True, **(sampling or {})}
        self._session: aiohttp.ClientSession | None = None

    async def start(self) -> None:
        # One connection per request in flight, as many as the run needs.
        self._session = aiohttp.ClientSession(timeout=self._timeout, connector=aiohttp.TCPConnector(limit=0))

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()

    def _body(self, request: SampleRequest) -> dict[str, Any]:
        body: dict[str, Any] = {"model": self._model, "max_tokens": request.output_len, "stream": True,
                                "stream_options": {"include_usage": True}, **self._sampling}
        if self._chat:
            if not isinstance(request.prompt, str):
                raise ValueError("the chat endpoint takes text prompts; use --endpoint completions for token ids")
            body["messages"] = [{"role": "user", "content": request.prompt}]
        else:
            body["prompt"] = request.prompt
        return body

    async def send(self, request: SampleRequest, start_s: float) -> RequestResult:
        assert self._session is not None
        result = RequestResult(success=False, prompt_len=request.prompt_len, start_s=start_s)
        sent = last = time.perf_counter()
        num_pieces = 0
        try:
            async with self._session.post(self._url, json=self._body(request), headers=self._headers) as response:
                if response.status != 200:
                    result.error = f"HTTP {response.status}"
                    return result
                async for raw in response.content:
                    line = raw.strip()
                    if not line.startswith(b"data:"):
                        continue
                    data = line[5:].strip()
                    if data == b"[DONE]":
                        break
                    chunk = json.loads(data)
                    if "error" in chunk:
                        result.error = "stream error"
                        return result
                    now = time.perf_counter()
                    if chunk.get("usage"):
                        result.output_len = chunk["usage"]["completion_tokens"]
                        result.prompt_len = chunk["usage"]["prompt_tokens"]
                    if _is_piece(chunk, self._chat):
                        num_pieces += 1
                        if result.ttft_s == 0.0:
                            result.ttft_s = now - sent
                        else:
                            result.itl_s.append(now - last)
                        last = now
            result.e2e_s = time.perf_counter() - sent
            result.output_len = result.output_len or num_pieces  # no usage: one token per piece, a lower bound
            result.success = result.output_len > 0
            if not result.success:
                result.error = "no tokens"
        except TimeoutError:
            result.error = "timeout"
        except aiohttp.ClientError as e:
            result.error = type(e).__name__
        return result


def _is_piece(chunk: dict[str, Any], chat: bool) -> bool:
    """A streamed piece of output. Completions: any choice, as vLLM's `bench serve` counts them
    (its text may be empty: a special token, or a model served without a tokenizer). Chat: a
    delta with content (the first chunk, the role alone, comes before any token)."""
    for choice in chunk.get("choices") or []:
        if chat and (choice.get("delta") or {}).get("content"):
            return True
        if not chat and "text" in choice:
            return True
    return False
