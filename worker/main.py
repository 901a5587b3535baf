"""What the prefill and decode processes share at start-up: their command line, building
the engine, and serving until SIGTERM. (Services never import each other; this is the
common ground.)"""

from __future__ import annotations

import argparse
import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
import torch

from vllm_cluster.engine.config import EngineConfig, EngineRole
from vllm_cluster.engine.engine_core import EngineCore
from vllm_cluster.engine.engine_loop import EngineLoop
from vllm_cluster.engine.kv_offload import Tier
from vllm_cluster.engine.loader import resolve
from vllm_cluster.engine.memory import activation_bytes, footprint_bytes, prefill_kv_tokens
from vllm_cluster.engine.models import ModelArchConfig
from vllm_cluster.engine.resolve import CUDA_DEFAULTS, max_model_len, resolve_device, with_device_defaults
from vllm_cluster.engine.tokenizer import load_tokenizer
from vllm_cluster.kv_index import BlockEventPublisher
from vllm_cluster.kv_transfer import faults
from vllm_cluster.metrics import InstanceMetrics
from vllm_cluster.worker.rpc import REDIS_URL_ENV, TOKEN_ENV, HealthReporter, announce_and_wait, make_server


def add_worker_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", "-f", required=True, help="YAML with an `engine:` section")
    parser.add_argument("--name", default="worker", help="instance name, in logs and handshakes")
    parser.add_argument("--host", default="127.0.0.1", help="gRPC listen address")
    parser.add_argument("--port", type=int, default=0, help="gRPC port; 0 picks a free one")
    parser.add_argument("--kv-host", default="127.0.0.1", help="KV transfer listen address")
    parser.add_argument("--kv-port", type=int, default=0)
    parser.add_argument("--transport", default="ucx", choices=["ucx", "nccl", "cuda_ipc"])
    parser.add_argument("--transfer-timeout-s", type=float, default=30.0)
    parser.add_argument("--num-threads", type=int, default=None, help="torch threads (overrides the config)")
    parser.add_argument("--instances-per-gpu", type=int, default=1,
                        help="instances sharing this GPU: where the config sets no KV cache size, each takes "
                             "this share of the default gpu_memory_utilization (a prefill instance at most "
                             "the KV it needs, see share_gpu)")
    parser.add_argument("--gpu-memory-utilization", type=float, default=None,
                        help="with --instances-per-gpu > 1 and no KV cache size in the config: this instance's "
                             "share of the GPU (a local cluster gives its decode instances what its prefill "
                             "instances left of the default)")
    parser.add_argument("--redis-url", default=os.environ.get(REDIS_URL_ENV, ""),
                        help=f"publish prefix-cache block events to this Redis (empty: don't; default "
                             f"${REDIS_URL_ENV}: a password stays out of `ps`)")
    parser.add_argument("--metrics-port", type=int, default=0,
                        help="Prometheus /metrics port, on --host; 0 picks a free one (see the ready file)")
    parser.add_argument("--drain-grace-s", type=float, default=30.0,
                        help="on SIGTERM, how long requests in flight get to finish")
    parser.add_argument("--stall-timeout-s", type=float, default=120.0,
                        help="health says NOT_SERVING when one engine step runs longer than this")
    parser.add_argument("--kv-faults", default="",
                        help='inject KV transport faults when sending, e.g. "corrupt=0.05,drop=0.02" (tests, soak)')
    parser.add_argument("--ready-file", type=Path, default=None,
                        help="written (JSON: port, metrics_port, kv_endpoint, pid) once the server is up")


def build_engine(args: argparse.Namespace, role: EngineRole) -> tuple[EngineCore, Any]:
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s {args.name} %(levelname)s %(name)s: %(message)s")
    faults.configure(args.kv_faults)
    config = EngineConfig.from_yaml(args.config).with_overrides(role=role)
    if args.num_threads is not None:
        config = config.with_overrides(num_threads=args.num_threads)
    config = share_gpu(config, args.instances_per_gpu, args.gpu_memory_utilization)
    core = EngineCore(config)
    path = core.source.tokenizer_path
    return core, (load_tokenizer(path) if path is not None else None)


def share_gpu(config: EngineConfig, instances_per_gpu: int, utilization: float | None = None) -> EngineConfig:
    """On CUDA, with no KV cache size in `config`, how instances sharing one GPU split it
    (their fractions must add up to at most 1): `utilization` where the launcher gives it
    (what the instances started before this one left), else an equal part of the default.
    A prefill instance keeps only the KV it needs (memory.prefill_kv_tokens): it hands each
    prompt's blocks to a decode instance as they are computed, and the decode side, which
    holds every running sequence's context, needs the room."""
    if instances_per_gpu <= 1 or config.cache.size_given or resolve_device(config.device).type != "cuda":
        return config
    assert CUDA_DEFAULTS.gpu_memory_utilization is not None
    share = utilization or CUDA_DEFAULTS.gpu_memory_utilization / instances_per_gpu
    config = config.with_overrides(gpu_memory_utilization=share)
    if config.role == EngineRole.PREFILL and config.cache.max_total_tokens is None:
        arch = ModelArchConfig.from_hf_dict(resolve(config.model).hf_config)
        sched = with_device_defaults(config, torch.device("cuda")).scheduler
        tokens = prefill_kv_tokens(max_model_len(config, arch.max_position_embeddings), sched)
        config = config.with_overrides(max_total_tokens=tokens)
    return config


def gpu_footprint(core: EngineCore) -> dict[str, int]:
    """For the ready file on CUDA: the GPU's size and what this instance holds of it (a
    launcher sizes the next instance on the same GPU from these); {} elsewhere."""
    if core.device.type != "cuda":
        return {}
    sched = core.config.scheduler
    activations = activation_bytes(core.model.config, sched, core.dtype.itemsize)
    return {"gpu_total_bytes": int(torch.cuda.mem_get_info(core.device)[1]),
            "gpu_bytes": footprint_bytes(core.device, activations)}


def cluster_token() -> str:
    """The cluster token this process was started with (`vllm-cluster up` and `serve` put a
    fresh one in every instance's environment; empty outside a cluster). Internal RPCs and
    the KV handshake carry it."""
    return os.environ.get(TOKEN_ENV, "")


def instance_id(role: EngineRole, address: str) -> str:
    """How an instance is known in the prefix index: the router knows it by this address."""
    return f"{role}@{address}"


def serve(
    args: argparse.Namespace,
    service_name: str,
    add_servicer: Callable[[grpc.Server], None],
    ready_info: dict[str, Any],
    loop: EngineLoop,
    metrics: InstanceMetrics,
    on_drain: Callable[[], None] | None = None,
) -> None:
    """Serve until SIGTERM/SIGINT, then drain: health NOT_SERVING, `on_drain()`, new calls
    refused, calls in flight given --drain-grace-s to finish; then the engine stops and the
    process exits. `metrics` is served over HTTP on args.host:args.metrics_port meanwhile."""
    server, port, health = make_server(f"{args.host}:{args.port}", [service_name], cluster_token() or None)
    reporter = HealthReporter(health, [service_name], loop.problem)
    add_servicer(server)
    publisher = _start_publisher(args, loop, f"{args.host}:{port}") if args.redis_url else None
    server.start()
    metrics_port = metrics.serve(args.host, args.metrics_port)
    logging.getLogger(__name__).info("%s serving on %s:%d (metrics on port %d)",
                                     service_name, args.host, port, metrics_port)

    def drain() -> None:
        reporter.drain()
        if on_drain is not None:
            on_drain()

    announce_and_wait(server, port, args.ready_file, args.drain_grace_s, drain,
                      metrics_port=metrics_port, **ready_info, **gpu_footprint(loop.core))
    reporter.close()
    loop.stop()
    metrics.close()
    if publisher is not None:
        publisher.close()


def _tier_hashes(core: EngineCore) -> dict[str, list[bytes]]:
    """What each KV offload tier of the engine holds now ({} without tiers)."""
    offload = core.kv.offload
    if offload is None:
        return {}
    return {tier.value: [bytes(h) for h in offload.hashes(tier)] for tier in (Tier.HOST, Tier.DISK)}


def _start_publisher(args: argparse.Namespace, loop: EngineLoop, address: str) -> BlockEventPublisher:
    """Mirror the engine's prefix cache into Redis, for the router's prefix-aware routing."""
    core = loop.core
    publisher = BlockEventPublisher(
        args.redis_url,
        core.config.model.model,
        instance_id(core.role, address),
        snapshot=lambda: [bytes(h) for h in loop.call(lambda c: c.kv.pool.cached_hashes())],
        tier_snapshot=lambda: loop.call(_tier_hashes),
    )

    def wire(c: EngineCore) -> None:
        c.kv.pool.on_stored = publisher.on_stored
        c.kv.pool.on_removed = publisher.on_removed
        publisher.on_stored([bytes(h) for h in c.kv.pool.cached_hashes()])
        if c.kv.offload is not None:
            c.kv.offload.on_event = lambda tier, stored, hashes: publisher.on_tier_event(
                tier.value, stored, [bytes(h) for h in hashes]
            )
            for tier, hashes in _tier_hashes(c).items():
                publisher.on_tier_event(tier, True, hashes)

    loop.call(wire)
    publisher.start()
    return publisher
