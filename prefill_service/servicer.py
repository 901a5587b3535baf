"""The prefill instance: computes prompts and pushes their KV into decode reservations.

Lifecycle of a request here:
  1. `Prefill(request, reservation)`: check the reservation's KV layout against ours (a
     mismatch fails the transfer at once, naming both sides' values), then queue the
     request. Prompts are batched with chunked prefill like any other engine work.
  2. In the step that completes the prompt, each layer's blocks (those the decode does not
     already hold) are pushed as soon as that layer is computed.
  3. The step ends when every push is confirmed; the request's blocks are then freed (they
     stay in our prefix cache). The reply carries the first token and the transfer outcome,
     and the prompt logprobs when they were asked for (the router relays them to the client).
  4. `Abort`, or the caller going away, drops the request; a push never outlives its step.
"""

from __future__ import annotations

import time

import grpc
import torch

from vllm_cluster.engine.config import EngineRole
from vllm_cluster.engine.engine_loop import EngineLoop
from vllm_cluster.engine.errors import InvalidRequestError
from vllm_cluster.kv_transfer import KVLayout, KVSender, TransferStatus
from vllm_cluster.metrics import InstanceMetrics
from vllm_cluster.prefill_service.push import ReservationPush
from vllm_cluster.proto import cluster_pb2 as pb
from vllm_cluster.proto import cluster_pb2_grpc as pb_grpc
from vllm_cluster.worker.convert import (
    first_token_to_proto,
    logprob_to_proto,
    request_from_proto,
    worker_stats_to_proto,
)
from vllm_cluster.worker.lora_admin import load_lora_adapter, unload_lora_adapter
from vllm_cluster.worker.rpc import abort

_STATUS = {TransferStatus.DONE: pb.TRANSFER_DONE, None: pb.TRANSFER_SKIPPED}


class PrefillServicer(pb_grpc.PrefillWorkerServicer):
    def __init__(
        self,
        loop: EngineLoop,
        sender: KVSender,
        layout: KVLayout,
        transfer_timeout_s: float = 30.0,
        metrics: InstanceMetrics | None = None,
    ) -> None:
        self._loop = loop
        self._sender = sender
        self._layout = layout
        self._transfer_timeout_s = transfer_timeout_s
        self._metrics = metrics
        self._block_bytes = _block_bytes(layout)

    def Prefill(self, msg: pb.PrefillRequest, context: grpc.ServicerContext) -> pb.PrefillResponse:
        arrival = time.monotonic()
        problem = self._loop.problem()
        if problem is not None:
            abort(context, grpc.StatusCode.UNAVAILABLE, problem)
        try:
            request = request_from_proto(self._loop.core, msg.request)
        except InvalidRequestError as e:
            abort(context, grpc.StatusCode.INVALID_ARGUMENT, str(e))
        reservation = msg.reservation
        mismatches = self._layout.mismatches(KVLayout.from_proto(reservation.layout))
        if mismatches:
            return pb.PrefillResponse(
                transfer_status=pb.TRANSFER_FAILED,
                transfer_error="KV layout mismatch between prefill and decode: " + "; ".join(mismatches)
                + ". Run both with the same model, dtype, kv_cache_dtype, block_size and parallel layout.",
            )
        push = ReservationPush(
            self._sender,
            reservation.kv_endpoint,
            reservation.transfer_id,
            list(reservation.block_ids),
            reservation.num_cached_tokens // self._layout.block_size,
            self._transfer_timeout_s,
        )
        try:
            stream = self._loop.add(request, push)
        except InvalidRequestError as e:
            abort(context, grpc.StatusCode.INVALID_ARGUMENT, str(e))
        context.add_callback(lambda: self._loop.abort(request.request_id))  # no-op once finished
        delta = stream.get()
        if delta.finish_reason == "abort":
            abort(context, grpc.StatusCode.ABORTED, delta.error or f"request {request.request_id!r} was aborted")
        assert delta.finish_reason is not None and len(delta.token_ids) == 1
        if self._metrics is not None and push.num_blocks_sent:
            self._metrics.observe_push(push.num_blocks_sent * self._block_bytes, push.transfer_s,
                                       ok=push.status == TransferStatus.DONE)
        logprob = delta.logprobs[0] if delta.logprobs else None
        elapsed = time.monotonic() - arrival
        return pb.PrefillResponse(
            first_token=first_token_to_proto(delta.token_ids[0], logprob),
            transfer_status=_STATUS.get(push.status, pb.TRANSFER_FAILED),
            transfer_error=push.error or "",
            num_blocks_sent=push.num_blocks_sent,
            queue_s=delta.queue_s,
            compute_s=max(0.0, elapsed - delta.queue_s - push.transfer_s),
            transfer_s=push.transfer_s,
            num_cached_tokens=delta.num_cached_tokens,
            prompt_logprobs=[logprob_to_proto(lp) for lp in delta.prompt_logprobs or ()],
        )

    def Abort(self, msg: pb.ReleaseRequest, context: grpc.ServicerContext) -> pb.ReleaseResponse:
        return pb.ReleaseResponse(found=self._loop.abort(msg.request_id))

    def Stats(self, msg: pb.StatsRequest, context: grpc.ServicerContext) -> pb.WorkerStats:
        problem = self._loop.problem()
        if problem is not None:  # the router polls this: it stops sending here
            abort(context, grpc.StatusCode.UNAVAILABLE, problem)
        stats = self._loop.stats()
        return worker_stats_to_proto(stats, EngineRole.PREFILL, self._layout.block_size, self._layout.model, "")

    def LoadLoRAAdapter(self, msg: pb.LoRAAdapterRequest, context: grpc.ServicerContext) -> pb.LoRAAdapterResponse:
        return load_lora_adapter(self._loop, msg, context)

    def UnloadLoRAAdapter(self, msg: pb.LoRAAdapterRequest, context: grpc.ServicerContext) -> pb.LoRAAdapterResponse:
        return unload_lora_adapter(self._loop, msg, context)


def _block_bytes(layout: KVLayout) -> int:
    """One block's KV over every layer: K and V, [block_size, num_kv_heads, head_dim] each."""
    item_bytes = torch.empty(0, dtype=getattr(torch, layout.dtype)).element_size()
    return layout.num_layers * 2 * layout.block_size * layout.num_kv_heads * layout.head_dim * item_bytes
