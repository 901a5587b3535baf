"""The `vllm-cluster` command.

  vllm-cluster serve -f configs/local.yaml            # prefill + decode + router processes here
  vllm-cluster serve -f configs/local.yaml --once "Hi"  # ... answer one chat request, then stop
  vllm-cluster chat-once "Hi"                         # the engine in-process, no cluster
  vllm-cluster generate "The capital of France is"    # the engine in-process, plain prompt
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import threading
from pathlib import Path

import yaml

from engine import LLM, EngineConfig, EngineError, SamplingParams

_SAMPLE_CHAT = "What is the capital of France? Answer in one sentence."


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="vllm-cluster", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for name, text in (("chat-once", "answer one chat message in-process"), ("generate", "complete one prompt in-process")):
        p = sub.add_parser(name, help=text)
        p.add_argument("prompt", nargs="?", default=_SAMPLE_CHAT)
        p.add_argument("--config", "-f", default="configs/local.yaml")
        p.add_argument("--max-tokens", type=int, default=64)
        p.add_argument("--temperature", type=float, default=0.0)
    p = sub.add_parser("serve", help="run a local cluster (prefill, decode, router processes)")
    p.add_argument("--config", "-f", default="configs/local.yaml")
    p.add_argument("--once", metavar="MESSAGE", nargs="?", const=_SAMPLE_CHAT, default=None,
                   help="send one chat message through the router, print the answer, stop")
    p.add_argument("--max-tokens", type=int, default=64)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    try:
        if args.command == "serve":
            return _serve(args)
        return _in_process(args)
    except EngineError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


def _in_process(args: argparse.Namespace) -> int:
    llm = LLM.from_config(EngineConfig.from_yaml(args.config))
    params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens)
    if args.command == "chat-once":
        out = llm.chat([{"role": "user", "content": args.prompt}], params, use_tqdm=False)
    else:
        out = llm.generate(args.prompt, params, use_tqdm=False)
    completion = out[0].outputs[0]
    print(f">>> {args.prompt}")
    print(completion.text)
    print(f"[{len(completion.token_ids)} tokens, finish_reason={completion.finish_reason}]")
    return 0


def _serve(args: argparse.Namespace) -> int:
    from cluster.client import Client
    from cluster.local import LocalCluster

    cluster = LocalCluster.from_yaml(args.config)
    if args.once is None:
        cluster.router_port = _router_port(args.config)
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
        client = Client(cluster.router_address)
        print(f">>> {args.once}")
        result = None
        for piece in client.stream(chat=[{"role": "user", "content": args.once}], max_tokens=args.max_tokens, temperature=0):
            print(piece.text, end="", flush=True)
            if piece.finish_reason:
                result = piece
        client.close()
        assert result is not None
        t = result.timings
        print(f"\n[{result.usage.completion_tokens} tokens, finish_reason={result.finish_reason}; "
              f"ttft {t.ttft_s * 1e3:.0f} ms: router {t.router_s * 1e3:.0f}, prefill queue "
              f"{t.prefill_queue_s * 1e3:.0f}, prefill compute {t.prefill_compute_s * 1e3:.0f}, "
              f"transfer {t.transfer_s * 1e3:.0f} ({t.num_kv_blocks_sent} blocks/layer), decode queue "
              f"{t.decode_queue_s * 1e3:.0f}; total {t.total_s * 1e3:.0f} ms]")
    return 0


def _router_port(config_path: str) -> int:
    # Read straight from the YAML: the router validates its own section when it starts.
    data = yaml.safe_load(Path(config_path).read_text()) or {}
    return int((data.get("router") or {}).get("port", 50051))


if __name__ == "__main__":
    sys.exit(main())
