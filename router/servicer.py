"""The front door: the client gRPC API, driving each request through both legs.

Lifecycle of a request here:
  1. `Generate`: validate, apply the chat template, tokenize. Tokens travel as integers
     from here on.
  2. Reserve on a decode instance (ranked by the routing policy); RESOURCE_EXHAUSTED moves
     on to the next; none left -> RESOURCE_EXHAUSTED to the client.
  3. Few uncached tokens (`min_prefill_tokens`) -> skip prefill: decode computes them.
     Otherwise `Prefill` on a prefill instance, which pushes the KV into the reservation and
     answers with the first token.
  4. A failed or dead prefill, or a failed transfer: policy `recompute` lets decode compute
     the prompt itself; policy `fail` fails the request (both legs released).
  5. `Decode` streams tokens from the decode instance; the router relays them, adding the
     timings to the last response.
  6. A decode instance lost mid-stream (died, restarted, its engine step failed): the rest
     of the request is replayed on another decode instance, prompt + the tokens already
     relayed, its limits reduced by them (`max_migrations` times; 0: UNAVAILABLE). The
     client sees one stream: no token twice, none missing, text the lost instance held
     back sent first. (A stop string straddling the migration point is not detected.)
Abort (client Abort, disconnect, deadline, a failed leg) goes through the Handoff, which
releases both legs exactly once. A client's `Abort` by id reaches only requests its caller
could know (router/abort_rights.py): a router-made id (the client sent none) to whoever
holds it; a client-chosen id only over the connection that started the request.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator
from typing import Any

import grpc

from vllm_cluster.engine.config import EngineRole
from vllm_cluster.engine.errors import InvalidRequestError, ModelLoadError
from vllm_cluster.engine.lora import lora_extra_key
from vllm_cluster.kv_index import PrefixIndex, TierOverlap
from vllm_cluster.metrics import RouterMetrics
from vllm_cluster.proto import cluster_pb2 as pb
from vllm_cluster.proto import cluster_pb2_grpc as pb_grpc
from vllm_cluster.router.abort_rights import AbortRights
from vllm_cluster.router.calls import abort, end_aborted
from vllm_cluster.router.decode_leg import DecodeLeg
from vllm_cluster.router.first_token import EarlyToken, early_first_token
from vllm_cluster.router.handoff import Handoff, HandoffState
from vllm_cluster.router.lora_adapters import LoRAAdapterCallError, LoRAAdapters
from vllm_cluster.router.migration import DecodeLost, Progress, continuation, held_back_text, remaining_tokens
from vllm_cluster.router.placement import Placement
from vllm_cluster.router.policy import should_skip_prefill
from vllm_cluster.router.prompts import prepare
from vllm_cluster.router.pull import PullCost, Puller
from vllm_cluster.router.pull_cost import MeasuredPullCost
from vllm_cluster.router.registry import Registry
from vllm_cluster.worker.router_config import RouterConfig
from vllm_cluster.worker.rpc import StreamSlots

logger = logging.getLogger(__name__)


class RouterServicer(pb_grpc.GenerationServicer):
    def __init__(
        self,
        config: RouterConfig,
        registry: Registry,
        tokenizer: Any,
        model_name: str,
        max_model_len: int,
        block_size: int = 16,
        prefix_index: PrefixIndex | None = None,
        *,
        metrics: RouterMetrics | None = None,
    ) -> None:
        self._config = config
        self.metrics = metrics if metrics is not None else RouterMetrics(model_name, max_model_len)
        self._placement = Placement(config, registry, block_size, prefix_index)
        self._puller = Puller(registry, prefix_index, block_size, MeasuredPullCost(PullCost(
            config.kv_pull_link_gib_s * 2**30, config.kv_pull_recompute_tokens_s, config.kv_pull_setup_s,
        )), config.kv_pull_timeout_s) if config.kv_pull and prefix_index is not None else None
        if self._puller is not None:
            cost = self._puller.cost
            self.metrics.watch_pull_cost(lambda: cost.link_bytes_per_s, lambda: cost.recompute_tokens_per_s)
        self._registry = registry
        self.loras = LoRAAdapters(registry)
        self._tokenizer = tokenizer
        self._model_name = model_name
        self._max_model_len = max_model_len
        self._active: dict[str, Handoff] = {}
        self._abort_rights = AbortRights()
        self._lock = threading.Lock()
        self.streams = StreamSlots()
        self._decode_leg = DecodeLeg(config, registry)

    # ---- client API

    def Generate(self, msg: pb.GenerateRequest, context: grpc.ServicerContext) -> Iterator[pb.GenerateResponse]:
        if not self.streams.acquire():
            abort(context, grpc.StatusCode.RESOURCE_EXHAUSTED,
                  f"this router has {self.streams.limit} streams open, its limit: retry later, or run more routers")
        arrival = time.monotonic()
        tracked = self.metrics.start_request(arrival)
        code = "CANCELLED"  # closed before its end: the client went away
        try:
            for response in self._generate(msg, context, arrival):
                tracked.on_response(response, time.monotonic())
                yield response
            code = "OK"
        except Exception:
            code = _status_name(context)
            raise
        finally:
            tracked.end(code)
            self.streams.release()

    def _generate(
        self, msg: pb.GenerateRequest, context: grpc.ServicerContext, arrival: float
    ) -> Iterator[pb.GenerateResponse]:
        request = self._worker_request(msg, context)
        handoff = Handoff(request.request_id)
        with self._lock:
            if request.request_id in self._active:
                abort(
                    context,
                    grpc.StatusCode.ALREADY_EXISTS,
                    f"request id {request.request_id!r} is in flight: use a unique id",
                )
            self._active[request.request_id] = handoff
        context.add_callback(lambda: handoff.abort("the client went away"))
        timer = None
        if msg.deadline_s > 0:
            timer = threading.Timer(
                msg.deadline_s, handoff.abort, args=(f"deadline of {msg.deadline_s}s passed", True)
            )
            timer.daemon = True
            timer.start()
        try:
            yield from self._serve(handoff, request, context, arrival)
        finally:
            if timer is not None:
                timer.cancel()
            with self._lock:
                self._active.pop(request.request_id, None)

    def Abort(self, msg: pb.AbortRequest, context: grpc.ServicerContext) -> pb.AbortResponse:
        """found=False as well for a request this caller may not abort (router/abort_rights.py)."""
        with self._lock:
            handoff = self._active.get(msg.request_id)
        if handoff is None or not self._abort_rights.may_abort(msg.request_id, context):
            return pb.AbortResponse(found=False)
        return pb.AbortResponse(found=handoff.abort("aborted by the client"))

    def ListModels(self, msg: pb.ListModelsRequest, context: grpc.ServicerContext) -> pb.ListModelsResponse:
        cards = [pb.ModelCard(id=self._model_name, max_model_len=self._max_model_len)]
        cards += [pb.ModelCard(id=name, max_model_len=self._max_model_len, parent=self._model_name)
                  for name in sorted(self.loras.known())]
        return pb.ListModelsResponse(models=cards)

    def LoadLoRAAdapter(self, msg: pb.LoRAAdapterRequest, context: grpc.ServicerContext) -> pb.LoRAAdapterResponse:
        try:
            self.loras.load(msg.lora_name, msg.lora_path)
        except LoRAAdapterCallError as e:
            abort(context, e.code, str(e))
        return pb.LoRAAdapterResponse(changed=True)

    def UnloadLoRAAdapter(self, msg: pb.LoRAAdapterRequest, context: grpc.ServicerContext) -> pb.LoRAAdapterResponse:
        try:
            self.loras.unload(msg.lora_name)
        except LoRAAdapterCallError as e:
            abort(context, e.code, str(e))
        return pb.LoRAAdapterResponse(changed=True)

    # ---- the two legs

    def _serve(
        self, handoff: Handoff, request: pb.WorkerRequest, context: grpc.ServicerContext, arrival: float
    ) -> Iterator[pb.GenerateResponse]:
        """Both legs; if the decode instance is lost mid-stream, the rest of the request is
        replayed on another one (prompt + tokens so far) and the client's stream goes on."""
        progress = Progress(list(request.prompt_token_ids))
        timings = pb.Timings()
        leg = request
        while True:
            try:
                yield from self._leg(handoff, leg, context, arrival, progress, timings)
                return
            except DecodeLost as lost:
                if progress.migrations >= self._config.max_migrations or not handoff.restart():
                    handoff.abort(f"decode failed: {lost}")
                    abort(context, grpc.StatusCode.UNAVAILABLE, f"the decode instance failed mid-stream: {lost}")
                progress.migrations += 1
                progress.pending_text += held_back_text(self._tokenizer, request, progress)
                leg = continuation(request, progress)
                logger.warning("%s: %s; replaying on another decode instance (%d tokens so far, migration %d)",
                               request.request_id, lost, len(progress.token_ids), progress.migrations)
                if remaining_tokens(leg) == 0:  # only the last message was lost
                    yield self._finish_without_decode(request, progress, timings, arrival)
                    return

    def _leg(
        self, handoff: Handoff, request: pb.WorkerRequest, context: grpc.ServicerContext, arrival: float,
        progress: Progress, timings: pb.Timings,
    ) -> Iterator[pb.GenerateResponse]:
        overlap = self._placement.overlap(request)
        decode, reservation = self._placement.reserve(handoff, request, overlap, context)
        if not progress.migrations:
            timings.decode_cached_tokens = reservation.num_cached_tokens
        try:
            with self.metrics.num_reservations_waiting.track_inprogress():
                if not progress.migrations:
                    timings.router_s = time.monotonic() - arrival
                # Cross-instance reuse: pulled blocks replace the prefill; decode computes the rest.
                num_pulled = 0 if self._puller is None else self._puller.pull(request, decode, reservation, overlap)
                timings.num_kv_blocks_pulled += num_pulled
                prefilled = None if num_pulled else self._prefill(
                    handoff, request, reservation, overlap, timings, context)
                if prefilled is not None and not progress.migrations:
                    progress.prompt_logprobs = list(prefilled.prompt_logprobs)
                early = self._early_first_token(request, prefilled, progress)
                if early is not None:  # the client has it now; the decode instance's copy is dropped
                    progress.token_ids.append(early.token_id)
                    progress.text += early.text
                    timings.ttft_s = time.monotonic() - arrival
                    timings.first_token_early = True
                    yield pb.GenerateResponse(request_id=request.request_id, token_ids=[early.token_id],
                                              text=early.text)
                if not handoff.advance(HandoffState.DECODING):
                    end_aborted(context, handoff)
                outputs = self._decode_leg.open_outputs(decode, request.request_id)
                handoff.on_abort(outputs.cancel)
                try:
                    self._decode_leg.start(handoff, decode, request, prefilled, context, num_pulled)
                except BaseException:
                    outputs.close()
                    raise
            try:
                yield from self._decode_leg.relay(handoff, decode, outputs, timings, arrival, context, progress, early)
            finally:
                outputs.close()
        finally:
            self._registry.release(decode)
            self._placement.room_freed()  # queued requests try again

    def _early_first_token(
        self, request: pb.WorkerRequest, prefilled: pb.PrefillResponse | None, progress: Progress
    ) -> EarlyToken | None:
        """The prefill's first token, where the router sends it ahead (router/first_token.py):
        not on a replayed leg, whose text continues what the lost instance held back."""
        if prefilled is None or progress.migrations or not self._config.early_first_token:
            return None
        return early_first_token(self._tokenizer, request, prefilled)

    def _finish_without_decode(
        self, request: pb.WorkerRequest, progress: Progress, timings: pb.Timings, arrival: float
    ) -> pb.GenerateResponse:
        timings.migrations = progress.migrations
        timings.total_s = time.monotonic() - arrival
        return pb.GenerateResponse(
            request_id=request.request_id, text=progress.pending_text, finish_reason="length",
            usage=pb.Usage(prompt_tokens=len(progress.prompt), completion_tokens=len(progress.token_ids)),
            timings=timings,
        )

    def _prefill(
        self,
        handoff: Handoff,
        request: pb.WorkerRequest,
        reservation: pb.Reservation,
        overlap: dict[str, TierOverlap],
        timings: pb.Timings,
        context: grpc.ServicerContext,
    ) -> pb.PrefillResponse | None:
        """The prefill's reply (the first token, the prompt logprobs asked for), or None when
        decode is to compute the prompt itself."""
        num_prompt = len(request.prompt_token_ids)
        colocated = not self._registry.of_role(EngineRole.PREFILL)  # no prefill instance at all
        if colocated or should_skip_prefill(num_prompt, reservation.num_cached_tokens, self._config.min_prefill_tokens):
            timings.prefill_skipped = True
            return None
        names = self._placement.rank(EngineRole.PREFILL, request, overlap)
        if not names:
            return self._prefill_failed(handoff, timings, context, "no healthy prefill instance")
        instance = self._registry.acquire(names[0])
        try:
            if not handoff.advance(HandoffState.PREFILLING):
                end_aborted(context, handoff)
            future = instance.stub.Prefill.future(
                pb.PrefillRequest(request=request, reservation=reservation), timeout=self._config.prefill_timeout_s
            )
            handoff.on_abort(future.cancel)
            handoff.on_abort(lambda: instance.stub.Abort(pb.ReleaseRequest(request_id=request.request_id), timeout=5.0))
            try:
                reply = future.result()
            except grpc.FutureCancelledError:
                end_aborted(context, handoff)
            except grpc.RpcError as e:
                if e.code() == grpc.StatusCode.INVALID_ARGUMENT:
                    handoff.abort(e.details() or "invalid request")
                    abort(context, e.code(), e.details())
                if e.code() == grpc.StatusCode.UNAVAILABLE:
                    self._registry.mark_unhealthy(instance)
                return self._prefill_failed(
                    handoff, timings, context, f"{instance.name}: {e.code().name} {e.details()}"
                )
        finally:
            self._registry.release(instance)
        timings.prefill_queue_s = reply.queue_s
        timings.prefill_compute_s = reply.compute_s
        if self._puller is not None:  # what a pull saves: this prefill's prompt rate
            self._puller.cost.observe_prompt(num_prompt - reply.num_cached_tokens, reply.compute_s)
        timings.transfer_s = reply.transfer_s
        timings.num_kv_blocks_sent = reply.num_blocks_sent
        timings.prefill_cached_tokens = reply.num_cached_tokens
        if reply.transfer_status not in (pb.TRANSFER_DONE, pb.TRANSFER_SKIPPED):
            return self._prefill_failed(
                handoff, timings, context, f"{instance.name}: KV transfer failed: {reply.transfer_error}"
            )
        if not handoff.advance(HandoffState.TRANSFERRED):
            end_aborted(context, handoff)
        return reply

    def _prefill_failed(
        self, handoff: Handoff, timings: pb.Timings, context: grpc.ServicerContext, error: str
    ) -> pb.PrefillResponse | None:
        """Fail the request (policy `fail`) or let decode compute the prompt (`recompute`)."""
        if self._config.on_transfer_failure == "fail":
            handoff.abort(error)
            abort(context, grpc.StatusCode.UNAVAILABLE, f"prefill failed: {error}")
        logger.warning("%s: prefill failed (%s); decode computes the prompt", handoff.request_id, error)
        timings.recomputed = True
        return None

    # ---- helpers

    def _worker_request(self, msg: pb.GenerateRequest, context: grpc.ServicerContext) -> pb.WorkerRequest:
        lora_name = msg.model if msg.model and msg.model != self._model_name else ""
        if lora_name and lora_name not in self.loras.known():
            served = " and the LoRA adapters " + ", ".join(sorted(self.loras.known())) if self.loras.known() else ""
            abort(context, grpc.StatusCode.NOT_FOUND,
                  f"The model `{msg.model}` does not exist. This cluster serves '{self._model_name}'{served}.")
        try:
            prompt, sampling_params = prepare(self._tokenizer, msg, self._max_model_len)
        except (InvalidRequestError, ModelLoadError) as e:
            abort(context, grpc.StatusCode.INVALID_ARGUMENT, str(e))
        return pb.WorkerRequest(
            request_id=self._abort_rights.claim(msg.request_id, context),
            prompt_token_ids=prompt,
            sampling_params=sampling_params,
            priority=msg.priority,
            extra_keys=(
                ([msg.tenant_salt] if msg.tenant_salt else []) + ([lora_extra_key(lora_name)] if lora_name else [])
            ),
            lora_name=lora_name,
        )


def _status_name(context: grpc.ServicerContext) -> str:
    """The status an aborted call ends with (abort() sets it); UNKNOWN for an unexpected error."""
    code = context.code()
    return code.name if isinstance(code, grpc.StatusCode) else "UNKNOWN"
