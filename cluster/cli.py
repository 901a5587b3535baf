"""The `vllm-cluster` command.

  vllm-cluster up -f configs/local.yaml [--detach]      # the cluster on Ray (cluster/up.py)
  vllm-cluster up -f configs/local.yaml --chat "Hi"     # ... answer one chat message, keep serving
  vllm-cluster status | logs INSTANCE [--tail N] | down # a cluster `up` started (--name, -f)
  vllm-cluster chaos -f configs/local.yaml              # kill its processes under load; check it heals
  vllm-cluster repair -f FILE                           # place again what a lost Ray node took
  vllm-cluster scale -f FILE --prefill N --decode M     # grow or shrink the pools of a running cluster
  vllm-cluster autoscale -f FILE                        # the autoscaler beside an `up --detach` cluster
  vllm-cluster worker prefill -f FILE --index 0         # one instance without Ray (containers)
  vllm-cluster serve -f configs/local.yaml              # plain processes here, no Ray
  vllm-cluster serve -f configs/local.yaml --once "Hi"  # ... answer one chat message, then stop
  vllm-cluster chat --address 127.0.0.1:50051           # talk to a running cluster
  vllm-cluster generate "The capital of France is"      # one completion from a running cluster
  vllm-cluster generate --offline -f configs/local.yaml "Hi"  # the engine in-process, no cluster
  vllm-cluster bench serve|sweep|throughput ...          # load tests (loadtest/cli.py)

chat and generate send the API key from --api-key, else $VLLM_API_KEY. On failure they print
`error: CODE: message` (the gRPC status, see cluster/client.py) and exit non-zero.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
from pathlib import Path
from typing import Any

import yaml

from vllm_cluster.client import Client, ClientError, Completion
from vllm_cluster.cluster.cli_args import (
    SAMPLE_CHAT,
    add_autoscale_parser,
    add_chaos_parser,
    add_down_parser,
    add_repair_parser,
    add_scale_parser,
    add_status_parsers,
    add_up_parser,
    add_worker_parser,
)
from vllm_cluster.loadtest.cli import add_bench_parser
from vllm_cluster.worker.rpc import API_KEY_ENV


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.command in _CLUSTER_COMMANDS:
        return _CLUSTER_COMMANDS[args.command](args)
    if args.command == "serve":
        logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
        return _serve(args)
    if args.command == "chat":
        return _chat(args)
    if args.command == "bench":
        from vllm_cluster.loadtest.cli import bench_main

        return bench_main(args)
    if args.offline:
        return _offline(args)
    return _generate(args)


def _up(args: argparse.Namespace) -> int:
    from vllm_cluster.cluster.up import up_main

    return up_main(args)


def _down(args: argparse.Namespace) -> int:
    from vllm_cluster.cluster.down import down_main

    return down_main(args)


def _status(args: argparse.Namespace) -> int:
    from vllm_cluster.cluster.status import status_main

    return status_main(args)


def _logs(args: argparse.Namespace) -> int:
    from vllm_cluster.cluster.status import logs_main

    return logs_main(args)


def _worker(args: argparse.Namespace) -> int:
    from vllm_cluster.cluster.instance import worker_main

    return worker_main(args)


def _repair(args: argparse.Namespace) -> int:
    from vllm_cluster.cluster.repair import repair_main

    return repair_main(args)


def _scale(args: argparse.Namespace) -> int:
    from vllm_cluster.cluster.scale import scale_main

    return scale_main(args)


def _autoscale(args: argparse.Namespace) -> int:
    from vllm_cluster.cluster.autoscaler import autoscale_main

    return autoscale_main(args)


def _chaos(args: argparse.Namespace) -> int:
    from vllm_cluster.cluster.chaos import chaos_main

    return chaos_main(args)


def _health(args: argparse.Namespace) -> int:
    """For container healthchecks: 0 when the gRPC server at --address says SERVING."""
    from vllm_cluster.worker.rpc import check_health, make_channel

    healthy = check_health(make_channel(args.address), args.service, timeout_s=args.timeout_s)
    print("SERVING" if healthy else "NOT SERVING")
    return 0 if healthy else 1


_CLUSTER_COMMANDS = {
    "up": _up, "down": _down, "status": _status, "logs": _logs, "worker": _worker, "health": _health,
    "chaos": _chaos, "repair": _repair, "scale": _scale,
    "autoscale": _autoscale,
}


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="vllm-cluster", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    add_up_parser(sub)
    add_down_parser(sub)
    add_status_parsers(sub)
    add_repair_parser(sub)
    add_scale_parser(sub)
    add_autoscale_parser(sub)
    add_chaos_parser(sub)
    add_worker_parser(sub)
    p = sub.add_parser("health", help="exit 0 when a server's gRPC health says SERVING (container healthchecks)")
    p.add_argument("--address", required=True, help="host:port of a router, prefill or decode instance")
    p.add_argument("--service", default="", help="a service name (default: the server as a whole)")
    p.add_argument("--timeout-s", type=float, default=3.0)
    p = sub.add_parser("serve", help="run a local cluster (prefill, decode, router processes)")
    p.add_argument("--config", "-f", default="configs/local.yaml")
    p.add_argument("--once", metavar="MESSAGE", nargs="?", const=SAMPLE_CHAT, default=None,
                   help="send one chat message through the router, print the answer, stop")
    p.add_argument("--max-tokens", type=int, default=64)
    p = sub.add_parser("chat", help="chat with a running cluster (one message per line; /clear, /exit)")
    _client_options(p, max_tokens=256, temperature=0.7)
    p.add_argument("--system", default="", metavar="PROMPT", help="system prompt")
    p = sub.add_parser("generate", help="complete one prompt on a running cluster, streamed to stdout")
    p.add_argument("prompt")
    _client_options(p, max_tokens=64, temperature=0.0)
    p.add_argument("--chat", action="store_true", help="send the prompt as a user chat message (chat template)")
    p.add_argument("--offline", action="store_true", help="run the engine in this process instead (no cluster)")
    p.add_argument("--config", "-f", default="configs/local.yaml", help="the engine settings, with --offline")
    add_bench_parser(sub)
    return parser


def _client_options(p: argparse.ArgumentParser, max_tokens: int, temperature: float) -> None:
    p.add_argument("--address", default="127.0.0.1:50051", help="the router's gRPC address (default %(default)s)")
    p.add_argument("--api-key", default=os.environ.get(API_KEY_ENV), help=f"default: ${API_KEY_ENV}")
    p.add_argument("--max-tokens", type=int, default=max_tokens, help="per reply (default %(default)s)")
    p.add_argument("--temperature", type=float, default=temperature, help="0: greedy (default %(default)s)")


def _chat(args: argparse.Namespace) -> int:
    from vllm_cluster.cluster.chat import ChatSession, run_chat

    with Client(args.address, api_key=args.api_key) as client:
        return run_chat(ChatSession(client, args.system, args.max_tokens, args.temperature))


def _generate(args: argparse.Namespace) -> int:
    from vllm_cluster.cluster.chat import usage_line

    text, chat = (None, [{"role": "user", "content": args.prompt}]) if args.chat else (args.prompt, None)
    with Client(args.address, api_key=args.api_key) as client:
        try:
            with client.stream(text, chat=chat, max_tokens=args.max_tokens, temperature=args.temperature) as stream:
                result = Completion(stream.request_id)
                for piece in stream:
                    print(piece.text, end="", flush=True)
                    result.add(piece)
        except ClientError as e:
            print(f"error: {e}", file=sys.stderr)
            return 1
        except KeyboardInterrupt:  # leaving the `with` cancelled the request
            print("\n[cancelled]", file=sys.stderr)
            return 130
    print()
    print(usage_line(result), file=sys.stderr)
    return 0


def _offline(args: argparse.Namespace) -> int:
    from vllm_cluster.engine import LLM, EngineConfig, EngineError, SamplingParams

    try:
        llm = LLM.from_config(EngineConfig.from_yaml(args.config))
        params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens)
        if args.chat:
            out = llm.chat([{"role": "user", "content": args.prompt}], params, use_tqdm=False)
        else:
            out = llm.generate(args.prompt, params, use_tqdm=False)
    except EngineError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    completion = out[0].outputs[0]
    print(completion.text)
    print(f"[{len(completion.token_ids)} tokens, finish_reason={completion.finish_reason}]", file=sys.stderr)
    return 0


def _serve(args: argparse.Namespace) -> int:
    from vllm_cluster.cluster.local import LocalCluster

    cluster = LocalCluster.from_yaml(args.config)
    router = _router_section(args.config)
    if args.once is None:
        cluster.router_port = int(router.get("port", 50051))
    print(f"starting {cluster.config.num_prefill} prefill + {cluster.config.num_decode} decode instances "
          f"({cluster.config.transport}); logs in {cluster.log_dir}", flush=True)
    with cluster:
        print(f"router listening on {cluster.router_address}", flush=True)
        if args.once is None:
            done = threading.Event()
            for sig in (signal.SIGTERM, signal.SIGINT):
                signal.signal(sig, lambda *_: done.set())
            done.wait()
            return 0
        api_key = cluster.api_key or router.get("api_key") or os.environ.get(API_KEY_ENV)
        with Client(cluster.router_address, api_key=api_key) as client:
            print(f">>> {args.once}")
            result = Completion("")
            for piece in client.stream(
                chat=[{"role": "user", "content": args.once}], max_tokens=args.max_tokens, temperature=0
            ):
                print(piece.text, end="", flush=True)
                result.add(piece)
        from vllm_cluster.cluster.up import timings_line

        print("\n" + timings_line(result))
    return 0


def _router_section(config_path: str) -> dict[str, Any]:
    # Read straight from the YAML: the router validates its own section when it starts.
    data = yaml.safe_load(Path(config_path).read_text()) or {}
    return data.get("router") or {}


if __name__ == "__main__":
    sys.exit(main())
