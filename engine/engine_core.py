"""The engine core every instance runs: requests in, one step at a time, token updates out.

step(): scheduler.schedule() -> executor.execute() -> sampler -> scheduler.update_from_output().
Start-up (engine/startup.py) resolves the config into the model on an Executor
(engine/executor.py): one process, or tensor/pipeline-parallel ranks (engine/parallel/),
with scheduling and sampling here, on rank 0. With async scheduling (config.async_scheduling,
on by default for CUDA) an AsyncStepper runs step() instead: step N+1 is scheduled and
launched before step N's tokens are applied (engine/async_stepper.py).
A bad request is refused in `make_request` with an InvalidRequestError; it never reaches
the loop, so the engine keeps serving.

Roles (EngineRole):
  colocated  requests in, tokens out.
  prefill    a request carries a KVPush; it stops after its first token. In the step that
             completes its prompt, its blocks are pushed layer by layer; the step ends only
             when every push is confirmed, so its blocks are never reused under a send in
             flight (engine/kv_push.py).
  decode     `reserve` holds blocks for a prompt (TRANSFERRING), `land` starts decoding
             from the first token once the prefill's KV is in them, or computes the prompt
             here when the hand-off failed. Reservations not landed by their lease expire
             (engine/reservations.py).
"""

from __future__ import annotations

import functools
import logging

import torch

from vllm_cluster.engine.async_stepper import AsyncStepper
from vllm_cluster.engine.config import EngineConfig, EngineRole
from vllm_cluster.engine.device_tokens import DeviceTokens
from vllm_cluster.engine.errors import ConfigError, InvalidRequestError
from vllm_cluster.engine.kv_cache_manager import KVCacheManager
from vllm_cluster.engine.kv_offload import build_offload
from vllm_cluster.engine.kv_push import KVPush, PendingPushes, StepPushes
from vllm_cluster.engine.lora import LoRAAdapterError, LoRAManager, load_adapter, lora_extra_key
from vllm_cluster.engine.model_runner import ModelRunner
from vllm_cluster.engine.models import CausalLM, ModelArchConfig
from vllm_cluster.engine.prompt_logprobs import take_prompt_logprobs
from vllm_cluster.engine.request import Request, RequestId, RequestStatus
from vllm_cluster.engine.reservations import Leases
from vllm_cluster.engine.sampler import Sampler
from vllm_cluster.engine.sampling_params import SamplingParams, truncate_prompt
from vllm_cluster.engine.scheduler import RequestUpdate, SampledToken, Scheduler
from vllm_cluster.engine.scheduler_output import SchedulerOutput
from vllm_cluster.engine.startup import start_engine
from vllm_cluster.engine.stats import EngineStats, engine_stats
from vllm_cluster.engine.structured_output import GrammarCache, RequestGrammar, warm_mask_kernel
from vllm_cluster.engine.tokenizer import load_tokenizer

logger = logging.getLogger(__name__)


class EngineCore:
    def __init__(self, config: EngineConfig, model: CausalLM | None = None) -> None:
        """`model`: weights already loaded for the same config.model (reused, not copied)."""
        self.role = config.role
        parts = start_engine(config, model)
        self.config = config = parts.config  # with the device's defaults filled in
        self.source, self.model, self.executor = parts.source, parts.model, parts.executor
        self.device, self.dtype, self.kv_cache_dtype = parts.device, parts.dtype, parts.kv_cache_dtype
        self.vocab_size, self.eos_token_id = parts.arch.vocab_size, parts.arch.eos_token_id
        self.max_model_len = parts.max_model_len
        block_size = config.cache.block_size
        self.kv = KVCacheManager(
            parts.num_blocks, block_size, config.cache.enable_prefix_caching, parts.kv_release_window
        )
        use_async = parts.async_scheduling
        self.scheduler = Scheduler(config.scheduler, self.max_model_len, self.kv, async_scheduling=use_async)
        self.lora: LoRAManager | None = None
        if config.lora.enable_lora:  # before the KV cache: its CUDA graphs capture the LoRA kernels
            self._start_lora(parts.arch)
        self.executor.init_kv_cache(parts.num_blocks, block_size, self.max_model_len, self.kv_cache_dtype)
        self._start_offload()
        self.sampler = Sampler()
        tokenizer_path = self.source.tokenizer_path
        self.grammars = GrammarCache(  # structured output; the tokenizer is read on first use
            None if tokenizer_path is None else functools.partial(load_tokenizer, tokenizer_path),
            self.vocab_size,
            self.eos_token_id,
        )
        if self.device.type == "cuda" and tokenizer_path is not None:
            warm_mask_kernel(self.vocab_size, self.device, self.dtype)
        self._async = AsyncStepper(self.scheduler, self.sampler, self._execute) if use_async else None
        self.pushes = PendingPushes(self.kv)  # prefill role
        self.leases = Leases()  # decode role
        # What one token's KV takes as the cache is sized (MLA: its latent entry per layer).
        self.kv_bytes_per_token = self.executor.kv_cache_block_bytes(block_size, self.kv_cache_dtype) // block_size
        logger.info("engine ready: %s on %s (%s, KV cache %s), %d KV blocks of %d tokens, %d KV bytes per token",
                    parts.arch.architecture, self.device, self.dtype, self.kv_cache_dtype, parts.num_blocks, block_size,
                    self.kv_bytes_per_token)  # fmt: skip

    def _start_offload(self) -> None:
        cache = self.config.cache
        if cache.host_kv_gib <= 0:
            return
        if self.config.parallel.world_size > 1:
            raise ConfigError("cache.host_kv_gib: the offload tiers need a single-process engine (tp = pp = 1)")
        offload = build_offload(cache.host_kv_gib, cache.disk_kv_dir, cache.disk_kv_gib, self.runner.kv_caches)
        assert offload is not None
        self.kv.attach_offload(offload)
        disk = offload.disk
        logger.info("KV offload: %d host blocks%s", offload.host.num_blocks,
                    "" if disk is None else f", {disk.num_blocks} disk blocks in {disk.directory}")

    def _start_lora(self, arch: ModelArchConfig) -> None:
        sched = self.config.scheduler
        max_num_tokens = max(sched.batch_limits())
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
            raise LoRAAdapterError(
                f"LoRA adapter {name!r}: this engine runs without LoRA; start it with enable_lora: true"
            )
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
            raise LoRAAdapterError(
                f"LoRA adapter {name!r} is in use by {len(waiting)} requests: retry when they finish"
            )
        self.lora.remove(name)
        return True

    def list_loras(self) -> list[str]:
        return [] if self.lora is None else sorted(self.lora.adapters)

    @property
    def runner(self) -> ModelRunner:
        """This process's model runner (its KV cache, block tables)."""
        return self.executor.runner

    @property
    def transfer_caches(self) -> list[torch.Tensor]:
        """The KV caches a transfer reads (prefill) or writes (decode): every KV head of every
        layer, as one process holds them; with tp > 1, rank 0's mirror (engine/parallel/kv_mirror.py)."""
        return self.executor.transfer_caches

    def make_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        extra_keys: tuple[str, ...] = (),
        lora_name: str | None = None,
        priority: int = 0,
        num_generated_prompt_tokens: int = 0,
    ) -> Request:
        """Validate and build a request; raises InvalidRequestError with what to change."""
        if priority != 0 and self.config.scheduler.scheduling_policy != "priority":
            raise InvalidRequestError(
                f"priority {priority} needs scheduling_policy: priority; this engine serves fcfs: send priority 0"
            )
        prompt_token_ids = truncate_prompt(prompt_token_ids, params.truncate_prompt_tokens, self.max_model_len)
        if lora_name is not None:
            if lora_name not in self.list_loras():
                raise InvalidRequestError(
                    f"LoRA adapter {lora_name!r} is not loaded: "
                    "load it first (lora_modules, or LoRARequest with its path)"
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
        self._check_logits_fields(params)
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
            priority=priority,
            grammar=self._request_grammar(params, prompt_token_ids, num_generated_prompt_tokens),
        )

    def _request_grammar(
        self, params: SamplingParams, prompt_token_ids: list[int], num_generated: int
    ) -> RequestGrammar | None:
        """Structured output: the request's matcher, past the last `num_generated` prompt tokens
        (a migrated request's prompt ends with what it generated elsewhere)."""
        if params.structured_outputs is None:
            return None
        generated = prompt_token_ids[len(prompt_token_ids) - num_generated :] if num_generated > 0 else []
        return self.grammars.request_grammar(params.structured_outputs, generated)

    def _check_logits_fields(self, params: SamplingParams) -> None:
        """The logits processors index logits with these token ids: refuse any outside the vocabulary."""
        if params.bad_words and not params.bad_words_token_ids:
            raise InvalidRequestError("bad_words need the tokenizer: pass them through LLM or the router")
        named = {
            "logit_bias": list(params.logit_bias or ()),
            "allowed_token_ids": params.allowed_token_ids or [],
            "bad_words": [t for ids in params.bad_words_token_ids for t in ids],
        }
        for name, token_ids in named.items():
            bad = [t for t in token_ids if t >= self.vocab_size]
            if bad:
                raise InvalidRequestError(
                    f"{name} has token ids {bad[:5]} outside the vocabulary [0, {self.vocab_size})"
                )

    def add_request(self, request: Request, kv_push: KVPush | None = None) -> None:
        self._check_new_id(request)
        if self.role == EngineRole.PREFILL:
            assert kv_push is not None, "a prefill-role request needs a KVPush"
            request.max_tokens = 1
            self.pushes.add(request.request_id, kv_push)
        self.scheduler.add_request(request)
        if self._async is not None:
            self._async.track(request)

    def reserve(self, request: Request, lease_s: float) -> list[int] | None:
        """Decode role: the prompt's block ids (cached ones first), or None when they don't fit."""
        assert self.role == EngineRole.DECODE, "reserve() is for the decode role"
        self._check_new_id(request)
        if self._async is not None:
            # Blocks freed under the step in flight may be handed out here, and the KV
            # transfer writes them from outside the step's stream.
            self._async.wait_device()
            self._async.track(request)
        if not self.scheduler.reserve(request):
            return None
        if self.kv.offload is not None:
            self.kv.offload.sync()  # blocks evicted just now: copied out before the transfer writes them
        self.leases.grant(request.request_id, lease_s)
        return list(self.kv.get_block_table(request.request_id))

    def _check_new_id(self, request: Request) -> None:
        if request.request_id in self.scheduler.requests:
            raise InvalidRequestError(
                f"request id {request.request_id!r} is already in use: give each request a unique id"
            )

    def land(self, request_id: str, first_token: SampledToken | None) -> RequestUpdate | None:
        """Decode role: see Scheduler.land. The request's lease ends here."""
        rid = RequestId(request_id)
        self.leases.release(rid)
        request = self.scheduler.transferring[rid]
        if first_token is not None:
            block_size = self.kv.block_size
            num_prompt_blocks = -(-request.num_prompt_tokens // block_size)
            landed = self.kv.get_block_table(rid)[request.num_cached_tokens // block_size : num_prompt_blocks]
            self.executor.kv_landed([int(b) for b in landed])
        if first_token is not None and request.generator is not None and not request.sampling_params.is_greedy:
            # The prefill drew this token's sampling noise; keep the seeded stream aligned.
            torch.empty(self.vocab_size).exponential_(generator=request.generator)
        return self.scheduler.land(rid, first_token)

    def expired_leases(self, now: float | None = None) -> list[str]:
        """Decode role: reservations whose KV did not arrive in time (the caller aborts them,
        after making sure nothing more can land in their blocks)."""
        return list(self.leases.expired(now))

    def extend_lease(self, request_id: str, lease_s: float) -> bool:
        """Decode role: push a reservation's deadline out (its Decode call has started)."""
        return self.leases.extend(RequestId(request_id), lease_s)

    def is_transferring(self, request_id: str) -> bool:
        return RequestId(request_id) in self.scheduler.transferring

    def abort(self, request_id: str) -> Request | None:
        rid = RequestId(request_id)
        self.pushes.discard(rid)
        self.leases.release(rid)
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
        pushes = self.pushes.take(scheduler_output, self.scheduler.requests) if self.pushes else None
        request_ids, logits = self._execute(scheduler_output, pushes=pushes)
        tokens = self.sampler(logits, [self.scheduler.requests[r] for r in request_ids])
        updates = self.scheduler.update_from_output(scheduler_output, dict(zip(request_ids, tokens, strict=True)))
        if pushes is not None:
            pushes.finish()  # before any later step can reuse the freed blocks
        return updates

    def _execute(
        self, output: SchedulerOutput, prev_tokens: DeviceTokens | None = None, pushes: StepPushes | None = None
    ) -> tuple[list[RequestId], torch.Tensor]:
        """The model's part of a step, synchronous or async (the AsyncStepper's RunModel)."""
        if self.lora is not None:
            self.lora.prepare_step(output.scheduled)
        request_ids, logits = self.executor.execute(output, pushes, prev_tokens)
        return request_ids, take_prompt_logprobs(output, logits, self.scheduler.requests)

    def shutdown(self) -> None:
        """Stop the other ranks of a parallel engine (idempotent; also runs at exit)."""
        self.executor.shutdown()

    def stats(self) -> EngineStats:
        return engine_stats(self.scheduler, self.lora)


__all__ = ["EngineCore", "EngineStats", "KVPush"]
