"""The autoscaler's shell: every `autoscaler.interval_s`, read what the router saw, decide
(cluster/autoscaler_policy.py, pure) and apply the answer through `vllm-cluster scale`'s
code path (cluster/scale.py's PoolScaler).

It runs where Ray can place instances: in a foreground `vllm-cluster up` (a thread, its
instances owned by that process), or as `vllm-cluster autoscale` beside a cluster of
`up --detach`. Each round:
  1. Scrape the router's /metrics: the TTFT and inter-token histograms; their p99 over the
     window since the last round.
  2. Ask the router's admin service for every instance's queue (waiting requests).
  3. `decide`; a different answer is applied at once (placing an instance blocks the
     round until it serves; draining one, until it is empty and stopped).
A failed round (router unreachable, an instance that would not start) is logged, and the
next round tries again.

`stop()` ends the rounds in a bounded time whatever they are doing: a placement under way
gives up and takes away what it placed, a drain is cut short (cluster/scale.py). The
command stops on SIGINT or SIGTERM, even when it was started with SIGINT ignored (a
background job of a non-interactive shell, as in CI, inherits that).
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
import time
import urllib.request

import grpc
from prometheus_client.parser import text_string_to_metric_families

from vllm_cluster.cluster.autoscaler_config import AutoscalerConfig
from vllm_cluster.cluster.autoscaler_policy import Observation, decide, window_p99_ms
from vllm_cluster.cluster.config_file import load_deployment
from vllm_cluster.cluster.procs import stop_on_signals
from vllm_cluster.cluster.scale import PoolScaler, ScaleError, ScaleStopped, pool_sizes
from vllm_cluster.cluster.status import find_state
from vllm_cluster.engine.errors import ConfigError
from vllm_cluster.proto import cluster_pb2 as pb
from vllm_cluster.proto import cluster_pb2_grpc as pb_grpc
from vllm_cluster.worker.rpc import make_channel

logger = logging.getLogger(__name__)

TTFT = "vllm:time_to_first_token_seconds"
ITL = "vllm:inter_token_latency_seconds"
_TIMEOUT_S = 10.0
# After a stop request, a step in flight has ended within this much more than the
# router's drain grace (a shrink's worker drains that long; the rest takes seconds).
_STOP_SLACK_S = 60.0

Buckets = dict[float, float]  # a histogram's upper bounds (s) -> cumulative counts


class Autoscaler:
    def __init__(self, config: AutoscalerConfig, scaler: PoolScaler) -> None:
        self.config = config
        self.scaler = scaler
        self._buckets: dict[str, Buckets] = {}
        self._changed_at = time.monotonic()
        self._stopped = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> Autoscaler:
        self._buckets = self._scrape()
        self._thread = threading.Thread(target=self._run, name="autoscaler", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> bool:
        """End the rounds; a step in flight ends early (the module docstring). Returns whether
        the autoscaler's thread ended in time."""
        self._stopped.set()
        self.scaler.stopping.set()
        if self._thread is None:
            return True
        self._thread.join(timeout=self.scaler.deployment.router.drain_grace_s + _STOP_SLACK_S)
        return not self._thread.is_alive()

    def _run(self) -> None:
        while not self._stopped.wait(self.config.interval_s):
            try:
                self.step()
            except ScaleStopped as e:
                logger.info("autoscaler: %s", e)
            except grpc.RpcError as e:
                logger.warning("autoscaler: the router did not answer (%s: %s); trying again in %g s",
                               e.code().name, e.details(), self.config.interval_s)
            except (ScaleError, OSError, ValueError) as e:
                logger.warning("autoscaler: this round failed (%s); trying again in %g s", e, self.config.interval_s)

    def step(self) -> None:
        """One round: observe, decide, apply."""
        self.scaler.sync_router()
        seen = self.observe()
        now = pool_sizes(self.scaler.state)
        wanted = decide(self.config, now, seen)
        if wanted == now:
            return
        logger.info("autoscaler: %d prefill + %d decode -> %d + %d (ttft p99 %s ms, itl p99 %s ms, queues %s / %s)",
                    now.num_prefill, now.num_decode, wanted.num_prefill, wanted.num_decode, seen.ttft_p99_ms,
                    seen.itl_p99_ms, list(seen.prefill_queues), list(seen.decode_queues))
        self.scaler.scale(wanted)
        self._changed_at = time.monotonic()
        self._buckets = self._scrape()  # the next window starts with the new pools

    def observe(self) -> Observation:
        buckets = self._scrape()
        before, self._buckets = self._buckets, buckets
        state = self.scaler.state
        with make_channel(state.router_address, state.token) as channel:
            listed = pb_grpc.RouterAdminStub(channel).ListInstances(pb.ListInstancesRequest(), timeout=_TIMEOUT_S)
        routed = [i for i in listed.instances if not i.draining]
        return Observation(
            ttft_p99_ms=window_p99_ms(before.get(TTFT, {}), buckets.get(TTFT, {})),
            itl_p99_ms=window_p99_ms(before.get(ITL, {}), buckets.get(ITL, {})),
            prefill_queues=tuple(i.num_waiting for i in routed if i.role == "prefill"),
            decode_queues=tuple(i.num_waiting for i in routed if i.role == "decode"),
            since_change_s=time.monotonic() - self._changed_at,
        )

    def _scrape(self) -> dict[str, Buckets]:
        state = self.scaler.state
        request = urllib.request.Request(f"{state.http_address}/metrics")
        if state.api_key:
            request.add_header("Authorization", f"Bearer {state.api_key}")
        with urllib.request.urlopen(request, timeout=_TIMEOUT_S) as reply:
            return histogram_buckets(reply.read().decode(), (TTFT, ITL))


def histogram_buckets(text: str, names: tuple[str, ...]) -> dict[str, Buckets]:
    """The cumulative buckets of the named histograms in a Prometheus text exposition."""
    found: dict[str, Buckets] = {}
    for family in text_string_to_metric_families(text):
        if family.name in names:
            found[family.name] = {float(s.labels["le"]): s.value for s in family.samples if s.name.endswith("_bucket")}
    return found


def autoscale_main(args: argparse.Namespace) -> int:
    """`vllm-cluster autoscale`: the autoscaler beside a cluster of `up --detach`, until Ctrl-C."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        path, state = find_state(args)
        deployment = load_deployment(state.config_file, args.overrides)
    except (ConfigError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    if state.owner is not None:
        print(f"error: cluster {state.name!r} belongs to a foreground `vllm-cluster up` (pid {state.owner.pid}): "
              "turn its autoscaler on in the YAML (autoscaler.enabled: true) instead", file=sys.stderr)
        return 1
    from vllm_cluster.cluster.ray_head import connect

    autoscaler: Autoscaler | None = None
    stop_on_signals()
    try:
        connect(state.ray_address, state.ray_namespace, local=state.ray_head is not None)
        stop_on_signals()  # again: ray.init may take SIGTERM
        autoscaler = Autoscaler(deployment.autoscaler, PoolScaler(deployment, state, path, detached=True)).start()
        print(f"autoscaling cluster {state.name!r} every {deployment.autoscaler.interval_s:g} s; Ctrl-C stops it",
              flush=True)
        while True:
            signal.pause()
    except KeyboardInterrupt:
        pass
    for sig in (signal.SIGINT, signal.SIGTERM):  # a second Ctrl-C must not cut the stop short
        signal.signal(sig, signal.SIG_IGN)
    print("stopping ...", flush=True)
    if autoscaler is not None and not autoscaler.stop():
        print("error: the autoscaler's step in flight did not end; leaving it (`vllm-cluster status` shows the "
              "pools)", file=sys.stderr, flush=True)
        os._exit(1)  # Ray's exit handler would wait for that step
    import ray

    ray.shutdown()  # only this driver: the cluster's detached actors and its head stay
    print("stopped", flush=True)
    return 0

