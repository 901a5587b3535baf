"""Where each instance goes: the plan `up` places with Ray, and the checks that refuse an
impossible one before anything starts.

An instance of a pool is a placement group of tp x pp bundles, all on one node: {"GPU": 1}
per rank when the engine runs on GPUs, else {"CPU": num_cpus_per_rank}. Its rank-0 bundle
runs the worker process (which starts ranks 1.. itself, on the bundles' devices). Instance
i of a pool listens on the pool's port + i (0: a free one). Decisions here are pure: the
resources come in as data.
"""

from __future__ import annotations

import socket
from dataclasses import dataclass, field

from vllm_cluster.cluster.config import ROLES, Deployment
from vllm_cluster.engine.errors import ConfigError, ModelLoadError


@dataclass(frozen=True, slots=True)
class Resources:
    """What the Ray cluster (or this machine, before Ray starts) offers."""

    num_cpus: float
    gpus_per_node: tuple[int, ...]  # one entry per node
    # Custom resources (`ray start --resources`) -> the most one node offers.
    custom: dict[str, float] = field(default_factory=dict)

    @property
    def num_gpus(self) -> int:
        return sum(self.gpus_per_node)


@dataclass(frozen=True, slots=True)
class InstancePlan:
    name: str  # "prefill-0"
    role: str
    tensor_parallel_size: int
    pipeline_parallel_size: int
    bundles: tuple[dict[str, float], ...]  # one per rank, rank 0 first
    port: int  # 0: a free one
    kv_port: int
    metrics_port: int

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size


def uses_gpus(deployment: Deployment, resources: Resources) -> bool:
    device = deployment.engine.device
    return device.startswith("cuda") or (device == "auto" and resources.num_gpus > 0)


def plan_instances(deployment: Deployment, use_gpus: bool) -> list[InstancePlan]:
    plans = []
    for role in ROLES:
        pool = deployment.pool(role)
        tp, pp = deployment.parallel_of(role)
        bundle = {"GPU": 1.0} if use_gpus else {"CPU": pool.num_cpus_per_rank}
        for i in range(deployment.num_instances(role)):
            plans.append(InstancePlan(
                name=f"{role}-{i}", role=role, tensor_parallel_size=tp, pipeline_parallel_size=pp,
                bundles=tuple({**bundle, **pool.placement_of(i)} for _ in range(tp * pp)),
                port=_nth(pool.port, i), kv_port=_nth(pool.kv_port, i), metrics_port=_nth(pool.metrics_port, i),
            ))
    return plans


def _nth(base: int, i: int) -> int:
    return base + i if base else 0


def check_layout(deployment: Deployment, resources: Resources) -> list[InstancePlan]:
    """The plan, or a ConfigError at the key to change: a split the model does not allow, an
    instance larger than a node, pools larger than the cluster."""
    check_model_split(deployment)
    use_gpus = uses_gpus(deployment, resources)
    plans = plan_instances(deployment, use_gpus)
    for role in ROLES:
        _check_instance_fits(deployment, role, resources, use_gpus)
    _check_placement(deployment, plans, resources)
    if use_gpus:
        needed = sum(p.world_size for p in plans)
        if needed > resources.num_gpus:
            raise deployment.error("cluster.num_decode", (
                f"cluster: the pools need {needed} GPUs ({_count(deployment)}) but there are {resources.num_gpus}: "
                "lower cluster.num_prefill / num_decode or the tensor/pipeline sizes"
            ), "cluster.num_prefill")
    else:
        needed_cpus = sum(sum(b["CPU"] for b in p.bundles) for p in plans) + deployment.cluster.router_num_cpus
        if needed_cpus > resources.num_cpus + 1e-9:
            raise deployment.error("cluster.num_decode", (
                f"cluster: the pools and the router need {needed_cpus:g} CPUs ({_count(deployment)}, router "
                f"{deployment.cluster.router_num_cpus:g}) but there are {resources.num_cpus:g}: lower "
                "cluster.prefill/decode.num_cpus_per_rank, cluster.router_num_cpus or the instance counts"
            ), "cluster.num_prefill")
    return plans


def _check_placement(deployment: Deployment, plans: list[InstancePlan], resources: Resources) -> None:
    """Every custom resource a placement rule names is offered by some node, in the amount
    one instance takes (else Ray would wait for a node that never comes)."""
    for plan in plans:
        for name, amount in plan.bundles[0].items():
            if name in ("CPU", "GPU"):
                continue
            needed = amount * len(plan.bundles)
            key = f"cluster.{plan.role}.placement"
            if name not in resources.custom:
                raise deployment.error(key, (
                    f"{key}: {plan.name} asks for the Ray resource {name!r}, but no Ray node offers it (a Ray "
                    f"that `up` starts itself offers none): start the nodes with "
                    f"`ray start --resources '{{\"{name}\": 100}}'` and set cluster.ray_address, or remove the rule"
                ))
            if needed > resources.custom[name] + 1e-9:
                raise deployment.error(key, (
                    f"{key}: {plan.name} needs {needed:g} of the Ray resource {name!r} on one node, but the "
                    f"largest offer is {resources.custom[name]:g}: lower the amount in the rule"
                ))


def _count(deployment: Deployment) -> str:
    parts = []
    for role in ROLES:
        tp, pp = deployment.parallel_of(role)
        parts.append(f"{deployment.num_instances(role)} {role} x {tp * pp} ranks")
    return ", ".join(parts)


def _check_instance_fits(deployment: Deployment, role: str, resources: Resources, use_gpus: bool) -> None:
    if deployment.num_instances(role) == 0:
        return
    tp, pp = deployment.parallel_of(role)
    tp_key = deployment.parallel_key(role, "tensor_parallel_size")
    pp_key = deployment.parallel_key(role, "pipeline_parallel_size")
    if use_gpus:
        largest = max(resources.gpus_per_node, default=0)
        if largest == 0:
            raise deployment.error("engine.device", (
                f"engine.device: {deployment.engine.device!r} but there is no GPU here: set engine.device: cpu, "
                "or run on (or set cluster.ray_address to) a machine with GPUs"
            ))
        if tp * pp > largest:
            raise deployment.error(tp_key, (
                f"{tp_key}: {role} instances need {tp} x {pp} (pipeline) = {tp * pp} GPUs on one node, "
                f"but the largest node has {largest}: lower {tp_key} or {pp_key}, or set engine.device: cpu"
            ), pp_key, "engine.device")
        return
    per_rank = deployment.pool(role).num_cpus_per_rank
    if tp * pp * per_rank > resources.num_cpus + 1e-9:
        cpus_key = f"cluster.{role}.num_cpus_per_rank"
        raise deployment.error(tp_key, (
            f"{tp_key}: {role} instances need {tp} x {pp} (pipeline) ranks x {per_rank:g} CPUs = "
            f"{tp * pp * per_rank:g} CPUs, but there are {resources.num_cpus:g}: lower {tp_key}, "
            f"{pp_key} or {cpus_key}"
        ), pp_key, cpus_key)


def check_engine_roles(deployment: Deployment) -> None:
    """Each pool's engine as its workers will build it (the role set, the pool's split): what
    the engine refuses for a role (a split it cannot run yet) is refused here, at the key."""
    backend = deployment.engine.parallel.distributed_executor_backend
    if backend != "mp":
        key = "engine.parallel.distributed_executor_backend"
        raise deployment.error(key, (
            f"{key}: {backend!r} is for the offline LLM; an instance's ranks already run in its own "
            "Ray placement group under `up` (or as processes under `serve` / `worker`): remove the key"
        ))
    for role in ROLES:
        if deployment.num_instances(role) == 0:
            continue
        try:
            deployment.engine_for(role).with_overrides(role=role)
        except ConfigError as e:
            key = deployment.parallel_key(role, "tensor_parallel_size")
            raise deployment.error(
                key, f"cluster.{role}: {e}", deployment.parallel_key(role, "pipeline_parallel_size")
            ) from None


def check_model_split(deployment: Deployment) -> None:
    """Each pool's tp x pp must split the model's heads and layers (KV heads divisible by tp)."""
    from vllm_cluster.engine.loader import resolve  # imports torch: only when a layout is checked
    from vllm_cluster.engine.models import ModelArchConfig
    from vllm_cluster.engine.parallel import check_model

    try:
        arch = ModelArchConfig.from_hf_dict(resolve(deployment.engine.model).hf_config)
    except ModelLoadError as e:
        raise deployment.error("engine.model.model", str(e)) from None
    for role in ROLES:
        if deployment.num_instances(role) == 0:
            continue
        tp, pp = deployment.parallel_of(role)
        try:
            check_model(arch, tp, pp, deployment.engine.parallel.enable_expert_parallel)
        except ConfigError as e:
            if str(e).startswith("enable_expert_parallel"):
                key = "engine.parallel.enable_expert_parallel"
                raise deployment.error(
                    key, f"{key}: {e}", deployment.parallel_key(role, "tensor_parallel_size")
                ) from None
            which = "tensor_parallel_size" if str(e).startswith("tensor") else "pipeline_parallel_size"
            key = deployment.parallel_key(role, which)
            raise deployment.error(key, f"{key}: {e}") from None


def listen_ports(deployment: Deployment, plans: list[InstancePlan]) -> dict[int, str]:
    """Every fixed port the deployment listens on -> the key that set it."""
    ports: dict[int, str] = {}

    def add(port: int, key: str) -> None:
        if port == 0:
            return
        if port in ports:
            raise deployment.error(key, f"{key}: port {port} is also {ports[port]}'s: give each listener its own")
        ports[port] = key

    add(deployment.router.port, "router.port")
    add(deployment.router.http_port, "router.http_port")
    for plan in plans:
        for which in ("port", "kv_port", "metrics_port"):
            add(getattr(plan, which), f"cluster.{plan.role}.{which}")
    return ports


def check_ports_free(deployment: Deployment, ports: dict[int, str], host: str) -> None:
    """Refuse ports something on this machine already listens on."""
    for port, key in ports.items():
        if not port_is_free(host, port):
            raise deployment.error(key, (
                f"{key}: port {port} is in use on {host}: stop what listens there, pick another "
                "port, or set 0 for a free one"
            ))


def port_is_free(host: str, port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as servers bind: only listeners conflict
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True
