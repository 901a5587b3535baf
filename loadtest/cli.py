"""`vllm-cluster bench serve | throughput | sweep`, with `vllm bench`'s flag names.

  vllm-cluster bench serve --backend grpc --address 127.0.0.1:50051 \\
      --dataset-name random --random-input-len 512 --random-output-len 128 \\
      --num-prompts 200 --request-rate 8 --goodput ttft:500 tpot:50 --save-result --plot
  vllm-cluster bench serve --backend openai-chat --base-url http://127.0.0.1:8000 ...
  vllm-cluster bench sweep --request-rates 1,2,4,8 ...      # serve at each rate, one plot
  vllm-cluster bench throughput --model smollm2-135m-instruct --dataset-name random ...
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import sys
import time
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the rest loads when a bench runs: `vllm-cluster --help` stays fast
    from vllm_cluster.loadtest.datasets import SampleRequest
    from vllm_cluster.loadtest.runner import RunOutcome, Schedule
    from vllm_cluster.loadtest.targets import Target, TargetSpec

DATASETS = ("random", "prefix_repetition", "sharegpt", "mooncake")
BACKENDS = ("grpc", "openai", "openai-chat")
CLIENT_BUSY_WARNING = 0.9  # of the CPU time the client processes could have had


def add_bench_parser(sub: Any) -> None:
    bench = sub.add_parser("bench", help="load-test a running cluster or any OpenAI server; offline throughput")
    kinds = bench.add_subparsers(dest="bench_command", required=True)
    serve = kinds.add_parser("serve", help="requests at a rate against a server; latency and throughput")
    _target_args(serve)
    _dataset_args(serve)
    _schedule_args(serve)
    serve.add_argument("--request-rate", type=float, default=math.inf, help="requests/s (default inf: all at once)")
    _result_args(serve)
    sweep = kinds.add_parser("sweep", help="`serve` at several request rates or concurrencies; one plot")
    _target_args(sweep)
    _dataset_args(sweep)
    _schedule_args(sweep)
    sweep.add_argument("--request-rates", default="", help="comma-separated, e.g. 1,2,4,8")
    sweep.add_argument("--concurrencies", default="", help="comma-separated max concurrencies (rate inf)")
    _result_args(sweep)
    throughput = kinds.add_parser("throughput", help="the offline LLM API on a dataset, tokens/s")
    throughput.add_argument("--config", "-f", default=None, help="YAML with an engine: section")
    throughput.add_argument("--model", default="smollm2-135m-instruct")
    throughput.add_argument("--load-format", default=None, help="`dummy` for random weights")
    throughput.add_argument("--max-num-seqs", type=int, default=None)
    throughput.add_argument("--max-num-batched-tokens", type=int, default=None)
    throughput.add_argument("--max-model-len", type=int, default=None)
    throughput.add_argument("--output-json", default=None)
    _dataset_args(throughput)
    throughput.add_argument("--seed", type=int, default=0)
    throughput.add_argument("--num-warmups", type=int, default=0,
                            help="the first N requests also run once, untimed, before the timed run (the kernels "
                            "a fresh process compiles on first use)")


def _target_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--backend", choices=BACKENDS, default="grpc",
                   help="grpc: our client API; openai / openai-chat: any OpenAI-compatible server")
    p.add_argument("--address", default="127.0.0.1:50051", help="gRPC router address (backend grpc)")
    p.add_argument("--base-url", default="http://127.0.0.1:8000", help="HTTP server (backends openai*)")
    p.add_argument("--model", default="", help="default: the server's first model")
    p.add_argument("--api-key", default=os.environ.get("VLLM_API_KEY", ""))
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--no-ignore-eos", action="store_true", help="let requests stop at EOS (default: ignore it)")
    p.add_argument("--request-timeout", type=float, default=600.0)


def _dataset_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dataset-name", choices=DATASETS, default="random")
    p.add_argument("--dataset-path", default=None, help="sharegpt: JSON file; mooncake: JSONL trace")
    p.add_argument("--num-prompts", type=int, default=100)
    p.add_argument("--tokenizer", default=None, help="HF directory or .gguf (default: the bundled SmolLM2's)")
    p.add_argument("--random-input-len", type=int, default=256)
    p.add_argument("--random-output-len", type=int, default=64)
    p.add_argument("--random-range-ratio", type=float, default=0.0)
    p.add_argument("--random-prefix-len", type=int, default=0)
    p.add_argument("--prefix-repetition-num-prefixes", type=int, default=8)
    p.add_argument("--prefix-repetition-prefix-len", type=int, default=256)
    p.add_argument("--prefix-repetition-suffix-len", type=int, default=64)
    p.add_argument("--prefix-repetition-output-len", type=int, default=64)
    p.add_argument("--sharegpt-output-len", type=int, default=None)
    p.add_argument("--mooncake-block-size", type=int, default=512)


def _schedule_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--burstiness", type=float, default=1.0, help="gamma shape: 1 Poisson, <1 burstier")
    p.add_argument("--max-concurrency", type=int, default=None)
    p.add_argument("--use-trace-timestamps", action="store_true", help="mooncake: send at the trace's times")
    p.add_argument("--num-warmups", type=int, default=0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--disable-tqdm", action="store_true")
    p.add_argument("--num-client-processes", type=int, default=1,
                   help="send from N processes, each every N-th request, when one process cannot keep up")


def _result_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--percentile-metrics", default="ttft,tpot,itl,e2el")
    p.add_argument("--metric-percentiles", default="50,90,99")
    p.add_argument("--goodput", nargs="+", default=None, metavar="METRIC:MS", help="e.g. ttft:500 tpot:50 e2el:5000")
    p.add_argument("--save-result", action="store_true")
    p.add_argument("--result-dir", default=".")
    p.add_argument("--result-filename", default=None)
    p.add_argument("--plot", action="store_true", help="PNG plots next to the result JSON")


def bench_main(args: argparse.Namespace) -> int:
    try:
        return _bench(args)
    except KeyboardInterrupt:
        print("interrupted before the run started", file=sys.stderr)
        return 130


def _bench(args: argparse.Namespace) -> int:
    if args.bench_command == "throughput":
        return _throughput(args)
    if args.num_client_processes < 1:
        raise SystemExit(f"error: --num-client-processes must be >= 1, got {args.num_client_processes}")
    if args.bench_command == "serve":
        _check_shared_concurrency([args.max_concurrency], args.num_client_processes)
    from vllm_cluster.loadtest.datasets import DatasetError

    try:
        requests = load_requests(args)
    except (DatasetError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.backend == "openai-chat":  # chat messages are text: decode token-id prompts
        requests = [_as_text(r, args) for r in requests]
    if args.bench_command == "serve":
        summary, _ = _serve_once(args, requests, args.request_rate, args.max_concurrency, args.result_filename)
        return 1 if summary.get("interrupted") else 0
    return _sweep(args, requests)


def load_requests(args: argparse.Namespace) -> list[SampleRequest]:
    from vllm_cluster.engine.loader import bundled_model_path
    from vllm_cluster.engine.tokenizer import load_tokenizer
    from vllm_cluster.loadtest.datasets import (
        mooncake_dataset,
        prefix_repetition_dataset,
        random_dataset,
        sharegpt_dataset,
    )

    tokenizer = load_tokenizer(Path(args.tokenizer) if args.tokenizer else bundled_model_path())
    name, n, seed = args.dataset_name, args.num_prompts, args.seed
    if name in ("sharegpt", "mooncake") and not args.dataset_path:
        raise SystemExit(f"error: --dataset-name {name} needs --dataset-path")
    if name == "random":
        return random_dataset(tokenizer, n, args.random_input_len, args.random_output_len,
                              args.random_range_ratio, args.random_prefix_len, seed)
    if name == "prefix_repetition":
        return prefix_repetition_dataset(tokenizer, n, args.prefix_repetition_num_prefixes,
                                         args.prefix_repetition_prefix_len, args.prefix_repetition_suffix_len,
                                         args.prefix_repetition_output_len, seed)
    if name == "sharegpt":
        return sharegpt_dataset(args.dataset_path, tokenizer, n, seed, args.sharegpt_output_len)
    return mooncake_dataset(args.dataset_path, tokenizer, n, args.mooncake_block_size, seed)


def _as_text(request: SampleRequest, args: argparse.Namespace) -> SampleRequest:
    if isinstance(request.prompt, str):
        return request
    from dataclasses import replace

    return replace(request, prompt=_tokenizer(args).decode(request.prompt))


def _tokenizer(args: argparse.Namespace) -> Any:
    from vllm_cluster.engine.loader import bundled_model_path
    from vllm_cluster.engine.tokenizer import load_tokenizer

    if not hasattr(args, "_tokenizer"):
        args._tokenizer = load_tokenizer(Path(args.tokenizer) if args.tokenizer else bundled_model_path())
    return args._tokenizer


def target_spec(args: argparse.Namespace, model: str) -> TargetSpec:
    from vllm_cluster.loadtest.targets import TargetSpec

    sampling = {"temperature": args.temperature, "ignore_eos": not args.no_ignore_eos}
    address = args.address if args.backend == "grpc" else args.base_url
    return TargetSpec(args.backend, address, model, args.api_key, args.request_timeout, sampling)


def make_target(args: argparse.Namespace, model: str) -> Target:
    return target_spec(args, model).build()


def _run(args: argparse.Namespace, model: str, requests: list[SampleRequest], schedule: Schedule) -> RunOutcome:
    from vllm_cluster.loadtest.runner import run
    from vllm_cluster.loadtest.shards import ClientProcessError, run_sharded

    if args.num_client_processes > 1:
        try:
            return run_sharded(target_spec(args, model), requests, schedule, args.num_client_processes,
                               on_start=lambda n: print(f"{n} client processes started", flush=True))
        except ClientProcessError as e:
            raise SystemExit(f"error: {e}") from None
    return asyncio.run(run(make_target(args, model), requests, schedule, progress=not args.disable_tqdm))


def _serve_once(
    args: argparse.Namespace, requests: list[SampleRequest], rate: float, max_concurrency: int | None,
    filename: str | None,
) -> tuple[dict[str, Any], RunOutcome]:
    from vllm_cluster.loadtest.metrics import format_table, parse_goodput, summarize
    from vllm_cluster.loadtest.plots import plot_run
    from vllm_cluster.loadtest.runner import Schedule

    model = args.model or _server_model(args)
    schedule = Schedule(rate, args.burstiness, max_concurrency, args.use_trace_timestamps, args.num_warmups, args.seed)
    where = args.address if args.backend == "grpc" else args.base_url
    print(
        f"sending {len(requests)} requests to {where} ({args.backend}, {model}) "
        f"at {_rate_tag(rate, max_concurrency)}",
        flush=True,
    )
    outcome = _run(args, model, requests, schedule)
    percentiles = [float(p) for p in args.metric_percentiles.split(",") if p]
    goodput = parse_goodput(args.goodput) if args.goodput else None
    summary = summarize(outcome.results, outcome.duration_s, percentiles, goodput)
    summary.update(
        date=datetime.now().strftime("%Y%m%d-%H%M%S"), backend=args.backend, model_id=model,
        dataset_name=args.dataset_name, request_rate=rate if math.isfinite(rate) else "inf",
        burstiness=args.burstiness, max_concurrency=max_concurrency, interrupted=outcome.interrupted,
        num_client_processes=args.num_client_processes, client_cpu_s=outcome.client_cpu_s,
    )
    metrics = set(args.percentile_metrics.split(","))
    print(format_table({k: v for k, v in summary.items()
                        if not k.endswith("_ms") or any(f"_{m}_ms" in k for m in metrics)}))
    if outcome.interrupted:
        print(f"interrupted: {len(outcome.results)} of {len(requests)} requests measured")
    busy = outcome.client_cpu_s / (outcome.duration_s * args.num_client_processes)
    if busy > CLIENT_BUSY_WARNING:
        print(f"note: the client processes were busy {busy:.0%} of the run, so the client may have been the "
              f"bottleneck; try --num-client-processes {args.num_client_processes + 1} (one per free core)")
    if args.save_result or args.plot:
        stem = filename or f"{args.backend}-{_rate_tag(rate, max_concurrency)}-{summary['date']}.json"
        path = Path(args.result_dir) / stem
        path.parent.mkdir(parents=True, exist_ok=True)
        if args.save_result:
            path.write_text(json.dumps(summary, indent=2))
            print(f"result: {path}")
        if args.plot:
            for png in plot_run(outcome.results, path.parent, path.stem):
                print(f"plot: {png}")
    return summary, outcome


def _sweep(args: argparse.Namespace, requests: list[SampleRequest]) -> int:
    from vllm_cluster.loadtest.plots import plot_sweep

    rates = [float(r) for r in args.request_rates.split(",") if r]
    concurrencies = [int(c) for c in args.concurrencies.split(",") if c]
    if bool(rates) == bool(concurrencies):
        raise SystemExit("error: give exactly one of --request-rates and --concurrencies")
    _check_shared_concurrency(list(concurrencies), args.num_client_processes)
    points: list[tuple[float, int | None]] = [(r, None) for r in rates] or [(math.inf, c) for c in concurrencies]
    rows = []
    for rate, concurrency in points:
        print(f"--- {_rate_tag(rate, concurrency)}")
        name = f"sweep-{_rate_tag(rate, concurrency)}.json"
        summary, _ = _serve_once(args, requests, rate, concurrency, name)
        rows.append(summary)
        if summary.get("interrupted"):
            break
    out = Path(args.result_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "sweep.json").write_text(json.dumps(rows, indent=2))
    png = plot_sweep(rows, out / "sweep.png")
    print(
        f"\n{'point':>14} {'req/s':>8} {'out tok/s':>10} "
        f"{'p50 ttft':>9} {'p99 ttft':>9} {'p50 itl':>8} {'p99 itl':>8}"
    )
    for (rate, concurrency), row in zip(points, rows, strict=False):
        print(
            f"{_rate_tag(rate, concurrency):>14} {row['request_throughput']:8.2f} {row['output_throughput']:10.1f} "
            f"{row['median_ttft_ms']:9.1f} {row['p99_ttft_ms']:9.1f} "
            f"{row['median_itl_ms']:8.1f} {row['p99_itl_ms']:8.1f}"
        )
    print(f"sweep: {out / 'sweep.json'}, plot: {png}")
    return 0


def _throughput(args: argparse.Namespace) -> int:
    from vllm_cluster.engine import LLM, EngineConfig, SamplingParams

    if args.config:
        llm = LLM.from_config(EngineConfig.from_yaml(args.config))
    else:
        options = {k: v for k, v in (("load_format", args.load_format), ("max_num_seqs", args.max_num_seqs),
                                     ("max_num_batched_tokens", args.max_num_batched_tokens),
                                     ("max_model_len", args.max_model_len)) if v is not None}
        llm = LLM(args.model, **options)
    if args.tokenizer is None and llm.core.source.tokenizer_path is not None:
        args.tokenizer = str(llm.core.source.tokenizer_path)
    requests = load_requests(args)
    prompts = [r.prompt for r in requests]
    params = [SamplingParams(temperature=0, max_tokens=r.output_len, ignore_eos=True) for r in requests]
    if args.num_warmups > 0:
        llm.generate(prompts[: args.num_warmups], params[: args.num_warmups], use_tqdm=False)
    start = time.perf_counter()
    outputs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - start
    num_out = sum(len(o.outputs[0].token_ids) for o in outputs)
    num_in = sum(len(o.prompt_token_ids) for o in outputs)
    result = {"elapsed_time": elapsed, "num_requests": len(requests), "total_num_tokens": num_in + num_out,
              "requests_per_second": len(requests) / elapsed, "tokens_per_second": (num_in + num_out) / elapsed,
              "output_tokens_per_second": num_out / elapsed}
    print(f"Throughput: {result['requests_per_second']:.2f} requests/s, {result['tokens_per_second']:.2f} total "
          f"tokens/s, {result['output_tokens_per_second']:.2f} output tokens/s")
    if args.output_json:
        Path(args.output_json).write_text(json.dumps(result, indent=2))
    return 0


def _server_model(args: argparse.Namespace) -> str:
    """The served model, asked of the server (what `vllm bench serve` needs --model for)."""
    if args.backend == "grpc":
        from vllm_cluster.client import Client

        with Client(args.address, api_key=args.api_key or None) as client:
            return client.list_models()[0].id
    import urllib.request

    request = urllib.request.Request(args.base_url.rstrip("/").removesuffix("/v1") + "/v1/models")
    if args.api_key:
        request.add_header("Authorization", f"Bearer {args.api_key}")
    with urllib.request.urlopen(request, timeout=30) as response:
        return str(json.loads(response.read())["data"][0]["id"])


def _check_shared_concurrency(concurrencies: list[int | None], num_processes: int) -> None:
    if any(c is not None and c < num_processes for c in concurrencies):
        raise SystemExit(f"error: a max concurrency is shared by the {num_processes} client processes: "
                         "give at least one per process, or fewer --num-client-processes")


def _rate_tag(rate: float, concurrency: int | None) -> str:
    if concurrency is not None:
        return f"concurrency{concurrency}"
    return "rate-inf" if not math.isfinite(rate) else f"rate{rate:g}"
