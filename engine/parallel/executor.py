"""Rank 0's side of a parallel engine: the EngineCore's Executor (engine/executor.py) when
tp x pp > 1.

Lifecycle:
  1. `start`: check that the model splits this way (a ConfigError before any process
     starts), host a TCPStore on 127.0.0.1, start ranks 1..N-1 with the launcher, load
     the full model (or take the one given), wait for every rank's hello, build the
     groups, broadcast the weights, keep rank 0's shard (tensor rank 0 of the last stage).
  2. `init_kv_cache`: tell every rank the KV cache size, allocate rank 0's, barrier.
  3. `execute`, each step: broadcast the SchedulerOutput, run rank 0's part, return the
     logits of the sampling requests; the engine samples them here. Prefill and decode
     instances (tp > 1, one stage) also move KV between the ranks' head shards and rank
     0's full-head transfer cache (kv_mirror.py): a prefill step's pushes read it after
     the whole step and a gather; a decode's landed KV is scattered (`kv_landed`).
  4. `shutdown`: broadcast STOP, wait for the workers, kill stragglers. Also runs when the
     executor is collected or the interpreter exits.
A worker that dies makes the step (or the start) raise WorkerDiedError naming its rank
and why, instead of hanging: gloo fails the pending operation when the peer's sockets
close; for NCCL a watchdog thread aborts the groups. The executor is then unusable.
"""

from __future__ import annotations

import contextlib
import copy
import datetime
import os
import threading
import time
import weakref
from collections.abc import Callable
from typing import TypeVar

import torch
import torch.distributed as dist

from vllm_cluster.engine.config import EngineConfig, EngineRole
from vllm_cluster.engine.device_tokens import DeviceTokens
from vllm_cluster.engine.errors import ConfigError, WorkerDiedError
from vllm_cluster.engine.kv_push import StepPushes
from vllm_cluster.engine.loader import ModelSource, load_model
from vllm_cluster.engine.model_runner import ModelRunner
from vllm_cluster.engine.models import CausalLM, ModelArchConfig
from vllm_cluster.engine.parallel.context import ParallelContext
from vllm_cluster.engine.parallel.groups import host_store
from vllm_cluster.engine.parallel.kv_mirror import KVMirror
from vllm_cluster.engine.parallel.launch import WorkerLauncher, WorkerSpec, error_key, hello_key, make_launcher
from vllm_cluster.engine.parallel.messages import (
    ControlChannel,
    Kind,
    KVCacheInit,
    encode_block_ids,
    encode_init,
    encode_step,
)
from vllm_cluster.engine.parallel.stage_runner import StageRunner
from vllm_cluster.engine.parallel.topology import Topology, check_model, kv_heads_of
from vllm_cluster.engine.request import RequestId
from vllm_cluster.engine.scheduler_output import SchedulerOutput

_HOST = "127.0.0.1"
_STOP_TIMEOUT_S = 10.0
_WATCH_INTERVAL_S = 0.5
_T = TypeVar("_T")


class ParallelExecutor:
    def __init__(
        self, launcher: WorkerLauncher, topology: Topology, dtype: torch.dtype, transfer_mirror: bool = False
    ) -> None:
        """`transfer_mirror` (prefill/decode roles): rank 0 also keeps a full-head KV cache
        for the KV transfer, `transfer_caches`."""
        self.launcher = launcher
        self.topology = topology
        self.dtype = dtype
        self.transfer_mirror = transfer_mirror
        self.store: dist.TCPStore | None = None
        self.ctx: ParallelContext | None = None
        self.channel: ControlChannel | None = None
        self.model: CausalLM | None = None
        self.stage: StageRunner | None = None
        self.failure: WorkerDiedError | None = None
        self._closed = threading.Event()
        # What shutdown needs, without a reference to self (so that collection triggers it).
        self._channel_box: list[ControlChannel | None] = [None]
        self._finalizer = weakref.finalize(self, _stop, launcher, self._closed, self._channel_box)

    @classmethod
    def start(
        cls,
        config: EngineConfig,
        source: ModelSource,
        dtype: torch.dtype,
        device: torch.device,
        model: CausalLM | None = None,
        launcher: WorkerLauncher | None = None,
    ) -> ParallelExecutor:
        """`model`: the full model, already loaded (left untouched: rank 0 shards a copy)."""
        parallel = config.parallel
        arch = ModelArchConfig.from_hf_dict(source.hf_config) if model is None else model.config
        tp, pp, ep = parallel.tensor_parallel_size, parallel.pipeline_parallel_size, parallel.enable_expert_parallel
        check_model(arch, tp, pp, ep)
        _check_devices(device, parallel.world_size)
        topology = Topology(tp, pp, arch.num_hidden_layers, ep)
        transfer_mirror = config.role != EngineRole.COLOCATED
        executor = cls(launcher or make_launcher(parallel), topology, dtype, transfer_mirror)
        try:
            executor._start(config, source, arch, device, model)
        except BaseException:
            executor.shutdown()
            raise
        return executor

    def _start(
        self,
        config: EngineConfig,
        source: ModelSource,
        arch: ModelArchConfig,
        device: torch.device,
        model: CausalLM | None,
    ) -> None:
        timeout = datetime.timedelta(seconds=config.parallel.distributed_timeout_s)
        self.store = store = host_store(_HOST, self.topology.world_size, timeout)
        num_threads = config.num_threads or max(1, (os.cpu_count() or 1) // self.topology.world_size)
        specs = [
            WorkerSpec(
                rank=rank, world_size=self.topology.world_size,
                tensor_parallel_size=self.topology.tensor_parallel_size,
                pipeline_parallel_size=self.topology.pipeline_parallel_size,
                store_host=_HOST, store_port=store.port, host=_HOST,
                device=f"cuda:{rank}" if device.type == "cuda" else "cpu",
                dtype=str(self.dtype).removeprefix("torch."), num_threads=num_threads,
                timeout_s=config.parallel.distributed_timeout_s, hf_config=source.hf_config,
                enable_expert_parallel=self.topology.enable_expert_parallel,
            )
            for rank in range(1, self.topology.world_size)
        ]
        self.launcher.start(specs)
        # Load while the workers start; a copy when the caller keeps using the full model.
        full = load_model(source, self.dtype, device, config.model.seed) if model is None else model
        self._wait_for_hellos(config.parallel.distributed_timeout_s)
        self.ctx = ctx = self._guard(
            lambda: ParallelContext.create(store, self.topology, 0, device, timeout, _HOST)
        )
        self.channel = self._channel_box[0] = ControlChannel(ctx.control)
        self._guard(lambda: ctx.broadcast_weights(full))
        own = full if model is None else copy.deepcopy(full)
        ctx.shard(own)
        self.model = own.eval()
        watchdog = threading.Thread(
            target=_watch, args=(self.launcher, self._closed, ctx), name="parallel-watchdog", daemon=True
        )
        watchdog.start()

    def _wait_for_hellos(self, timeout_s: float) -> None:
        """Every worker has joined the store (or one has already failed: say which)."""
        assert self.store is not None
        keys = [hello_key(rank) for rank in range(1, self.topology.world_size)]
        deadline = time.monotonic() + timeout_s
        while not self.store.check(keys):
            if self.launcher.exited():
                raise self._failure(None)
            if time.monotonic() > deadline:
                raise WorkerDiedError(
                    f"parallel workers did not start within {timeout_s:.0f} s: "
                    "raise parallel.distributed_timeout_s or check the machine's load"
                )
            time.sleep(0.05)

    def kv_cache_block_bytes(self, block_size: int, kv_cache_dtype: torch.dtype) -> int:
        """One KV block's bytes on the rank holding the most (the KV manager's block count
        must fit every rank), rank 0's full-head transfer cache included when there is one.
        On CPU all ranks share the host's memory: counted once each."""
        c = self.topology
        assert self.model is not None and self.ctx is not None
        arch = self.model.config
        num_layers = max(len(c.stage_layers(s)) for s in range(c.pipeline_parallel_size))
        num_kv_heads = len(kv_heads_of(0, c.tensor_parallel_size, arch.num_key_value_heads))
        elem = torch.empty((), dtype=kv_cache_dtype).element_size()
        per_rank = block_size * arch.kv_bytes_per_token(elem, num_layers, num_kv_heads)
        full_heads = block_size * arch.kv_bytes_per_token(elem, num_layers)
        mirror = full_heads if self.transfer_mirror else 0
        return per_rank * (c.world_size if self.ctx.device.type == "cpu" else 1) + mirror

    def init_kv_cache(self, num_blocks: int, block_size: int, max_model_len: int, kv_cache_dtype: torch.dtype) -> None:
        """Every rank allocates its KV cache (of `kv_cache_dtype`); rank 0 also its full-head
        transfer cache, with `transfer_mirror`."""
        assert self.ctx is not None and self.channel is not None and self.model is not None
        ctx, channel, model = self.ctx, self.channel, self.model
        init = KVCacheInit(num_blocks, block_size, max_model_len, str(kv_cache_dtype).removeprefix("torch."))
        self._guard(lambda: channel.send(Kind.INIT, encode_init(init)))
        self.stage = StageRunner(model, ctx, num_blocks, block_size, max_model_len, self.dtype, kv_cache_dtype)
        if self.transfer_mirror:
            assert (
                self.topology.pipeline_parallel_size == 1 and ctx.tp is not None
            ), "config.validate refuses pp > 1 roles"
            arch = model.config
            shape = arch.kv_cache_shape(num_blocks, block_size)
            full = [torch.zeros(shape, dtype=kv_cache_dtype, device=ctx.device) for _ in self.stage.kv_caches]
            self.stage.mirror = KVMirror(self.stage.kv_caches, ctx.tp, arch.num_key_value_heads, full)
        self._guard(ctx.control.barrier)

    @property
    def runner(self) -> ModelRunner:
        """Rank 0's model runner: its KV cache (its stage's layers, its heads) and block tables."""
        assert self.stage is not None, "init_kv_cache() first"
        return self.stage.inner

    @property
    def transfer_caches(self) -> list[torch.Tensor]:
        """The full-head caches the KV sender reads / the receiver writes (with transfer_mirror)."""
        assert self.stage is not None, "init_kv_cache() first"
        if self.stage.mirror is None or self.stage.mirror.mirror is None:
            return self.stage.kv_caches
        return self.stage.mirror.mirror

    def kv_landed(self, block_ids: list[int]) -> None:
        """Decode: the transfer wrote these blocks into the full-head cache; every rank takes its heads."""
        if self.transfer_mirror:
            self.scatter_kv(block_ids)

    def gather_kv(self, block_ids: list[int]) -> None:
        """Prefill: every rank's heads of `block_ids` into `transfer_caches`."""
        self._kv_move(Kind.GATHER_KV, block_ids)

    def scatter_kv(self, block_ids: list[int]) -> None:
        """Decode: `transfer_caches`' blocks `block_ids` into every rank's own heads."""
        self._kv_move(Kind.SCATTER_KV, block_ids)

    def _kv_move(self, kind: Kind, block_ids: list[int]) -> None:
        assert self.channel is not None and self.stage is not None and self.stage.mirror is not None
        if self.failure is not None:
            raise self.failure
        channel, mirror = self.channel, self.stage.mirror
        move = mirror.gather if kind == Kind.GATHER_KV else mirror.scatter

        def run() -> None:
            channel.send(kind, encode_block_ids(block_ids))
            with torch.inference_mode():
                move(block_ids)

        self._guard(run)

    def execute(
        self, output: SchedulerOutput, pushes: StepPushes | None = None, prev_tokens: DeviceTokens | None = None
    ) -> tuple[list[RequestId], torch.Tensor]:
        """`pushes` run after the whole step, from the full-head cache once every rank's heads
        are gathered into it."""
        assert prev_tokens is None, "async scheduling runs on one process only"
        assert self.channel is not None and self.stage is not None, "start_runner() first"
        if self.failure is not None:
            raise self.failure
        channel, stage = self.channel, self.stage

        def step() -> torch.Tensor | None:
            channel.send(Kind.STEP, encode_step(output))
            return stage.execute(output)

        logits = self._guard(step)
        assert logits is not None
        if pushes is not None:
            self.gather_kv(pushes.block_ids)
            for layer in range(len(self.transfer_caches)):
                pushes.push_layer(layer)
        return [item.request_id for item in output.scheduled if item.samples], logits

    def shutdown(self) -> None:
        """Stop every worker (idempotent)."""
        self._finalizer()

    def _guard(self, call: Callable[[], _T]) -> _T:
        """Run `call`, which talks to the other ranks. A failed collective becomes a
        WorkerDiedError naming the dead rank; anything else (Ctrl-C) is re-raised. Either
        way the ranks are out of step for good: they are killed, not told to stop."""
        try:
            return call()
        except BaseException as e:
            self._channel_box[0] = None
            if isinstance(e, RuntimeError) and not isinstance(e, WorkerDiedError):  # DistError too
                self.failure = self._failure(e)
                self.shutdown()
                raise self.failure from e
            self.failure = WorkerDiedError(
                f"the parallel engine was interrupted while its ranks were working ({type(e).__name__}); "
                "they are stopped: build a new LLM (or restart the instance)"
            )
            self.shutdown()
            raise

    def _failure(self, cause: BaseException | None) -> WorkerDiedError:
        deadline = time.monotonic() + 2.0  # a crashed worker may still be on its way out
        while not (exits := self.launcher.exited()) and time.monotonic() < deadline:
            time.sleep(0.05)
        lines = []
        for worker in exits:
            place = self.topology.place(worker.rank)
            line = f"rank {worker.rank} (pipeline stage {place.stage}, tensor rank {place.tp_rank}) {worker.detail}"
            message = self._error_of(worker.rank)
            lines.append(f"{line}: {message}" if message else line)
        if not lines:
            lines.append(f"no worker has exited; the step failed with: {cause}")
        return WorkerDiedError(
            "a parallel worker failed, and this engine cannot continue: "
            + "; ".join(lines) + ". Build a new LLM (or restart the instance)."
        )

    def _error_of(self, rank: int) -> str | None:
        try:
            if self.store is not None and self.store.check([error_key(rank)]):
                return self.store.get(error_key(rank)).decode()
        except RuntimeError:
            pass
        return None



def _watch(launcher: WorkerLauncher, closed: threading.Event, ctx: ParallelContext) -> None:
    """NCCL waits on a dead peer until its timeout: abort the groups instead."""
    while not closed.wait(_WATCH_INTERVAL_S):
        if launcher.exited():
            if not closed.is_set():
                ctx.abort()
            return
def _stop(launcher: WorkerLauncher, closed: threading.Event, channel: list[ControlChannel | None]) -> None:
    """STOP to ranks waiting for the next message, then wait for them; without a channel
    (no groups yet, or ranks out of step) kill them at once."""
    if closed.is_set():
        return
    closed.set()
    if channel[0] is None:
        launcher.stop(0.0)
        return
    if not launcher.exited():
        with contextlib.suppress(RuntimeError):  # a worker is gone: the others see its sockets close
            channel[0].send(Kind.STOP)
    launcher.stop(_STOP_TIMEOUT_S)


def _check_devices(device: torch.device, world_size: int) -> None:
    if device.type == "cuda" and torch.cuda.device_count() < world_size:
        raise ConfigError(
            f"tensor_parallel_size x pipeline_parallel_size = {world_size} ranks need {world_size} GPUs "
            f"(one each), but {torch.cuda.device_count()} are visible: lower them"
        )
