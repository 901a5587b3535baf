"""The command lines of the cluster's processes, from the deployment: one place for the
Ray launcher (cluster/ray_cluster.py), `vllm-cluster worker` and docker-compose.

Placeholders that the process's host fills in: "{python}" (its interpreter), "{config}"
(the pool's resolved YAML), "{ready}" (its ready file), "{node_ip}" (its node's address).
The Redis URL, which may carry a password, is no argument (`ps` shows those to every user):
each process gets it in its environment (`redis_env`), as it gets the cluster token.
"""

from __future__ import annotations

from vllm_cluster.cluster.config import HOST_OF_NODE, Deployment
from vllm_cluster.cluster.layout import InstancePlan
from vllm_cluster.engine.config import EngineRole
from vllm_cluster.worker.rpc import REDIS_URL_ENV

ANY_HOST = ("0.0.0.0", "::", "")


def worker_argv(deployment: Deployment, plan: InstancePlan, kv_host: str = "") -> list[str]:
    """`python -m prefill_service ...` (or decode_service) for one instance. `kv_host`: where
    its KV listener binds and is reached; default cluster.host, or the node's address when
    that is a wildcard."""
    cluster = deployment.cluster
    host = bind_host(cluster.host)
    kv_host = kv_host or ("{node_ip}" if host in ANY_HOST else host)
    argv = [
        "{python}", "-m", f"vllm_cluster.{plan.role}_service", "--config", "{config}", "--ready-file", "{ready}",
        "--name", plan.name, "--host", host, "--port", str(plan.port),
        "--kv-host", kv_host, "--kv-port", str(plan.kv_port), "--metrics-port", str(plan.metrics_port),
        "--transport", cluster.transport,
    ]
    if cluster.num_threads is not None:
        argv += ["--num-threads", str(cluster.num_threads)]
    if cluster.kv_faults and plan.role == EngineRole.PREFILL:
        argv += ["--kv-faults", cluster.kv_faults]
    return argv


def bind_host(host: str) -> str:
    """The address a process binds for cluster.host: "node" is its node's own ("{node_ip}",
    filled in on the node); unset is loopback (listening everywhere is asked for by name)."""
    if host == HOST_OF_NODE:
        return "{node_ip}"
    return host or "127.0.0.1"


def router_argv(deployment: Deployment, prefill: list[str], decode: list[str]) -> list[str]:
    """`python -m router ...` given the instances' gRPC addresses."""
    router = deployment.router
    argv = ["{python}", "-m", "vllm_cluster.router", "--config", "{config}", "--ready-file", "{ready}",
            "--port", str(router.port), "--http-port", str(router.http_port)]
    for address in prefill:
        argv += ["--prefill", address]
    for address in decode:
        argv += ["--decode", address]
    return argv


def redis_env(deployment: Deployment, redis_url: str) -> dict[str, str]:
    """The environment that tells a worker or the router where Redis is (nothing without a
    prefix index: workers then publish nothing)."""
    return {REDIS_URL_ENV: redis_url} if deployment.wants_prefix_index and redis_url else {}
