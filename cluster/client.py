"""A small gRPC client for the cluster's Generation API.

    client = Client("127.0.0.1:50051")
    for piece in client.stream(chat=[{"role": "user", "content": "Hi"}], max_tokens=32):
        print(piece.text, end="")
    result = client.generate(text="The capital of France is", max_tokens=8, temperature=0)
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import grpc

from proto import cluster_pb2 as pb
from proto import cluster_pb2_grpc as pb_grpc
from proto.rpc import CHANNEL_OPTIONS


@dataclass(slots=True)
class Completion:
    request_id: str
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str = ""
    stop_reason: str = ""
    usage: pb.Usage | None = None
    timings: pb.Timings | None = None


class Client:
    def __init__(self, address: str) -> None:
        self.channel = grpc.insecure_channel(address, options=CHANNEL_OPTIONS)
        self.stub = pb_grpc.GenerationStub(self.channel)

    def stream(
        self,
        text: str | None = None,
        token_ids: list[int] | None = None,
        chat: list[dict[str, str]] | None = None,
        request_id: str = "",
        deadline_s: float = 0.0,
        timeout_s: float | None = None,
        tenant_salt: str = "",
        **sampling: Any,
    ) -> Iterator[pb.GenerateResponse]:
        """Server-streamed responses (the gRPC call: iterate it, or `.cancel()` it to hang up);
        `sampling` takes SamplingParams fields (max_tokens=..)."""
        request = pb.GenerateRequest(
            request_id=request_id,
            sampling_params=pb.SamplingParams(**sampling),
            deadline_s=deadline_s,
            tenant_salt=tenant_salt,
        )
        if text is not None:
            request.text = text
        elif token_ids is not None:
            request.token_ids.ids.extend(token_ids)
        elif chat is not None:
            request.chat.messages.extend(pb.ChatMessage(role=m["role"], content=m["content"]) for m in chat)
        return self.stub.Generate(request, timeout=timeout_s)

    def generate(self, **kwargs: Any) -> Completion:
        """The whole completion; raises grpc.RpcError with the server's message on failure."""
        result = Completion(request_id="")
        for response in self.stream(**kwargs):
            result.request_id = response.request_id
            result.text += response.text
            result.token_ids += list(response.token_ids)
            if response.finish_reason:
                result.finish_reason = response.finish_reason
                result.stop_reason = response.stop_reason
                result.usage = response.usage
                result.timings = response.timings
        return result

    def abort(self, request_id: str) -> bool:
        return bool(self.stub.Abort(pb.AbortRequest(request_id=request_id)).found)

    def list_models(self) -> list[pb.ModelCard]:
        return list(self.stub.ListModels(pb.ListModelsRequest()).models)

    def close(self) -> None:
        self.channel.close()
