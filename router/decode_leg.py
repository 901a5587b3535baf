"""The decode leg of a request, as the router drives it: the request's outputs registered on
its decode instance's Outputs stream, `Decode` (which answers once the request has joined the
instance's batch), then the relay of its tokens to the client, with the timings and usage the
last response carries. A lost instance raises DecodeLost (router/servicer.py replays the rest
elsewhere); any other failure ends the request.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import NoReturn

import grpc

from vllm_cluster.proto import cluster_pb2 as pb
from vllm_cluster.router.calls import abort, end_aborted
from vllm_cluster.router.decode_outputs import DecodeOutputs, OutputsLost, RequestOutputs
from vllm_cluster.router.first_token import EarlyToken, drop_early_token
from vllm_cluster.router.handoff import Handoff, HandoffState
from vllm_cluster.router.migration import DecodeLost, Progress
from vllm_cluster.router.registry import Instance, Registry
from vllm_cluster.worker.router_config import RouterConfig

# A decode stream that breaks with these is replayed on another instance (max_migrations):
# the instance died or restarted (UNAVAILABLE), its engine step failed (ABORTED), or the
# reservation was gone when Decode came (NOT_FOUND: its lease ran out under load).
_MIGRATABLE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.ABORTED, grpc.StatusCode.UNKNOWN,
               grpc.StatusCode.INTERNAL, grpc.StatusCode.NOT_FOUND)



class DecodeLeg:
    def __init__(self, config: RouterConfig, registry: Registry) -> None:
        self._config = config
        self._registry = registry
        self._outputs = DecodeOutputs()

    def open_outputs(self, decode: Instance, request_id: str) -> RequestOutputs:
        try:
            return self._outputs.open(decode.name, decode.address, decode.stub, request_id)
        except OutputsLost as e:
            if e.code == grpc.StatusCode.UNAVAILABLE:
                self._registry.mark_unhealthy(decode)
            raise DecodeLost(f"{decode.name}: {e}") from e

    def start(
        self, handoff: Handoff, decode: Instance, request: pb.WorkerRequest, prefilled: pb.PrefillResponse | None,
        context: grpc.ServicerContext, num_pulled_blocks: int = 0,
    ) -> None:
        """Decode answers once the request has joined its batch; the tokens come on the Outputs stream.
        `num_pulled_blocks`: prompt blocks another instance pushed into the reservation (router/pull.py)."""
        future = decode.stub.Decode.future(
            pb.DecodeRequest(
                request_id=request.request_id,
                first_token=None if prefilled is None else prefilled.first_token,
                on_transfer_failure=_failure_policy(self._config.on_transfer_failure),
                transfer_timeout_s=self._config.transfer_timeout_s,
                subscriber_id=self._outputs.subscriber_id,
                num_pulled_blocks=num_pulled_blocks,
            )
        )
        handoff.on_abort(future.cancel)
        try:
            future.result()
        except grpc.FutureCancelledError:
            end_aborted(context, handoff)
        except grpc.RpcError as e:
            self._decode_failed(handoff, decode, e.code(), e.details() or "", context)

    def _decode_failed(
        self, handoff: Handoff, decode: Instance, code: grpc.StatusCode, details: str, context: grpc.ServicerContext
    ) -> NoReturn:
        """A migratable failure raises DecodeLost (replayed elsewhere); others end the request."""
        if handoff.state == HandoffState.ABORTED:
            end_aborted(context, handoff)
        if code in _MIGRATABLE:
            if code == grpc.StatusCode.UNAVAILABLE:
                self._registry.mark_unhealthy(decode)
            raise DecodeLost(f"{decode.name}: {code.name} {details}")
        handoff.abort(f"decode failed: {details}")
        if code == grpc.StatusCode.DATA_LOSS:  # KV hand-off failed, policy `fail`
            abort(context, grpc.StatusCode.UNAVAILABLE, f"the KV hand-off failed: {details}")
        abort(context, code, f"decode failed: {details}")

    def relay(
        self, handoff: Handoff, decode: Instance, outputs: RequestOutputs, timings: pb.Timings, arrival: float,
        context: grpc.ServicerContext, progress: Progress, early: EarlyToken | None = None,
    ) -> Iterator[pb.GenerateResponse]:
        """`early`: the first token, which the client has already (router/first_token.py)."""
        first = True
        try:
            for response in outputs:
                if first:
                    if early is not None or not progress.token_ids:
                        timings.decode_queue_s = response.timings.decode_queue_s
                    if early is None and not progress.token_ids:
                        timings.ttft_s = time.monotonic() - arrival
                    timings.transfer_s += response.timings.transfer_s
                    timings.recomputed = timings.recomputed or response.timings.recomputed
                    if not progress.token_ids and not response.prompt_logprobs:  # computed by prefill
                        response.prompt_logprobs.extend(progress.prompt_logprobs)
                    first = False
                    if early is not None and drop_early_token(response, early) and not (
                        response.token_ids or response.text or response.finish_reason
                    ):
                        continue  # it held only the token sent ahead
                if progress.pending_text:
                    response.text = progress.pending_text + response.text
                    progress.pending_text = ""
                progress.token_ids += response.token_ids
                progress.text += response.text
                if response.finish_reason:
                    # Cached where the prompt was computed: on decode, or on prefill.
                    cached = max(response.usage.cached_tokens, timings.prefill_cached_tokens)
                    response.usage.cached_tokens = min(cached, len(progress.prompt))
                    response.usage.prompt_tokens = len(progress.prompt)
                    response.usage.completion_tokens = len(progress.token_ids)
                    timings.migrations = progress.migrations
                    timings.total_s = time.monotonic() - arrival
                    response.timings.CopyFrom(timings)
                    handoff.advance(HandoffState.FINISHED)
                else:
                    response.ClearField("timings")
                yield response
        except OutputsLost as e:
            self._decode_failed(handoff, decode, e.code, e.details, context)
        if handoff.state == HandoffState.ABORTED:  # cancelled: the outputs stopped short
            end_aborted(context, handoff)


def _failure_policy(name: str) -> pb.FailurePolicy:
    return pb.FAILURE_POLICY_FAIL if name == "fail" else pb.FAILURE_POLICY_RECOMPUTE
