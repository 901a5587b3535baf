"""python -m vllm_cluster.prefill_service --config configs/local.yaml --port 0 --ready-file /tmp/p0.json

Serves the PrefillWorker gRPC API around a prefill-role engine, with a KV sender."""

from __future__ import annotations

import argparse
import sys

import grpc

from vllm_cluster.engine.config import EngineRole
from vllm_cluster.engine.engine_loop import EngineLoop
from vllm_cluster.kv_transfer import KVLayout, make_sender
from vllm_cluster.metrics import InstanceMetrics
from vllm_cluster.prefill_service.servicer import PrefillServicer
from vllm_cluster.proto import cluster_pb2_grpc as pb_grpc
from vllm_cluster.worker.kv_pull import KVPullServicer
from vllm_cluster.worker.main import add_worker_args, build_engine, cluster_token, serve


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="prefill_service", description=__doc__.splitlines()[0])
    add_worker_args(parser)
    args = parser.parse_args(argv)
    core, _ = build_engine(args, role=EngineRole.PREFILL)
    kv_caches = core.transfer_caches
    layout = KVLayout.from_kv_caches(kv_caches, model=core.config.model.model)
    sender = make_sender(args.transport, kv_caches, layout, args.name, cluster_token(), host=args.kv_host)
    loop = EngineLoop(core, tokenizer=None, stall_timeout_s=args.stall_timeout_s)  # prefill only samples one token
    metrics = InstanceMetrics(loop, args.name)
    servicer = PrefillServicer(loop, sender, layout, args.transfer_timeout_s, metrics)
    pulls = KVPullServicer(loop, lambda: sender, layout, metrics)

    def add_servicers(server: grpc.Server) -> None:
        pb_grpc.add_PrefillWorkerServicer_to_server(servicer, server)
        pb_grpc.add_KVPullServicer_to_server(pulls, server)

    try:
        serve(args, "vllm_cluster.PrefillWorker", add_servicers, {}, loop, metrics)
    finally:
        loop.stop()
        sender.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
