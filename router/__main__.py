"""python -m router --config configs/local.yaml --prefill 127.0.0.1:50100 --decode 127.0.0.1:50200

Serves the client Generation API, routing to the given prefill and decode instances."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path

import yaml

from engine.config import EngineConfig
from engine.loader import resolve
from engine.tokenizer import load_tokenizer
from kv_index import PrefixIndex
from proto import cluster_pb2_grpc as pb_grpc
from proto.rpc import TOKEN_ENV, announce_and_wait, make_server
from router.config import RouterConfig
from router.registry import Registry
from router.servicer import RouterServicer


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="router", description=__doc__.splitlines()[0])
    parser.add_argument("--config", "-f", required=True, help="cluster YAML (engine: and router: sections)")
    parser.add_argument("--prefill", action="append", default=[], help="host:port of a prefill instance")
    parser.add_argument("--decode", action="append", default=[], help="host:port of a decode instance")
    parser.add_argument("--port", type=int, default=None, help="overrides router.port; 0 picks one")
    parser.add_argument("--redis-url", default=None, help="overrides router.redis_url")
    parser.add_argument("--ready-file", type=Path, default=None)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s router %(levelname)s %(name)s: %(message)s")
    if not args.decode:
        parser.error("give at least one --decode instance")
    data = yaml.safe_load(Path(args.config).read_text()) or {}
    config = RouterConfig.from_dict(data.get("router"))
    if args.redis_url is not None:
        config.redis_url = args.redis_url
    engine_config = EngineConfig.from_yaml(args.config)
    source = resolve(engine_config.model)
    tokenizer = load_tokenizer(source.tokenizer_path) if source.tokenizer_path is not None else None
    token = os.environ.get(TOKEN_ENV)
    registry = Registry(args.prefill, args.decode, token, config.stats_interval_s)
    prefix_index = None
    if config.redis_url and config.policy == "prefix_aware":
        prefix_index = PrefixIndex(config.redis_url, engine_config.model.model, config.prefix_index_timeout_s)
    servicer = RouterServicer(
        config, registry, tokenizer, engine_config.model.model, engine_config.scheduler.max_model_len or 0,
        engine_config.cache.block_size, prefix_index,
    )
    port = config.port if args.port is None else args.port
    # The client API has no cluster token: it is the public side (API keys come with the HTTP front).
    server, bound, _ = make_server(f"{config.host}:{port}", ["vllm_cluster.Generation"], token=None)
    pb_grpc.add_GenerationServicer_to_server(servicer, server)
    server.start()
    logging.getLogger(__name__).info("router serving on %s:%d", config.host, bound)
    announce_and_wait(server, bound, args.ready_file)
    registry.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
