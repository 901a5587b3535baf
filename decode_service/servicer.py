"""The decode instance: holds blocks for prompts that prefill instances fill, then decodes
them with continuous batching.

Lifecycle of a request here:
  1. `Reserve`: match the prompt against our prefix cache, allocate blocks for the rest
     (TRANSFERRING, under a lease), tell the KV receiver to expect the blocks that must
     travel, answer with the block ids, our KV endpoint and layout. No room ->
     RESOURCE_EXHAUSTED, and the router tries another instance (also when the instance has
     as many streams open as its server allows, so its Stats and health calls always run).
  2. Prefill pushes the KV straight into those blocks.
  3. `Decode`: with a first token, wait until every expected block has landed; then the
     request joins the running batch with that token. Without one (prefill skipped or
     failed), or when the KV does not arrive in time under policy `recompute`, decode
     computes the prompt itself (after the blocks another instance pushed from its cache,
     `num_pulled_blocks`, have landed: engine/kv_pull.py). Decode answers once the request
     has joined; its tokens travel on the caller's `Outputs` stream
     (decode_service/outputs.py), which carries each engine step's tokens of all the
     caller's requests as one message.
  4. `Release`, a lease that runs out, or the caller's Outputs stream ending aborts the
     request; the receiver stops writing into its blocks before they are freed.
Invariant: a block is freed only after the receiver guarantees nothing more lands in it.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator

import grpc

from vllm_cluster.decode_service.outputs import Subscribers
from vllm_cluster.engine.config import EngineRole
from vllm_cluster.engine.engine_loop import EngineLoop, RequestStream
from vllm_cluster.engine.errors import InvalidRequestError
from vllm_cluster.engine.scheduler import SampledToken
from vllm_cluster.kv_transfer import KVLayout, KVReceiver, TransferStatus
from vllm_cluster.proto import cluster_pb2 as pb
from vllm_cluster.proto import cluster_pb2_grpc as pb_grpc
from vllm_cluster.worker.convert import (
    request_from_proto,
    sampled_token_from_proto,
    worker_stats_to_proto,
)
from vllm_cluster.worker.kv_pull import wait_pulled
from vllm_cluster.worker.lora_admin import load_lora_adapter, unload_lora_adapter
from vllm_cluster.worker.rpc import StreamSlots, abort

logger = logging.getLogger(__name__)


class DecodeServicer(pb_grpc.DecodeWorkerServicer):
    def __init__(
        self,
        loop: EngineLoop,
        receiver: KVReceiver,
        layout: KVLayout,
        default_lease_s: float = 30.0,
        default_transfer_timeout_s: float = 30.0,
    ) -> None:
        self._loop = loop
        self._receiver = receiver
        self._layout = layout
        self._default_lease_s = default_lease_s
        self._default_transfer_timeout_s = default_transfer_timeout_s
        self._lock = threading.Lock()
        # Reserved, Decode not yet called: the stream, and whether logprobs were asked for.
        self._streams: dict[str, tuple[RequestStream, bool]] = {}
        # One per reservation, from Reserve until its last token is sent (or it goes unused).
        self.slots = StreamSlots()
        self.subscribers = Subscribers(self.slots.release, self._loop.abort)

    def before_abort(self, request_id: str) -> None:
        """Runs on the engine thread before a request's blocks are freed."""
        self._receiver.cancel(request_id)
        with self._lock:
            unused = self._streams.pop(request_id, None)
        if unused is not None:
            self.slots.release()

    def Reserve(self, msg: pb.ReserveRequest, context: grpc.ServicerContext) -> pb.Reservation:
        problem = self._loop.problem()
        if problem is not None:
            abort(context, grpc.StatusCode.UNAVAILABLE, problem)
        try:
            request = request_from_proto(self._loop.core, msg.request)
        except InvalidRequestError as e:
            abort(context, grpc.StatusCode.INVALID_ARGUMENT, str(e))
        lease_s = msg.lease_s or self._default_lease_s
        if not self.slots.acquire():
            abort(context, grpc.StatusCode.RESOURCE_EXHAUSTED,
                  f"this decode instance has {self.slots.limit} streams open, its limit: try another instance")
        try:
            result = self._loop.reserve(request, lease_s)
        except InvalidRequestError as e:
            self.slots.release()
            abort(context, grpc.StatusCode.INVALID_ARGUMENT, str(e))
        if result is None:
            self.slots.release()
            abort(context,
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"no room for {request.num_prompt_tokens} prompt tokens in this decode instance's "
                "KV cache right now: try another instance or retry later",
            )
        block_ids, stream = result
        num_cached = request.num_cached_tokens
        num_skip_blocks = num_cached // self._layout.block_size
        with self._lock:
            self._streams[request.request_id] = (stream, request.sampling_params.logprobs is not None)
        # The transfer id is the request id: one reservation, one transfer.
        self._receiver.expect(request.request_id, block_ids[num_skip_blocks:])
        return pb.Reservation(
            request_id=request.request_id,
            transfer_id=request.request_id,
            block_ids=block_ids,
            num_cached_tokens=num_cached,
            kv_endpoint=self._receiver.endpoint,
            layout=self._layout.to_proto(),
            lease_s=lease_s,
        )

    def Outputs(self, msg: pb.OutputsRequest, context: grpc.ServicerContext) -> Iterator[pb.DecodeOutputs]:
        if not msg.subscriber_id:
            abort(context, grpc.StatusCode.INVALID_ARGUMENT, "OutputsRequest.subscriber_id is empty: name the stream")
        yield from self.subscribers.serve(msg.subscriber_id, context.is_active)

    def Decode(self, msg: pb.DecodeRequest, context: grpc.ServicerContext) -> pb.DecodeStarted:
        request_id = msg.request_id
        with self._lock:
            reserved = self._streams.pop(request_id, None)
        if reserved is None:
            abort(context,
                grpc.StatusCode.NOT_FOUND,
                f"no reservation for request {request_id!r}: it expired, was released, or was never made",
            )
        stream, with_logprobs = reserved
        attached = False  # until then, this call holds the request's stream slot
        try:
            subscriber = self.subscribers.get(msg.subscriber_id)
            if subscriber is None:
                self._loop.abort(request_id)
                abort(context, grpc.StatusCode.FAILED_PRECONDITION,
                      f"no Outputs stream {msg.subscriber_id!r} is open here: open it before Decode")
            first_token, timings = self._wait_for_kv(msg, context, with_logprobs)
            attached = subscriber.attach(request_id, timings)
            if not attached:
                self._loop.abort(request_id)
                abort(context, grpc.StatusCode.ABORTED,  # the caller replays it elsewhere
                      f"the Outputs stream {msg.subscriber_id!r} has ended")
        finally:
            if not attached:
                self.slots.release()
        self._loop.attach(stream, subscriber)
        if not self._loop.land(request_id, first_token):
            abort(context, grpc.StatusCode.NOT_FOUND, f"request {request_id!r} was aborted before decoding started")
        return pb.DecodeStarted()

    def _wait_for_kv(
        self, msg: pb.DecodeRequest, context: grpc.ServicerContext, with_logprobs: bool
    ) -> tuple[SampledToken | None, pb.Timings]:
        """The first token to start from (None: decode computes the prompt) once the KV has
        landed or been given up on, and the timings the request's first message carries."""
        request_id = msg.request_id
        timeout_s = msg.transfer_timeout_s or self._default_transfer_timeout_s
        self._loop.call(lambda core: core.extend_lease(request_id, timeout_s + self._default_lease_s))
        start = time.monotonic()
        first_token: SampledToken | None = None
        recomputed = False
        if msg.HasField("first_token"):
            status = self._receiver.wait(request_id, timeout_s)
            if status == TransferStatus.DONE:
                first_token = sampled_token_from_proto(msg.first_token, with_logprobs)
            elif msg.on_transfer_failure == pb.FAILURE_POLICY_FAIL:
                error = f"the KV cache of request {request_id!r} did not arrive ({status.name}) within {timeout_s:.1f}s"
                self._loop.abort(request_id, error)
                abort(context, grpc.StatusCode.DATA_LOSS, error)  # the router fails the request (policy)
            else:
                logger.warning("KV of %s did not arrive (%s); computing the prompt here", request_id, status.name)
                recomputed = True
        elif msg.num_pulled_blocks:  # another instance pushed a prefix: only the rest is computed
            wait_pulled(self._loop, self._receiver, request_id, msg.num_pulled_blocks, timeout_s)
        self._receiver.cancel(request_id)  # landed or given up: nothing more may arrive
        return first_token, pb.Timings(transfer_s=time.monotonic() - start, recomputed=recomputed)

    def Release(self, msg: pb.ReleaseRequest, context: grpc.ServicerContext) -> pb.ReleaseResponse:
        return pb.ReleaseResponse(found=self._loop.abort(msg.request_id))

    def Stats(self, msg: pb.StatsRequest, context: grpc.ServicerContext) -> pb.WorkerStats:
        problem = self._loop.problem()
        if problem is not None:  # the router polls this: it stops sending here
            abort(context, grpc.StatusCode.UNAVAILABLE, problem)
        stats = self._loop.stats()
        return worker_stats_to_proto(
            stats, EngineRole.DECODE, self._layout.block_size, self._layout.model, self._receiver.endpoint
        )

    def LoadLoRAAdapter(self, msg: pb.LoRAAdapterRequest, context: grpc.ServicerContext) -> pb.LoRAAdapterResponse:
        return load_lora_adapter(self._loop, msg, context)

    def UnloadLoRAAdapter(self, msg: pb.LoRAAdapterRequest, context: grpc.ServicerContext) -> pb.LoRAAdapterResponse:
        return unload_lora_adapter(self._loop, msg, context)
