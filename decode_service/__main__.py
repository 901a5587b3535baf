"""python -m vllm_cluster.decode_service --config configs/local.yaml --port 0 --ready-file /tmp/d0.json

Serves the DecodeWorker gRPC API around a decode-role engine, with a KV receiver."""

from __future__ import annotations

import argparse
import sys

import grpc

from vllm_cluster.decode_service.servicer import DecodeServicer
from vllm_cluster.engine.config import EngineRole
from vllm_cluster.engine.engine_loop import EngineLoop
from vllm_cluster.kv_transfer import KVLayout, make_receiver, make_sender
from vllm_cluster.metrics import InstanceMetrics
from vllm_cluster.proto import cluster_pb2_grpc as pb_grpc
from vllm_cluster.worker.kv_pull import KVPullServicer
from vllm_cluster.worker.main import add_worker_args, build_engine, cluster_token, serve


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="decode_service", description=__doc__.splitlines()[0])
    add_worker_args(parser)
    parser.add_argument("--lease-s", type=float, default=30.0, help="default reservation lease")
    args = parser.parse_args(argv)
    core, tokenizer = build_engine(args, role=EngineRole.DECODE)
    kv_caches = core.transfer_caches
    layout = KVLayout.from_kv_caches(kv_caches, model=core.config.model.model)
    receiver = make_receiver(args.transport, kv_caches, layout, args.kv_host, args.kv_port, cluster_token())
    servicer: DecodeServicer | None = None

    def before_abort(request_id: str) -> None:
        assert servicer is not None
        servicer.before_abort(request_id)

    loop = EngineLoop(core, tokenizer, before_abort=before_abort, stall_timeout_s=args.stall_timeout_s)
    servicer = DecodeServicer(loop, receiver, layout, args.lease_s, args.transfer_timeout_s)
    metrics = InstanceMetrics(loop, args.name)
    # Serves pulls: pushes prefix blocks from this cache into another instance's reservation.
    pulls = KVPullServicer(
        loop, lambda: make_sender(args.transport, kv_caches, layout, args.name, cluster_token(), host=args.kv_host),
        layout, metrics,
    )

    def add_servicers(server: grpc.Server) -> None:
        pb_grpc.add_DecodeWorkerServicer_to_server(servicer, server)
        pb_grpc.add_KVPullServicer_to_server(pulls, server)

    try:
        serve(args, "vllm_cluster.DecodeWorker", add_servicers, {"kv_endpoint": receiver.endpoint}, loop, metrics,
              on_drain=servicer.subscribers.drain)
    finally:
        loop.stop()
        receiver.close()
        pulls.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
