"""`vllm-cluster up -f FILE [--detach]`: the whole cluster on Ray, from one YAML.

1. Load and validate the file with the command line's overrides (`--set key=value`, and
   the specific flags); check that the layout fits the devices and that fixed ports are
   free. Any error names file:line and what to change; nothing has started yet.
2. Join `cluster.ray_address`, or start a local Ray: inside this process, or (--detach) a
   `ray start --head` that outlives it.
3. RayCluster.start(): Redis if needed, the prefill and decode pools, the router; every
   server's health says SERVING.
4. Write the state file (`down`, `status`, `logs` read it), print where to connect.
5. --chat: one chat request through the router, its answer printed.
6. --detach: return, leaving it running. Otherwise serve until Ctrl-C or SIGTERM (also what
   `down` sends), then stop everything and remove the state file.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from vllm_cluster.client import Client, ClientError, Completion
from vllm_cluster.cluster.argv import bind_host
from vllm_cluster.cluster.cli_args import FLAG_KEYS
from vllm_cluster.cluster.config import Deployment
from vllm_cluster.cluster.config_file import load_deployment
from vllm_cluster.cluster.layout import (
    InstancePlan,
    check_engine_roles,
    check_layout,
    check_model_split,
    check_ports_free,
    listen_ports,
    plan_instances,
)
from vllm_cluster.cluster.procs import ProcessRef, stop_on_signals, terminate
from vllm_cluster.cluster.state import ClusterState, state_path
from vllm_cluster.engine.errors import ConfigError

if TYPE_CHECKING:
    from vllm_cluster.cluster.autoscaler import Autoscaler
    from vllm_cluster.cluster.ray_cluster import RayCluster
from vllm_cluster.worker.rpc import API_KEY_ENV


def overrides_of(args: argparse.Namespace) -> list[str]:
    overrides = list(args.overrides)
    for attr, key in FLAG_KEYS.items():
        value = getattr(args, attr, None)
        if value is not None:
            overrides.append(f"{key}={json.dumps(value) if isinstance(value, str) else value}")
    return overrides


def up_main(args: argparse.Namespace) -> int:
    try:
        deployment = load_deployment(args.config, overrides_of(args))
    except ConfigError as e:
        return _fail(str(e), 2)
    name = deployment.cluster.name
    path = state_path(args.state_dir, name)
    if path.exists() and is_running(ClusterState.load(path)):
        return _fail(f"cluster {name!r} is already up ({path}): `vllm-cluster down --name {name}` first, "
                     "or give this one another --name", 1)
    try:
        plans = _check_here(deployment)
    except ConfigError as e:
        return _fail(str(e), 2)
    if args.dry_run:
        _print_plan(deployment, plans)
        return 0
    log_dir = (args.log_dir or path.parent / name / "logs").resolve()
    return _Up(args, deployment, plans, path, log_dir).run()


class _Up:
    """The Ray side of `up`: its Ray, its cluster, and how it ends."""

    def __init__(self, args: argparse.Namespace, deployment: Deployment, plans: list[InstancePlan],
                 path: Path, log_dir: Path) -> None:
        self.args = args
        self.deployment = deployment
        self.plans = plans
        self.path = path
        self.log_dir = log_dir
        self.namespace = f"vllm-cluster.{deployment.cluster.name}"
        self.head: ProcessRef | None = None
        self.head_address = ""

    def run(self) -> int:
        if not self.deployment.cluster.ray_address:
            from vllm_cluster.cluster.ray_head import use_local_ray

            use_local_ray()  # before Ray's first import: it reads some settings only then
        from vllm_cluster.cluster.ray_cluster import ClusterStartError, RayCluster

        stop_on_signals()  # SIGTERM stops it like Ctrl-C (procs.stop_on_signals)
        for private in (self.path.parent, self.log_dir):  # the token; resolved configs may hold the API key
            private.mkdir(mode=0o700, parents=True, exist_ok=True)
        try:
            ray_address = self._start_ray()
        except (ConfigError, RuntimeError, ConnectionError) as e:
            self._stop_ray()
            return _fail(str(e), 2 if isinstance(e, ConfigError) else 1)
        stop_on_signals()  # again: ray.init may take SIGTERM
        api_key = self.deployment.router.api_key or os.environ.get(API_KEY_ENV, "")
        cluster = RayCluster(self.deployment, self.plans, self.log_dir, self.namespace,
                             detached=self.args.detach, api_key=api_key)
        try:
            cluster.start(on_progress=lambda step: print(f"{step} ...", flush=True))
        except ClusterStartError as e:
            self._stop_ray()
            return _fail(str(e), 1)
        except KeyboardInterrupt:
            self._stop_ray()
            return 130
        state = self._state(cluster, ray_address, api_key)
        state.save(self.path)
        _print_connect(state, self.deployment)
        return self._serve(cluster, state)

    def _state(self, cluster: RayCluster, ray_address: str, api_key: str) -> ClusterState:
        return ClusterState(
            name=self.deployment.cluster.name, config_file=str(Path(self.args.config).resolve()),
            token=cluster.token, api_key=api_key, router_address=cluster.router_address,
            http_address=cluster.http_address, redis_url=cluster.redis_url, log_dir=str(self.log_dir),
            ray_address=ray_address, ray_namespace=self.namespace, ray_head=self.head,
            owner=None if self.args.detach else ProcessRef.of(os.getpid()),
            processes=cluster.records, placement_groups=cluster.placement_groups,
        )

    def _serve(self, cluster: RayCluster, state: ClusterState) -> int:
        """--chat, then return (--detach) or serve until Ctrl-C / SIGTERM and stop it all."""
        autoscaler: Autoscaler | None = None
        try:
            if self.args.chat is not None:
                try:
                    ask_once(cluster.router_address, state.api_key or None, self.args.chat, self.args.max_tokens)
                except ClientError as e:
                    print(f"error: the chat request failed: {e}", file=sys.stderr)
            if self.args.detach:
                if self.deployment.autoscaler.enabled:
                    print("the autoscaler runs beside a detached cluster as `vllm-cluster autoscale"
                          f" --name {state.name}`", flush=True)
                import ray

                ray.shutdown()  # only this driver: the detached actors and the head stay
                print(f"running detached; stop it with: vllm-cluster down --name {state.name}"
                      + (f" --state-dir {self.args.state_dir}" if self.args.state_dir else ""))
                return 0
            autoscaler = self._start_autoscaler(state)
            print("serving; Ctrl-C stops it", flush=True)
            while True:
                signal.pause()
        except KeyboardInterrupt:
            pass
        for sig in (signal.SIGINT, signal.SIGTERM):  # a second Ctrl-C must not cut the stop short
            signal.signal(sig, signal.SIG_IGN)
        print("stopping ...", flush=True)
        try:
            if autoscaler is not None:
                autoscaler.stop()
                autoscaler.scaler.stop()
            cluster.stop()
            self._stop_ray()
            terminate([r.process for r in cluster.records], grace_s=10.0)  # what Ray could not stop
        finally:
            self.path.unlink(missing_ok=True)
        print("stopped")
        return 0

    def _start_autoscaler(self, state: ClusterState) -> Autoscaler | None:
        """The autoscaler (autoscaler.enabled) as a thread of this process, which owns the
        instances it places."""
        if not self.deployment.autoscaler.enabled:
            return None
        from vllm_cluster.cluster.autoscaler import Autoscaler
        from vllm_cluster.cluster.scale import PoolScaler

        print(f"autoscaler on: every {self.deployment.autoscaler.interval_s:g} s", flush=True)
        return Autoscaler(self.deployment.autoscaler, PoolScaler(self.deployment, state, self.path, detached=False,
                                                                 log=lambda line: print(line, flush=True))).start()

    def _start_ray(self) -> str:
        from vllm_cluster.cluster import ray_head

        address = self.deployment.cluster.ray_address
        num_cpus = os.cpu_count() or 1
        if address:
            ray_head.connect(address, self.namespace, local=False)
            self.plans = check_layout(self.deployment, ray_head.ray_resources())
            router = self.deployment.router
            ports = {p: k for p, k in listen_ports(self.deployment, []).items() if k.startswith("router.")}
            check_ports_free(self.deployment, ports, router.host or "127.0.0.1")
            return address
        if self.args.detach:
            address, self.head = ray_head.start_head(self.log_dir / "ray-head.log", num_cpus)
            self.head_address = address
            ray_head.connect(address, self.namespace, local=True)
            return address
        return ray_head.start_in_process(num_cpus, self.namespace)

    def _stop_ray(self) -> None:
        import ray

        ray.shutdown()
        if self.head is not None:
            from vllm_cluster.cluster.ray_head import stop_head

            stop_head(self.head, self.head_address)


def _check_here(deployment: Deployment) -> list[InstancePlan]:
    """What can be checked before Ray: the engine each pool runs, and, for a Ray on this
    machine, the layout against its devices and the fixed ports. (On an existing Ray
    cluster the layout is checked against its nodes once connected.)"""
    check_engine_roles(deployment)
    if deployment.cluster.ray_address:
        check_model_split(deployment)
        return plan_instances(deployment, use_gpus=deployment.engine.device != "cpu")
    from vllm_cluster.cluster.ray_head import local_resources

    plans = check_layout(deployment, local_resources(deployment.engine.device))
    host = bind_host(deployment.cluster.host).replace("{node_ip}", "127.0.0.1")  # a local Ray's node address
    check_ports_free(deployment, listen_ports(deployment, plans), host)
    return plans


def is_running(state: ClusterState) -> bool:
    """Whether anything a state file records still runs."""
    refs = [r.process for r in state.processes] + [r for r in (state.owner, state.ray_head) if r is not None]
    return any(r.alive() for r in refs)


def ask_once(address: str, api_key: str | None, message: str, max_tokens: int) -> None:
    """One chat message through the router: the answer streamed to stdout, then its usage
    and the time-to-first-token breakdown."""
    with Client(address, api_key=api_key) as client:
        print(f">>> {message}")
        result = Completion("")
        for piece in client.stream(chat=[{"role": "user", "content": message}], max_tokens=max_tokens, temperature=0):
            print(piece.text, end="", flush=True)
            result.add(piece)
    print("\n" + timings_line(result), flush=True)


def timings_line(result: Completion) -> str:
    assert result.usage is not None and result.timings is not None
    t = result.timings
    return (f"[{result.usage.completion_tokens} tokens, finish_reason={result.finish_reason}; "
            f"ttft {t.ttft_s * 1e3:.0f} ms: router {t.router_s * 1e3:.0f}, prefill queue "
            f"{t.prefill_queue_s * 1e3:.0f}, prefill compute {t.prefill_compute_s * 1e3:.0f}, "
            f"transfer {t.transfer_s * 1e3:.0f} ({t.num_kv_blocks_sent} blocks/layer), decode queue "
            f"{t.decode_queue_s * 1e3:.0f}; total {t.total_s * 1e3:.0f} ms]")


def _print_plan(deployment: Deployment, plans: list[InstancePlan]) -> None:
    router = deployment.router
    print(f"cluster {deployment.cluster.name!r}: ray {deployment.cluster.ray_address or 'local'}, "
          f"transport {deployment.cluster.transport}, model {deployment.engine.model.model}")
    print(f"  router  {router.host}:{router.port or 'any'} (http {router.http_port or 'any'}, policy {router.policy})")
    for plan in plans:
        ports = f"port {plan.port or 'any'}, kv {plan.kv_port or 'any'}, metrics {plan.metrics_port or 'any'}"
        print(f"  {plan.name:<10} tp {plan.tensor_parallel_size} x pp {plan.pipeline_parallel_size}, "
              f"bundles {list(plan.bundles)}, {ports}")


def _print_connect(state: ClusterState, deployment: Deployment) -> None:
    roles = [r.role for r in state.processes]
    auth = " -H 'Authorization: Bearer $VLLM_API_KEY'" if state.api_key else ""
    body = json.dumps({"model": deployment.engine.model.model, "max_tokens": 32,
                       "messages": [{"role": "user", "content": "Hi!"}]})
    print(f"cluster {state.name!r} is up: {roles.count('prefill')} prefill + {roles.count('decode')} decode "
          f"instances ({deployment.cluster.transport}), Ray at {state.ray_address}")
    print(f"  gRPC  {state.router_address}   (vllm-cluster chat --address {state.router_address})")
    print(f"  HTTP  {state.http_address}/v1   (OpenAI-compatible)")
    print(f"  try   curl {state.http_address}/v1/chat/completions -H 'Content-Type: application/json'"
          f"{auth} -d {shlex.quote(body)}")
    print(f"  logs  {state.log_dir}   (vllm-cluster logs INSTANCE; vllm-cluster status)", flush=True)


def _fail(message: str, code: int) -> int:
    print(f"error: {message}", file=sys.stderr)
    return code

