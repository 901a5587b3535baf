"""`vllm-cluster chaos`: a chaos run (loadtest/chaos.py) against a cluster that `vllm-cluster
up` started. The target: its processes by name, signalled where they run now (after a
restart, the process its watchdog started), `status`'s health probe, and the workers'
Stats. Prints the report as JSON and exits 0 when every request ended cleanly and the
cluster healed, 1 otherwise.

    vllm-cluster chaos -f configs/local.yaml --num-faults 20 --fault-interval-s 10
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from typing import Any

from vllm_cluster.cluster.restarts import current_process
from vllm_cluster.cluster.state import ClusterState
from vllm_cluster.cluster.status import find_state, probe
from vllm_cluster.engine.errors import ConfigError
from vllm_cluster.loadtest.chaos import Chaos, ChaosReport, ChaosSettings
from vllm_cluster.proto import cluster_pb2 as pb
from vllm_cluster.proto import cluster_pb2_grpc as pb_grpc
from vllm_cluster.worker.rpc import make_channel

_STUBS: dict[str, Any] = {"prefill": pb_grpc.PrefillWorkerStub, "decode": pb_grpc.DecodeWorkerStub}


class UpTarget:
    def __init__(self, state: ClusterState) -> None:
        self.state = state

    def process_names(self) -> list[str]:
        return [record.name for record in self.state.processes]

    def signal(self, name: str, sig: int) -> None:
        current_process(self.state.record(name)).signal(sig)

    def recovered(self) -> bool:
        return all(s.alive and s.healthy for s in (probe(r, self.state.token) for r in self.state.processes))

    def worker_stats(self) -> dict[str, pb.WorkerStats]:
        stats = {}
        for record in self.state.processes:
            if record.role in _STUBS:
                channel = make_channel(record.address, self.state.token)
                try:
                    stats[record.name] = _STUBS[record.role](channel).Stats(pb.StatsRequest(), timeout=5.0)
                finally:
                    channel.close()
        return stats


def chaos_main(args: argparse.Namespace) -> int:
    try:
        _, state = find_state(args)
    except (ConfigError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    settings = ChaosSettings(
        state.router_address, state.http_address, api_key=state.api_key,
        num_faults=args.num_faults, fault_interval_s=args.fault_interval_s, concurrency=args.concurrency,
        seed=args.seed,
    )
    if args.prompts:
        settings = dataclasses.replace(settings, prompts=tuple(args.prompts))
    report = Chaos(UpTarget(state), settings).run()
    print(json.dumps(report_dict(report)))
    return 0 if report.clean else 1


def report_dict(report: ChaosReport) -> dict[str, object]:
    # Not dataclasses.asdict: it rebuilds a Counter from (key, count) pairs, counting the pairs.
    fields = {f.name: getattr(report, f.name) for f in dataclasses.fields(report)}
    return {**fields, "outcomes": dict(report.outcomes), "unclean": dict(report.unclean), "clean": report.clean}
