"""What serving costs the host per generated token: CPU time of the router and of the decode
instance per output token, against the engine's own CPU time per token offline, same
engine settings, same run (CPU).

    .venv/bin/python benchmarks/bench_served_host_cost.py [--num-requests 256 --stream-intervals 1,4]

On a GPU the engine's compute leaves the host, and what stays is the per-token host work:
scheduling, detokenizing, streaming. A tiny model with random weights (SmolLM2's
architecture and tokenizer cut to one narrow layer) makes the engine's own step cheap on
CPU too, so the same host work shows here. Served: a local cluster, colocated (decode
computes the prompts), --num-requests streams at once from client processes of their own;
CPU seconds are read from /proc for the router and the decode process over the measured
batch, once per --stream-intervals value (engine `stream_interval`: tokens per message).
Offline: `LLM.generate` on the same prompts in this process (its CPU time).
"""

from __future__ import annotations

import argparse
import http.client
import json
import multiprocessing
import os
import random
import tempfile
import time
import urllib.parse
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import yaml

from vllm_cluster.client import Client
from vllm_cluster.cluster.local import LocalCluster
from vllm_cluster.engine.loader import bundled_model_path

TINY = {"num_hidden_layers": 1, "hidden_size": 64, "intermediate_size": 128,
        "num_attention_heads": 2, "num_key_value_heads": 1}


def engine_section(args: argparse.Namespace, stream_interval: int = 1) -> dict:
    return {
        "stream_interval": stream_interval,
        "model": {"model": str(bundled_model_path()), "load_format": "dummy", "dtype": "float32",
                  "hf_overrides": TINY},
        "cache": {"block_size": 16, "num_blocks": 8192, "enable_prefix_caching": False},
        "scheduler": {"max_num_seqs": args.num_requests, "max_num_batched_tokens": 4096,
                      "max_model_len": args.input_len + args.output_len + 16},
        "device": "cpu",
        "num_threads": 1,
    }


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


def client_share(address: str, prompts: list[list[int]], output_len: int) -> int:
    """One client process: its prompts all at once; returns the tokens it received."""
    client = Client(address)
    with ThreadPoolExecutor(len(prompts)) as pool:
        done = list(pool.map(lambda p: client.generate(
            token_ids=p, max_tokens=output_len, temperature=0, ignore_eos=True), prompts))
    client.close()
    return sum(len(c.token_ids) for c in done)


def http_share(address: str, prompts: list[list[int]], output_len: int) -> int:
    """One client process over the OpenAI HTTP API (streamed /v1/completions); returns the
    tokens its answers' usage reports."""
    url = urllib.parse.urlsplit(address)

    def one(prompt: list[int]) -> int:
        conn = http.client.HTTPConnection(url.hostname, url.port, timeout=600)
        body = {"prompt": prompt, "max_tokens": output_len, "temperature": 0, "ignore_eos": True,
                "stream": True, "stream_options": {"include_usage": True}}
        conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
        response = conn.getresponse()
        assert response.status == 200, response.read()
        tokens = 0
        for line in response:
            if line.startswith(b"data: {"):
                usage = json.loads(line[6:]).get("usage")
                tokens = usage["completion_tokens"] if usage else tokens
        conn.close()
        return tokens

    with ThreadPoolExecutor(len(prompts)) as pool:
        return sum(pool.map(one, prompts))


def served(args: argparse.Namespace, prompts: list[list[int]], stream_interval: int) -> dict:
    config = {"engine": engine_section(args, stream_interval), "cluster": {"num_prefill": 0, "num_decode": 1},
              "router": {"min_prefill_tokens": 1 << 30}}
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "bench.yaml"
        path.write_text(yaml.safe_dump(config))
        with LocalCluster.from_yaml(path) as cluster:
            share, address = ((http_share, cluster.http_address) if args.api == "http"
                              else (client_share, cluster.router_address))
            share(address, prompts[:4], 4)  # warm-up
            pids = {p.name: p.popen.pid for p in cluster.processes}
            before = {name: cpu_seconds(pid) for name, pid in pids.items()}
            shares = [prompts[i:: args.client_processes] for i in range(args.client_processes)]
            start = time.perf_counter()
            with multiprocessing.get_context("spawn").Pool(args.client_processes) as pool:
                tokens = sum(pool.starmap(share, [(address, s, args.output_len) for s in shares]))
            elapsed = time.perf_counter() - start
            after = {name: cpu_seconds(pid) for name, pid in pids.items()}
    used = {name: after[name] - before[name] for name in pids}
    return {"tokens": tokens, "elapsed": elapsed, "router_cpu": used["router"], "decode_cpu": used["decode-0"]}


def offline(args: argparse.Namespace, prompts: list[list[int]]) -> dict:
    from vllm_cluster.engine import LLM, SamplingParams
    from vllm_cluster.engine.config import EngineConfig

    config = EngineConfig.from_dict(engine_section(args))
    llm = LLM.from_config(config)
    params = SamplingParams(max_tokens=args.output_len, temperature=0, ignore_eos=True)
    llm.generate(prompts[:4], params, use_tqdm=False)
    cpu, start = time.process_time(), time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu
    return {"tokens": sum(len(o.outputs[0].token_ids) for o in outputs), "elapsed": elapsed, "cpu": cpu}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-requests", type=int, default=256)
    parser.add_argument("--input-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--client-processes", type=int, default=2)
    parser.add_argument("--stream-intervals", default="1,4")
    parser.add_argument("--api", choices=["grpc", "http"], default="grpc",
                        help="the clients' API: the router's gRPC Generate, or its OpenAI HTTP front")
    args = parser.parse_args()
    rng = random.Random(0)
    prompts = [[rng.randrange(100, 30000) for _ in range(args.input_len)] for _ in range(args.num_requests)]
    off = offline(args, prompts)
    runs = {interval: served(args, prompts, interval) for interval in map(int, args.stream_intervals.split(","))}
    us = lambda seconds, tokens: f"{seconds / tokens * 1e6:.0f}"  # noqa: E731
    print(f"\n{args.num_requests} streams x ({args.input_len} in / {args.output_len} out), colocated, "
          f"{args.client_processes} client processes; CPU us per output token\n")
    print("| path | output tok/s | engine process | router |")
    print("|---|---|---|---|")
    print(f"| offline LLM.generate (baseline) | {off['tokens'] / off['elapsed']:.0f} | "
          f"{us(off['cpu'], off['tokens'])} | - |")
    for interval, srv in runs.items():
        print(f"| served ({args.api}), stream_interval {interval} | {srv['tokens'] / srv['elapsed']:.0f} | "
              f"{us(srv['decode_cpu'], srv['tokens'])} | {us(srv['router_cpu'], srv['tokens'])} |")


if __name__ == "__main__":
    main()
