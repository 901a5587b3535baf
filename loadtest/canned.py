"""A stand-in server that streams canned tokens as fast as it can, so the load generator can
be measured and tested with no model behind it: our gRPC `Generation` API and OpenAI's
streamed `/v1/completions` and `/v1/chat/completions` (the chunk shapes our router sends),
plus `ListModels` and `/v1/models`.

Every request gets exactly its max_tokens tokens (16 when unset), `tokens_per_message` of
them in each streamed message (the last may carry fewer): 1 is the worst case for a
client, one message per token; more is what a server sends when it coalesces the tokens
of a stream whose consumer lags. The last message finishes with "length"; usage counts
the prompt's token ids (a text prompt: its words) and the tokens sent. Each message is
written on its own turn of the event loop, so concurrent streams interleave as a server's
decode steps make them do. Both listeners share one asyncio loop; run the server as its
own process, so that it and the client under test never share a GIL:

    python -m vllm_cluster.loadtest.canned --grpc-port 50051 --http-port 8000 --tokens-per-message 8

Once both listen it prints one JSON line, {"grpc_port": P, "http_port": Q} (port 0: any
free port), which `canned_server` (for tests and benchmarks) reads.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from typing import Any

import grpc
from aiohttp import web

from vllm_cluster.proto import cluster_pb2 as pb
from vllm_cluster.proto import cluster_pb2_grpc as pb_grpc

DEFAULT_MAX_TOKENS = 16  # what our API and OpenAI's give a request that sets none
CANNED_TOKEN_ID = 42
CANNED_TEXT = " t"  # the text of one canned token


@dataclass(frozen=True, slots=True)
class CannedConfig:
    model: str = "canned"
    tokens_per_message: int = 1
    grpc_port: int = 0  # 0: any free port
    http_port: int = 0

    def __post_init__(self) -> None:
        if self.tokens_per_message < 1:
            raise ValueError(f"tokens_per_message must be >= 1, got {self.tokens_per_message}")


def message_sizes(max_tokens: int, tokens_per_message: int) -> list[int]:
    """How many tokens each streamed message of a request carries."""
    full, rest = divmod(max_tokens, tokens_per_message)
    return [tokens_per_message] * full + ([rest] if rest else [])


class CannedGeneration(pb_grpc.GenerationServicer):
    """The `Generation` service over grpc.aio: canned streams, the model, and LoRA adapters
    that are only names (loaded, listed, unloaded; nothing is read from their paths)."""

    def __init__(self, config: CannedConfig) -> None:
        self._config = config
        self._adapters: dict[str, str] = {}  # name -> path

    async def Generate(  # noqa: N802 (the gRPC method's name)
        self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.GenerateResponse]:
        params = request.sampling_params
        max_tokens = params.max_tokens if params.HasField("max_tokens") else DEFAULT_MAX_TOKENS
        if max_tokens < 1:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"max_tokens must be >= 1, got {max_tokens}")
        sizes = message_sizes(max_tokens, self._config.tokens_per_message)
        with_logprobs = params.HasField("logprobs")
        full = _response(request.request_id, sizes[0], with_logprobs)  # every message but the last is this one
        last = _response(request.request_id, sizes[-1], with_logprobs)
        last.finish_reason = "length"
        last.usage.prompt_tokens = _grpc_prompt_len(request)
        last.usage.completion_tokens = max_tokens
        for i, response in enumerate([full] * (len(sizes) - 1) + [last]):
            yield _with_prompt_logprobs(response, request) if i == 0 else response

    async def ListModels(  # noqa: N802
        self, request: pb.ListModelsRequest, context: grpc.aio.ServicerContext
    ) -> pb.ListModelsResponse:
        return pb.ListModelsResponse(models=[pb.ModelCard(id=self._config.model)])

    async def Abort(  # noqa: N802
        self, request: pb.AbortRequest, context: grpc.aio.ServicerContext
    ) -> pb.AbortResponse:
        return pb.AbortResponse(found=False)  # a canned stream has nothing to stop early

    async def LoadLoRAAdapter(  # noqa: N802
        self, request: pb.LoRAAdapterRequest, context: grpc.aio.ServicerContext
    ) -> pb.LoRAAdapterResponse:
        if not request.lora_name or not request.lora_path:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "give lora_name and lora_path")
        changed = self._adapters.get(request.lora_name) != request.lora_path
        self._adapters[request.lora_name] = request.lora_path
        return pb.LoRAAdapterResponse(changed=changed)

    async def UnloadLoRAAdapter(  # noqa: N802
        self, request: pb.LoRAAdapterRequest, context: grpc.aio.ServicerContext
    ) -> pb.LoRAAdapterResponse:
        if request.lora_name not in self._adapters:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"no LoRA adapter named {request.lora_name!r} is loaded")
        del self._adapters[request.lora_name]
        return pb.LoRAAdapterResponse(changed=True)


def _response(request_id: str, num_tokens: int, with_logprobs: bool) -> pb.GenerateResponse:
    """`with_logprobs`: each canned token is certain (logprob 0, rank 1), as the sampled tokens' logprobs."""
    certain = [pb.TokenLogprob(token_id=CANNED_TOKEN_ID, logprob=0.0, rank=1)] * num_tokens if with_logprobs else []
    return pb.GenerateResponse(
        request_id=request_id, token_ids=[CANNED_TOKEN_ID] * num_tokens, text=CANNED_TEXT * num_tokens, logprobs=certain
    )


def _with_prompt_logprobs(response: pb.GenerateResponse, request: pb.GenerateRequest) -> pb.GenerateResponse:
    """The first message carries prompt_logprobs when asked for: every prompt token after the
    first, certain (logprob 0, rank 1), as a decode instance reports them."""
    if not request.sampling_params.HasField("prompt_logprobs"):
        return response
    first = pb.GenerateResponse()
    first.CopyFrom(response)
    first.prompt_logprobs.extend(pb.TokenLogprob(token_id=t, logprob=0.0, rank=1) for t in request.token_ids.ids[1:])
    return first


def _grpc_prompt_len(request: pb.GenerateRequest) -> int:
    kind = request.WhichOneof("prompt")
    if kind == "token_ids":
        return len(request.token_ids.ids)
    if kind == "chat":
        return sum(len(m.content.split()) for m in request.chat.messages)
    return len(request.text.split())


class CannedOpenAI:
    """The streamed OpenAI endpoints over aiohttp."""

    def __init__(self, config: CannedConfig) -> None:
        self._config = config
        self._num_requests = 0

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/chat/completions", self.completions)
        app.router.add_get("/v1/models", self.models)
        return app

    async def models(self, request: web.Request) -> web.Response:
        card = {"id": self._config.model, "object": "model", "created": 0, "owned_by": "vllm-cluster"}
        return web.json_response({"object": "list", "data": [card]})

    async def completions(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        chat = request.path == "/v1/chat/completions"
        max_tokens = body.get("max_completion_tokens") if chat else None
        max_tokens = max_tokens or body.get("max_tokens") or DEFAULT_MAX_TOKENS
        if not body.get("stream"):
            return _error(400, 'the canned server only streams: set "stream": true')
        if not isinstance(max_tokens, int) or max_tokens < 1:
            return _error(400, f"max_tokens must be an integer >= 1, got {max_tokens!r}")
        self._num_requests += 1
        stream = _Stream(
            f"{'chatcmpl' if chat else 'cmpl'}-{self._num_requests}",
            self._config.model,
            chat,
            bool((body.get("stream_options") or {}).get("include_usage")),
            int(time.time()),
        )
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await response.prepare(request)
        sizes = message_sizes(max_tokens, self._config.tokens_per_message)
        full = stream.chunk(sizes[0], first=False, finish=False)
        for i, size in enumerate(sizes):
            first, last = i == 0, i == len(sizes) - 1
            await response.write(stream.chunk(size, first, last) if first or last else full)
            await asyncio.sleep(0)  # let the other streams write theirs
        if stream.include_usage:
            await response.write(stream.usage_chunk(_http_prompt_len(body, chat), max_tokens))
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response


@dataclass(frozen=True, slots=True)
class _Stream:
    """One streamed response's SSE chunks, shaped as our router's HTTP front shapes them."""

    id: str
    model: str
    chat: bool
    include_usage: bool
    created: int = 0

    def chunk(self, num_tokens: int, first: bool, finish: bool) -> bytes:
        text = CANNED_TEXT * num_tokens
        choice: dict[str, Any]
        if self.chat:
            delta = {"role": "assistant", "content": text} if first else {"content": text}
            choice = {"index": 0, "delta": delta, "finish_reason": "length" if finish else None, "logprobs": None}
            if finish:
                choice["stop_reason"] = None
        else:
            choice = {
                "index": 0,
                "text": text,
                "finish_reason": "length" if finish else None,
                "stop_reason": None,
                "logprobs": None,
            }
        chunk = self._header() | {"choices": [choice]}
        if self.include_usage:
            chunk["usage"] = None
        return _sse(chunk)

    def usage_chunk(self, prompt_tokens: int, completion_tokens: int) -> bytes:
        usage = {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": 0},
        }
        return _sse(self._header() | {"choices": [], "usage": usage})

    def _header(self) -> dict[str, Any]:
        kind = "chat.completion.chunk" if self.chat else "text_completion"
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model}


def _sse(data: dict[str, Any]) -> bytes:
    return f"data: {json.dumps(data)}\n\n".encode()


def _error(status: int, message: str) -> web.Response:
    body = {"error": {"message": message, "type": "BadRequestError", "code": status}}
    return web.json_response(body, status=status)


def _http_prompt_len(body: dict[str, Any], chat: bool) -> int:
    if chat:
        return sum(len(str(m.get("content", "")).split()) for m in body.get("messages") or [])
    prompt = body.get("prompt")
    return len(prompt) if isinstance(prompt, list) else len(str(prompt or "").split())


async def serve(config: CannedConfig) -> None:
    """Serve until cancelled; print the ports as one JSON line once both listen."""
    server = grpc.aio.server()
    pb_grpc.add_GenerationServicer_to_server(CannedGeneration(config), server)
    grpc_port = server.add_insecure_port(f"127.0.0.1:{config.grpc_port}")
    await server.start()
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", config.http_port))
    runner = web.AppRunner(CannedOpenAI(config).app(), access_log=None)
    await runner.setup()
    await web.SockSite(runner, sock).start()
    print(json.dumps({"grpc_port": grpc_port, "http_port": sock.getsockname()[1]}), flush=True)
    try:
        await asyncio.Event().wait()
    finally:
        await runner.cleanup()
        await server.stop(grace=None)


@dataclass(frozen=True, slots=True)
class CannedAddresses:
    grpc_address: str  # host:port
    base_url: str  # http://host:port
    pid: int


@contextlib.contextmanager
def canned_server(config: CannedConfig | None = None) -> Iterator[CannedAddresses]:
    """The canned server in a process of its own, stopped on exit."""
    config = config or CannedConfig()
    command = [
        sys.executable,
        "-m",
        "vllm_cluster.loadtest.canned",
        "--model",
        config.model,
        "--tokens-per-message",
        str(config.tokens_per_message),
        "--grpc-port",
        str(config.grpc_port),
        "--http-port",
        str(config.http_port),
    ]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, text=True)
    try:
        assert process.stdout is not None
        line = process.stdout.readline()
        if not line:
            raise RuntimeError(f"the canned server exited with code {process.wait()} before listening; see its stderr")
        ports = json.loads(line)
        yield CannedAddresses(f"127.0.0.1:{ports['grpc_port']}", f"http://127.0.0.1:{ports['http_port']}", process.pid)
    finally:
        process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m vllm_cluster.loadtest.canned",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--grpc-port", type=int, default=0, help="0: any free port")
    parser.add_argument("--http-port", type=int, default=0, help="0: any free port")
    parser.add_argument("--tokens-per-message", type=int, default=1, help="tokens in each streamed message")
    parser.add_argument("--model", default="canned", help="the model name the server reports")
    args = parser.parse_args(argv)
    try:
        config = CannedConfig(args.model, args.tokens_per_message, args.grpc_port, args.http_port)
    except ValueError as e:
        parser.error(str(e))
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(serve(config))


if __name__ == "__main__":
    main()
