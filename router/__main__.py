"""python -m router --config configs/local.yaml --prefill 127.0.0.1:50100 --decode 127.0.0.1:50200

Serves the client Generation API, routing to the given prefill and decode instances."""

from __future__ import annotations

import argparse
import logging
import os
import sys
import threading
from pathlib import Path

import yaml
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from vllm_cluster.engine.config import EngineConfig, EngineRole
from vllm_cluster.engine.errors import ConfigError
from vllm_cluster.engine.loader import resolve
from vllm_cluster.engine.models.config import ModelArchConfig
from vllm_cluster.engine.resolve import max_model_len
from vllm_cluster.engine.tokenizer import chat_template_text, load_tokenizer
from vllm_cluster.kv_index import PrefixIndex
from vllm_cluster.proto import cluster_pb2_grpc as pb_grpc
from vllm_cluster.router.admin import SERVICE_NAME as ADMIN_SERVICE
from vllm_cluster.router.admin import RouterAdminServicer
from vllm_cluster.router.openai.app import HttpServer, build_app
from vllm_cluster.router.openai.local_backend import LocalBackend
from vllm_cluster.router.openai.serving import OpenAIServing
from vllm_cluster.router.registry import Registry
from vllm_cluster.router.servicer import RouterServicer
from vllm_cluster.worker.router_config import RouterConfig
from vllm_cluster.worker.rpc import API_KEY_ENV, REDIS_URL_ENV, TOKEN_ENV, announce_and_wait, make_server


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="router", description=__doc__.splitlines()[0])
    parser.add_argument("--config", "-f", required=True, help="cluster YAML (engine: and router: sections)")
    parser.add_argument("--prefill", action="append", default=[], help="host:port of a prefill instance")
    parser.add_argument("--decode", action="append", default=[], help="host:port of a decode instance")
    parser.add_argument("--port", type=int, default=None, help="overrides router.port; 0 picks one")
    parser.add_argument("--http-port", type=int, default=None, help="overrides router.http_port; 0 picks one")
    parser.add_argument("--redis-url", default=os.environ.get(REDIS_URL_ENV),
                        help=f"overrides router.redis_url (default ${REDIS_URL_ENV}: a password stays out of `ps`)")
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
    if config.chat_template:
        if tokenizer is None:
            raise ConfigError(f"router.chat_template: {engine_config.model.model} has no tokenizer to use it with")
        tokenizer.chat_template = chat_template_text(config.chat_template, "router.chat_template")
    token = os.environ.get(TOKEN_ENV)
    registry = Registry(args.prefill, args.decode, token, config.stats_interval_s)
    prefix_index = None
    if config.redis_url and (config.policy == "prefix_aware" or config.kv_pull):
        prefix_index = PrefixIndex(config.redis_url, engine_config.model.model, config.prefix_index_timeout_s)
    context_len = max_model_len(engine_config, ModelArchConfig.from_hf_dict(source.hf_config).max_position_embeddings)
    servicer = RouterServicer(
        config, registry, tokenizer, engine_config.model.model, context_len, engine_config.cache.block_size,
        prefix_index,
    )
    port = config.port if args.port is None else args.port
    # The client API is the public side: no cluster token, the API key when one is configured.
    api_key = config.api_key or os.environ.get(API_KEY_ENV, "")
    # The admin service (pools that grow and shrink) takes the cluster token instead.
    server, bound, _ = make_server(f"{config.host}:{port}", ["vllm_cluster.Generation", ADMIN_SERVICE],
                                   token=token, api_key=api_key or None, tls=config.tls,
                                   token_services=[ADMIN_SERVICE])
    pb_grpc.add_GenerationServicer_to_server(servicer, server)
    pb_grpc.add_RouterAdminServicer_to_server(RouterAdminServicer(registry), server)
    server.start()
    draining = threading.Event()
    serving = OpenAIServing(
        LocalBackend(servicer, draining), tokenizer, engine_config.model.model, context_len,
        config.reasoning_parser, config.tool_call_parser, config.enable_auto_tool_choice,
    )
    http = _start_http(config, args, serving, servicer, registry, api_key, draining)
    log = logging.getLogger(__name__)
    log.info("router serving gRPC on %s:%d, OpenAI HTTP on http://%s:%d", config.host, bound, config.host, http.port)
    # SIGTERM: /health says 503 and new calls are refused at once; those in flight finish.
    announce_and_wait(server, bound, args.ready_file, config.drain_grace_s, draining.set, http_port=http.port)
    http.stop()
    registry.close()
    return 0


def _start_http(
    config: RouterConfig, args: argparse.Namespace, serving: OpenAIServing, servicer: RouterServicer,
    registry: Registry, api_key: str, draining: threading.Event,
) -> HttpServer:
    """The OpenAI front; `serving` calls this router's servicer in-process."""

    def metrics() -> tuple[bytes, str]:
        return generate_latest(servicer.metrics.registry), CONTENT_TYPE_LATEST

    def is_healthy() -> bool:
        return not draining.is_set() and any(i.healthy for i in registry.of_role(EngineRole.DECODE))

    app = build_app(serving, api_key, config.max_request_bytes, is_healthy, metrics, config.http_body_timeout_s)
    port = config.http_port if args.http_port is None else args.http_port
    return HttpServer(app, config.host, port, config.tls, config.http_header_timeout_s).start()


if __name__ == "__main__":
    sys.exit(main())
