"""The `vllm-cluster` command.

For now it runs the engine in-process: `chat-once` answers one chat message and
`generate` completes one prompt. `up/down/status` arrive with the cluster issue.
"""

from __future__ import annotations

import argparse
import logging
import sys

from engine import LLM, EngineConfig, EngineError, SamplingParams

_SAMPLE_CHAT = "What is the capital of France? Answer in one sentence."


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="vllm-cluster", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for name, text in (("chat-once", "answer one chat message"), ("generate", "complete one prompt")):
        p = sub.add_parser(name, help=text)
        p.add_argument("prompt", nargs="?", default=_SAMPLE_CHAT)
        p.add_argument("--config", "-f", default="configs/local.yaml")
        p.add_argument("--max-tokens", type=int, default=64)
        p.add_argument("--temperature", type=float, default=0.0)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    try:
        llm = LLM.from_config(EngineConfig.from_yaml(args.config))
        params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens)
        if args.command == "chat-once":
            out = llm.chat([{"role": "user", "content": args.prompt}], params, use_tqdm=False)
        else:
            out = llm.generate(args.prompt, params, use_tqdm=False)
    except EngineError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    completion = out[0].outputs[0]
    print(f">>> {args.prompt}")
    print(completion.text)
    print(f"[{len(completion.token_ids)} tokens, finish_reason={completion.finish_reason}]")
    return 0


if __name__ == "__main__":
    sys.exit(main())
