"""The `vllm-cluster` command.

  vllm-cluster serve -f configs/local.yaml              # prefill + decode + router processes here
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

from cluster.client import Client, ClientError, Completion
from loadtest.cli import add_bench_parser
from proto.rpc import API_KEY_ENV

_SAMPLE_CHAT = "What is the capital of France? Answer in one sentence."


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.command == "serve":
        logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
        return _serve(args)
    if args.command == "chat":
        return _chat(args)
    if args.command == "bench":
        from loadtest.cli import bench_main

        return bench_main(args)
    if args.offline:
        return _offline(args)
    return _generate(args)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="vllm-cluster", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("serve", help="run a local cluster (prefill, decode, router processes)")
    p.add_argument("--config", "-f", default="configs/local.yaml")
    p.add_argument("--once", metavar="MESSAGE", nargs="?", const=_SAMPLE_CHAT, default=None,
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
    from cluster.chat import ChatSession, run_chat

    with Client(args.address, api_key=args.api_key) as client:
        return run_chat(ChatSession(client, args.system, args.max_tokens, args.temperature))


def _generate(args: argparse.Namespace) -> int:
    from cluster.chat import usage_line

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
    from engine import LLM, EngineConfig, EngineError, SamplingParams

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
    from cluster.local import LocalCluster

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
            for piece in client.stream(chat=[{"role": "user", "content": args.once}], max_tokens=args.max_tokens, temperature=0):
                print(piece.text, end="", flush=True)
                result.add(piece)
        assert result.usage is not None and result.timings is not None
        t = result.timings
        print(f"\n[{result.usage.completion_tokens} tokens, finish_reason={result.finish_reason}; "
              f"ttft {t.ttft_s * 1e3:.0f} ms: router {t.router_s * 1e3:.0f}, prefill queue "
              f"{t.prefill_queue_s * 1e3:.0f}, prefill compute {t.prefill_compute_s * 1e3:.0f}, "
              f"transfer {t.transfer_s * 1e3:.0f} ({t.num_kv_blocks_sent} blocks/layer), decode queue "
              f"{t.decode_queue_s * 1e3:.0f}; total {t.total_s * 1e3:.0f} ms]")
    return 0


def _router_section(config_path: str) -> dict[str, Any]:
    # Read straight from the YAML: the router validates its own section when it starts.
    data = yaml.safe_load(Path(config_path).read_text()) or {}
    return data.get("router") or {}


if __name__ == "__main__":
    sys.exit(main())
