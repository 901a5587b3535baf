"""Ranks 1..N-1 of a parallel engine as Ray actors: `LLM(..., tensor_parallel_size=3,
distributed_executor_backend="ray")` (vLLM's option), or `parallel.distributed_executor_backend:
ray` in an engine config. A `WorkerLauncher` (engine/parallel/launch.py), like ProcessLauncher.

The engine never imports Ray: engine/parallel/launch.py imports this module by name when the
"ray" backend is first asked for, and importing it registers `RayLauncher` there.

Lifecycle (one launcher per engine):
  1. `start(specs)`: connect this process to Ray (parallel.ray_address, else RAY_ADDRESS,
     else the Ray it is already connected to, else a local Ray on loopback started here
     with a few CPUs, as cluster/ray_head.py starts one); reserve one placement group of
     world_size bundles (bundle 0 stands for rank 0, the driver: this process); create one
     `RankActor` per rank r in bundle r, whose `run` task is
     `engine.parallel.worker.run_worker(spec)`, which returns when the driver says STOP.
  2. `exited()`: the ranks whose `run` task has ended: returned, raised, or lost with the
     actor's process (the dead rank the driver names in its WorkerDiedError).
  3. `stop(timeout_s)`: wait up to timeout_s for the `run` tasks, kill the actors, wait for
     their processes to go, remove the placement group, and disconnect from Ray (which stops
     a Ray started here) once no launcher in this process uses it.
Every rank runs on the driver's node: the driver's TCPStore and the ranks' gloo sockets are on
127.0.0.1, so each bundle takes a sliver of this node's `node:<ip>` resource. On GPUs each
bundle holds one GPU, and rank r still runs on cuda:r as the driver counts them (the actor sees
the driver's CUDA_VISIBLE_DEVICES, not only the GPU Ray gave it), as with the "mp" backend.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import sys
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from vllm_cluster.cluster.procs import ProcessRef, wait_gone
from vllm_cluster.cluster.ray_head import connect, start_in_process, use_local_ray
from vllm_cluster.engine.config import ParallelConfig
from vllm_cluster.engine.errors import ConfigError
from vllm_cluster.engine.parallel.launch import WorkerExit, WorkerSpec, register_launcher

if importlib.util.find_spec("ray") is None:  # make_launcher turns this into a ConfigError
    raise ImportError("the ray package is not installed")

NAMESPACE = "vllm-llm"
_PLACEMENT_TIMEOUT_S = 120.0
_NODE_SHARE = 0.001  # of this node's `node:<ip>` resource (1.0): pins a bundle here
_ACTOR_EXIT_TIMEOUT_S = 10.0


class RankActor:
    """One rank, in a Ray worker process of its own."""

    def __init__(self, visible_devices: str | None) -> None:
        if visible_devices is not None:  # before CUDA starts in this process
            os.environ["CUDA_VISIBLE_DEVICES"] = visible_devices

    def pid(self) -> int:
        return os.getpid()

    def run(self, spec_json: str) -> None:
        from vllm_cluster.engine.parallel.worker import run_worker

        run_worker(WorkerSpec.from_json(spec_json))


@dataclass(slots=True)
class _Rank:
    actor: Any  # a RankActor handle
    pid_ref: Any  # ObjectRef[int]
    run_ref: Any  # ObjectRef[None]: ready when the rank has ended
    pid: int | None = None  # pid_ref's value, once fetched
    exit: WorkerExit | None = None


class RayLauncher:
    def __init__(self, address: str | None = None) -> None:
        self.address = address  # None: a Ray this process already has, or a local one
        self._ranks: dict[int, _Rank] = {}
        self._pg: Any = None  # the PlacementGroup
        self._connected = False

    def start(self, specs: Sequence[WorkerSpec]) -> None:
        if not specs:
            return
        world_size = specs[0].world_size
        _acquire_ray(self.address, world_size)
        self._connected = True
        import ray
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        uses_gpu = specs[0].device.startswith("cuda")
        bundle = {"CPU": 1.0, f"node:{ray.util.get_node_ip_address()}": _NODE_SHARE}
        if uses_gpu:
            bundle["GPU"] = 1.0
        self._pg = placement_group([bundle] * world_size, strategy="STRICT_PACK")
        try:
            ray.get(self._pg.ready(), timeout=_PLACEMENT_TIMEOUT_S)
        except ray.exceptions.GetTimeoutError:
            raise ConfigError(
                f"Ray could not place {world_size} ranks on this node within {_PLACEMENT_TIMEOUT_S:g} s: they need "
                f"{world_size} x {bundle}, Ray has {ray.available_resources()} free; lower the parallel sizes "
                "or free those resources"
            ) from None
        actor_cls: Any = ray.remote(RankActor)
        visible = _visible_devices() if uses_gpu else None
        for spec in specs:
            strategy = PlacementGroupSchedulingStrategy(self._pg, placement_group_bundle_index=spec.rank)
            actor = actor_cls.options(
                num_cpus=1, num_gpus=1 if uses_gpu else 0, max_restarts=0, scheduling_strategy=strategy
            ).remote(visible)
            # An actor runs its tasks in order: pid first, then the rank until STOP.
            self._ranks[spec.rank] = _Rank(actor, actor.pid.remote(), actor.run.remote(spec.to_json()))

    def pid(self, rank: int) -> int:
        """The process of rank `rank`'s actor (on this node)."""
        import ray

        r = self._ranks[rank]
        if r.pid is None:
            r.pid = int(ray.get(r.pid_ref))
        return r.pid

    def exited(self) -> list[WorkerExit]:
        pending = [(rank, r) for rank, r in self._ranks.items() if r.exit is None]
        if pending and self._connected:
            import ray

            try:
                done, _ = ray.wait([r.run_ref for _, r in pending], num_returns=len(pending), timeout=0)
            except Exception as e:  # Ray itself is gone: so are its actors
                for rank, r in pending:
                    r.exit = WorkerExit(rank, f"was lost with Ray ({type(e).__name__}: {e})")
            else:
                for rank, r in pending:
                    if r.run_ref in done:
                        r.exit = WorkerExit(rank, _describe_end(r.run_ref))
        return [r.exit for _, r in sorted(self._ranks.items()) if r.exit is not None]

    def stop(self, timeout_s: float) -> None:
        if not self._connected:
            return
        import ray
        from ray.util.placement_group import remove_placement_group

        ranks = list(self._ranks.values())
        with contextlib.suppress(Exception):  # teardown goes on past a dead actor
            ray.wait([r.run_ref for r in ranks], num_returns=len(ranks), timeout=timeout_s)
        processes = [ProcessRef.of(pid) for pid in _ready_pids(ranks)]
        for r in ranks:
            _quietly(ray.kill, r.actor)
        wait_gone(processes, _ACTOR_EXIT_TIMEOUT_S)
        if self._pg is not None:
            _quietly(remove_placement_group, self._pg)
        self._pg = None
        self._connected = False
        _release_ray()


def _describe_end(run_ref: Any) -> str:
    import ray

    try:
        ray.get(run_ref, timeout=0)
    except ray.exceptions.RayActorError as e:
        return f"died with its Ray actor ({str(e).strip().splitlines()[0]})"
    except ray.exceptions.RayTaskError as e:
        return f"failed with {type(e.cause).__name__}"
    return "exited"


def _ready_pids(ranks: list[_Rank]) -> list[int]:
    import ray

    for r in ranks:
        if r.pid is None:
            with contextlib.suppress(Exception):  # never started, or its actor died first
                r.pid = int(ray.get(r.pid_ref, timeout=0))
    return [r.pid for r in ranks if r.pid is not None]


def _visible_devices() -> str:
    import torch

    return os.environ.get("CUDA_VISIBLE_DEVICES") or ",".join(str(i) for i in range(torch.cuda.device_count()))


def _quietly(action: Callable[..., object], *args: Any) -> None:
    with contextlib.suppress(Exception):
        action(*args)


# This process's Ray connection, when a launcher made it: shared by the launchers that
# run at once, and closed (a local Ray stopped) when the last of them stops.
_lock = threading.Lock()
_num_users = 0
_connected_here = False


def _acquire_ray(address: str | None, world_size: int) -> None:
    global _num_users, _connected_here
    with _lock:
        if "ray" not in sys.modules and not address:
            use_local_ray()  # before Ray's first import: it reads its auth mode there
        import ray

        if not ray.is_initialized():
            if address:
                connect(address, NAMESPACE, local=False)
            else:
                # Ray imported before use_local_ray (by the caller) has token auth off, and
                # cannot join a Ray that has it on.
                os.environ.setdefault("RAY_AUTH_MODE", "disabled")
                start_in_process(max(world_size, os.cpu_count() or 1), NAMESPACE)
            _connected_here = True
        if _connected_here:
            _num_users += 1


def _release_ray() -> None:
    global _num_users, _connected_here
    with _lock:
        if not _connected_here:
            return
        _num_users -= 1
        if _num_users == 0:
            import ray

            _quietly(ray.shutdown)
            _connected_here = False


def _make(parallel: ParallelConfig) -> RayLauncher:
    return RayLauncher(parallel.ray_address or os.environ.get("RAY_ADDRESS") or None)


register_launcher("ray", _make)
