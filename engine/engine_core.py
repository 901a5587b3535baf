"""The engine core every instance runs: requests in, one step at a time, token updates out.

step(): scheduler.schedule() -> model_runner.execute() -> sampler -> scheduler.update_from_output().
With tensor/pipeline parallelism (config.parallel) a ParallelExecutor runs the step on
every rank instead (engine/parallel/); scheduling and sampling stay here, on rank 0.
With async scheduling (config.async_scheduling, on by default for CUDA) an AsyncStepper
runs step() instead: step N+1 is scheduled and launched before step N's tokens are applied
(engine/async_stepper.py).
A bad request is refused in `make_request` with an InvalidRequestError; it never reaches
the loop, so the engine keeps serving.

Roles:
  colocated  requests in, tokens out.
  prefill    a request carries a KVPush; it stops after its first token. In the step that
             completes its prompt, each layer's blocks are pushed as soon as that layer is
             computed; the step ends only when every push is confirmed, so its blocks are
             never reused under a send in flight.
  decode     `reserve` holds blocks for a prompt (TRANSFERRING), `land` starts decoding
             from the first token once the prefill's KV is in them, or computes the prompt
             here when the hand-off failed. Reservations not landed by their lease expire.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Protocol

import torch

from vllm_cluster.engine.async_stepper import AsyncStepper
from vllm_cluster.engine.config import EngineConfig
from vllm_cluster.engine.device_tokens import DeviceTokens
from vllm_cluster.engine.errors import ConfigError, InvalidRequestError
from vllm_cluster.engine.kv_cache_manager import KVCacheManager
from vllm_cluster.engine.loader import ModelSource, load_model, resolve
from vllm_cluster.engine.lora import LoRAAdapterError, LoRAManager, load_adapter, lora_extra_key
from vllm_cluster.engine.model_runner import ModelRunner, kv_cache_block_bytes
from vllm_cluster.engine.models import CausalLM, ModelArchConfig
from vllm_cluster.engine.models.kv_scales import warn_once_if_unscaled
from vllm_cluster.engine.parallel.executor import ParallelExecutor
from vllm_cluster.engine.parallel.topology import check_expert_parallel
from vllm_cluster.engine.request import Request, RequestId, RequestStatus
from vllm_cluster.engine.resolve import (
    available_memory_bytes,
    max_model_len,
    resolve_device,
    resolve_dtype,
    resolve_kv_cache_dtype,
    use_async_scheduling,
)
from vllm_cluster.engine.sampler import Sampler
from vllm_cluster.engine.sampling_params import SamplingParams
from vllm_cluster.engine.scheduler import RequestUpdate, SampledToken, Scheduler
from vllm_cluster.engine.scheduler_output import SchedulerOutput

logger = logging.getLogger(__name__)



@dataclass(frozen=True, slots=True)
class EngineStats:
    num_running: int
    num_waiting: int
    kv_cache_usage: float
    num_free_blocks: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_preemptions: int
    num_transferring: int = 0
    num_total_blocks: int = 0
    # Since start: prompts computed here, tokens sampled here, finished requests by reason.
    num_prompt_tokens: int = 0
    num_generation_tokens: int = 0
    num_finished: dict[str, int] = field(default_factory=dict)
    # LoRA adapters loaded here, and those resident in a slot now (the router routes by them).
    lora_names: tuple[str, ...] = ()
    lora_resident_names: tuple[str, ...] = ()


class KVPush(Protocol):
    """Where a prefill request's KV goes: the decode's reserved blocks, one layer at a time."""

    num_skip_blocks: int  # leading prompt blocks the decode side already holds

    def push_layer(self, layer: int, src_block_ids: list[int]) -> None:
        """Queue layer `layer` of these blocks (prompt blocks from num_skip_blocks on)."""

    def finish(self) -> None:
        """Block until every queued layer is sent (or failed; the push records which)."""


class EngineCore:
    def __init__(self, config: EngineConfig, model: CausalLM | None = None) -> None:
        """`model`: weights already loaded for the same config.model (reused, not copied)."""
        self.config = config
        if config.num_threads is not None:
            torch.set_num_threads(config.num_threads)
        self.device = resolve_device(config.device)
        self.dtype = resolve_dtype(config.model.dtype, self.device)
        self.kv_cache_dtype = resolve_kv_cache_dtype(config.cache.kv_cache_dtype, self.dtype)
        self.source: ModelSource = resolve(config.model)
        if self.source.quantization is not None and config.parallel.world_size > 1:
            raise ConfigError(
                f"the checkpoint is quantized ({self.source.quantization}), which runs on one process "
                "for now: set tensor_parallel_size and pipeline_parallel_size to 1"
            )
        arch = model.config if model is not None else ModelArchConfig.from_hf_dict(self.source.hf_config)
        if config.parallel.enable_expert_parallel:  # refused even where tp = 1 makes it a no-op
            check_expert_parallel(arch, config.parallel.tensor_parallel_size)
        self.vocab_size = arch.vocab_size
        self.eos_token_id = arch.eos_token_id
        self.max_model_len = max_model_len(config, arch.max_position_embeddings)
        sched = config.scheduler
        if not sched.enable_chunked_prefill and sched.max_num_batched_tokens < self.max_model_len:
            raise ConfigError(
                f"without chunked prefill, scheduler.max_num_batched_tokens ({sched.max_num_batched_tokens}) "
                f"must be >= max_model_len ({self.max_model_len}): raise it, lower max_model_len, "
                "or enable chunked prefill"
            )
        # tp x pp > 1: rank 0 (this process) keeps its shard; the executor runs the others.
        self.executor: ParallelExecutor | None = None
        if config.parallel.world_size > 1:
            self.executor = ParallelExecutor.start(config, self.source, self.dtype, self.device, model)
            assert self.executor.model is not None
            model = self.executor.model
        elif model is None:
            model = load_model(self.source, self.dtype, self.device, config.model.seed)
        self.model = model
        if config.cache.kv_cache_dtype != "auto":
            warn_once_if_unscaled(model.kv_scales_loaded)
        block_size = config.cache.block_size
        num_blocks = self._num_kv_blocks()
        if num_blocks * block_size < self.max_model_len:
            self.shutdown()
            raise ConfigError(
                f"the KV cache holds {num_blocks * block_size} tokens, fewer than max_model_len "
                f"{self.max_model_len}: raise cache.num_blocks / cache.memory_fraction or lower "
                "scheduler.max_model_len"
            )
        self.kv = KVCacheManager(num_blocks, block_size, config.cache.enable_prefix_caching)
        use_async = use_async_scheduling(config, self.device)
        self.scheduler = Scheduler(config.scheduler, self.max_model_len, self.kv, async_scheduling=use_async)
        self.lora: LoRAManager | None = None
        if config.lora.enable_lora:  # before the runner: its CUDA graphs capture the LoRA kernels
            self._start_lora(arch)
        graph_batch = 0 if config.enforce_eager else config.scheduler.max_num_seqs
        if self.executor is not None:
            self.runner = self.executor.start_runner(
                num_blocks, block_size, self.max_model_len, self.kv_cache_dtype, self._transfer_mirror
            )
        else:
            self.runner = ModelRunner(
                self.model, num_blocks, block_size, self.max_model_len, self.device, self.kv_cache_dtype, graph_batch
            )
        self.sampler = Sampler()
        self._async = AsyncStepper(self.scheduler, self.sampler, self._run_model) if use_async else None
        self.role = config.role
        self._pushes: dict[RequestId, KVPush] = {}  # prefill role
        self._lease_deadlines: dict[RequestId, float] = {}  # decode role, monotonic seconds
        logger.info("engine ready: %s on %s (%s, KV cache %s), %d KV blocks of %d tokens",
                    arch.architecture, self.device, self.dtype, self.kv_cache_dtype, num_blocks, block_size)

    def _start_lora(self, arch: ModelArchConfig) -> None:
        sched = self.config.scheduler
        max_num_tokens = max(sched.max_num_batched_tokens, sched.max_num_seqs)
        self.lora = LoRAManager(self.config.lora, self.model, self.dtype, self.device, max_num_tokens)
        self.scheduler.lora_slots = self.lora
        self._arch = arch
        for name, path in self.config.lora.lora_modules.items():
            try:
                self.add_lora(name, path)
            except LoRAAdapterError as e:
                raise ConfigError(f"lora.lora_modules.{name}: {e}") from None

    def add_lora(self, name: str, path: str) -> bool:
        """Load the PEFT adapter at `path` as `name`; False if it is already loaded from there.
        Raises LoRAAdapterError (an InvalidRequestError) saying what to change."""
        if self.lora is None:
            raise LoRAAdapterError(f"LoRA adapter {name!r}: this engine runs without LoRA; start it with enable_lora: true")
        loaded = self.lora.adapters.get(name)
        if loaded is not None:
            if loaded.path != str(path):
                raise LoRAAdapterError(
                    f"LoRA adapter {name!r} is already loaded from {loaded.path}: unload it first, or pick another name"
                )
            return False
        self.lora.add(load_adapter(name, path, self._arch, self.lora.max_rank))
        return True

    def remove_lora(self, name: str) -> bool:
        """Unload adapter `name`; False if it was not loaded. Refused while requests use it."""
        if self.lora is None or name not in self.lora.adapters:
            return False
        waiting = [r for r in self.scheduler.requests.values() if r.lora_name == name]
        if waiting:
            raise LoRAAdapterError(f"LoRA adapter {name!r} is in use by {len(waiting)} requests: retry when they finish")
        self.lora.remove(name)
        return True

    def list_loras(self) -> list[str]:
        return [] if self.lora is None else sorted(self.lora.adapters)

    def _num_kv_blocks(self) -> int:
        cache = self.config.cache
        if cache.num_blocks is not None:
            return cache.num_blocks
        if self.executor is not None:
            block_bytes = self.executor.kv_cache_block_bytes(cache.block_size, self.kv_cache_dtype, self._transfer_mirror)
        else:
            block_bytes = kv_cache_block_bytes(self.model, cache.block_size, self.kv_cache_dtype)
        return max(1, int(available_memory_bytes(self.device) * cache.memory_fraction) // block_bytes)

    @property
    def _transfer_mirror(self) -> bool:
        """A tensor-parallel prefill/decode instance: rank 0 keeps full-head KV for transfers."""
        return self.executor is not None and self.config.role != "colocated"

    @property
    def transfer_caches(self) -> list[torch.Tensor]:
        """The KV caches a transfer reads (prefill) or writes (decode): every KV head of every
        layer, as one process holds them; with tp > 1, rank 0's mirror (engine/parallel/kv_mirror.py)."""
        if self._transfer_mirror:
            assert self.executor is not None
            return self.executor.transfer_caches
        return self.runner.kv_caches

    def make_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        extra_keys: tuple[str, ...] = (),
        lora_name: str | None = None,
    ) -> Request:
        """Validate and build a request; raises InvalidRequestError with what to change."""
        if lora_name is not None:
            if lora_name not in self.list_loras():
                raise InvalidRequestError(
                    f"LoRA adapter {lora_name!r} is not loaded: load it first (lora_modules, or LoRARequest with its path)"
                )
            if lora_extra_key(lora_name) not in extra_keys:
                extra_keys = (*extra_keys, lora_extra_key(lora_name))
        num_prompt = len(prompt_token_ids)
        if num_prompt == 0:
            raise InvalidRequestError("the prompt is empty; send at least one token")
        if num_prompt >= self.max_model_len:
            raise InvalidRequestError(
                f"the prompt has {num_prompt} tokens but max_model_len is {self.max_model_len}: "
                "shorten the prompt (it must leave room for at least one generated token)"
            )
        bad = [t for t in prompt_token_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise InvalidRequestError(f"token ids {bad[:5]} are outside the vocabulary [0, {self.vocab_size})")
        # The sampler indexes logits with these (min_tokens masking): refuse them here.
        bad = [t for t in params.stop_token_ids if t >= self.vocab_size]
        if bad:
            raise InvalidRequestError(
                f"stop_token_ids {bad[:5]} are outside the vocabulary [0, {self.vocab_size})"
            )
        room = self.max_model_len - num_prompt
        max_tokens = room if params.max_tokens is None else min(params.max_tokens, room)
        return Request(
            request_id=RequestId(request_id),
            prompt_token_ids=list(prompt_token_ids),
            sampling_params=params,
            eos_token_id=self.eos_token_id,
            max_tokens=max_tokens,
            extra_keys=extra_keys,
            lora_name=lora_name,
        )

    def add_request(self, request: Request, kv_push: KVPush | None = None) -> None:
        self._check_new_id(request)
        if self.role == "prefill":
            assert kv_push is not None, "a prefill-role request needs a KVPush"
            request.max_tokens = 1
            self._pushes[request.request_id] = kv_push
        self.scheduler.add_request(request)
        if self._async is not None:
            self._async.track(request)

    def reserve(self, request: Request, lease_s: float) -> list[int] | None:
        """Decode role: the prompt's block ids (cached ones first), or None when they don't fit."""
        assert self.role == "decode", "reserve() is for the decode role"
        self._check_new_id(request)
        if self._async is not None:
            # Blocks freed under the step in flight may be handed out here, and the KV
            # transfer writes them from outside the step's stream.
            self._async.wait_device()
            self._async.track(request)
        if not self.scheduler.reserve(request):
            return None
        self._lease_deadlines[request.request_id] = time.monotonic() + lease_s
        return list(self.kv.get_block_table(request.request_id))

    def _check_new_id(self, request: Request) -> None:
        if request.request_id in self.scheduler.requests:
            raise InvalidRequestError(
                f"request id {request.request_id!r} is already in use: give each request a unique id"
            )

    def land(self, request_id: str, first_token: SampledToken | None) -> RequestUpdate | None:
        """Decode role: see Scheduler.land. The request's lease ends here."""
        rid = RequestId(request_id)
        self._lease_deadlines.pop(rid, None)
        request = self.scheduler.transferring[rid]
        if first_token is not None and self._transfer_mirror:
            assert self.executor is not None
            block_size = self.kv.block_size
            landed = self.kv.get_block_table(rid)[request.num_cached_tokens // block_size : -(-request.num_prompt_tokens // block_size)]
            self.executor.scatter_kv([int(b) for b in landed])
        if first_token is not None and request.generator is not None and not request.sampling_params.is_greedy:
            # The prefill drew this token's sampling noise; keep the seeded stream aligned.
            torch.empty(self.vocab_size).exponential_(generator=request.generator)
        return self.scheduler.land(rid, first_token)

    def expired_leases(self, now: float | None = None) -> list[str]:
        """Decode role: reservations whose KV did not arrive in time (the caller aborts them,
        after making sure nothing more can land in their blocks)."""
        now = time.monotonic() if now is None else now
        return [rid for rid, deadline in self._lease_deadlines.items() if deadline <= now]

    def extend_lease(self, request_id: str, lease_s: float) -> bool:
        """Decode role: push a reservation's deadline out (its Decode call has started)."""
        rid = RequestId(request_id)
        if rid not in self._lease_deadlines:
            return False
        self._lease_deadlines[rid] = time.monotonic() + lease_s
        return True

    def is_transferring(self, request_id: str) -> bool:
        return RequestId(request_id) in self.scheduler.transferring

    def abort(self, request_id: str) -> Request | None:
        rid = RequestId(request_id)
        self._pushes.pop(rid, None)
        self._lease_deadlines.pop(rid, None)
        return self.scheduler.finish(rid, RequestStatus.FINISHED_ABORTED)

    def finish_stopped(self, request_id: str, stop: str) -> None:
        request = self.scheduler.finish(RequestId(request_id), RequestStatus.FINISHED_STOPPED)
        if request is not None:
            request.stop_reason = stop

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or (self._async is not None and self._async.busy)

    def step(self) -> list[RequestUpdate]:
        if self._async is not None:
            return self._async.step()
        scheduler_output = self.scheduler.schedule()
        if scheduler_output.is_empty:
            return []
        pushes = self._layer_pushes(scheduler_output) if self._pushes else []
        if self.lora is not None:
            self.lora.prepare_step(scheduler_output.scheduled)

        def push_layer(layer: int) -> None:
            for push, src_block_ids in pushes:
                push.push_layer(layer, src_block_ids)

        if self.executor is None:
            request_ids, logits = self.runner.execute(scheduler_output, push_layer if pushes else None)
        else:
            request_ids, logits = self.executor.execute(scheduler_output)
            if pushes:  # tp > 1: the whole step, then every rank's heads to rank 0, then the pushes
                self.executor.gather_kv(sorted({b for _, ids in pushes for b in ids}))
                for layer in range(len(self.transfer_caches)):
                    push_layer(layer)
        requests = [self.scheduler.requests[r] for r in request_ids]
        tokens = self.sampler(logits, requests)
        sampled: dict[RequestId, SampledToken] = dict(zip(request_ids, tokens, strict=True))
        updates = self.scheduler.update_from_output(scheduler_output, sampled)
        for push, _ in pushes:
            push.finish()  # before any later step can reuse the freed blocks
        return updates

    def _run_model(
        self, output: SchedulerOutput, prev_tokens: DeviceTokens | None
    ) -> tuple[list[RequestId], torch.Tensor]:
        """Async scheduling's model step (one process, no KV pushes)."""
        if self.lora is not None:
            self.lora.prepare_step(output.scheduled)
        return self.runner.execute(output, None, prev_tokens)

    def _layer_pushes(self, output: SchedulerOutput) -> list[tuple[KVPush, list[int]]]:
        """The prefill requests whose prompt completes this step, with the blocks to push."""
        pushes = []
        for item in output.scheduled:
            push = self._pushes.get(item.request_id) if item.samples else None
            if push is None:
                continue
            del self._pushes[item.request_id]
            request = self.scheduler.requests[item.request_id]
            num_prompt_blocks = -(-request.num_prompt_tokens // self.kv.block_size)
            table = self.kv.get_block_table(item.request_id)
            src_block_ids = [int(b) for b in table[push.num_skip_blocks : num_prompt_blocks]]
            pushes.append((push, src_block_ids))
        return pushes

    def shutdown(self) -> None:
        """Stop the other ranks of a parallel engine (idempotent; also runs at exit)."""
        if self.executor is not None:
            self.executor.shutdown()

    def stats(self) -> EngineStats:
        return EngineStats(
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            kv_cache_usage=self.kv.usage,
            num_free_blocks=self.kv.pool.num_free_blocks,
            prefix_cache_queries=self.kv.prefix_stats.num_queries,
            prefix_cache_hits=self.kv.prefix_stats.num_hits,
            num_preemptions=self.scheduler.num_preemptions,
            num_transferring=len(self.scheduler.transferring),
            num_total_blocks=self.kv.pool.num_blocks,
            num_prompt_tokens=self.scheduler.num_prompt_tokens,
            num_generation_tokens=self.scheduler.num_generation_tokens,
            num_finished=dict(self.scheduler.num_finished),
            lora_names=tuple(self.list_loras()),
            lora_resident_names=tuple(self.lora.resident_names) if self.lora is not None else (),
        )


__all__ = ["EngineCore", "EngineStats"]
