"""Served against offline on one GPU: `vllm-cluster bench serve` against a local cluster
beside `vllm-cluster bench throughput` (offline `LLM.generate`), same engine settings, same
prompts, same run.

    python benchmarks/bench_served_gpu.py --tokenizer DIR [--model llama-3.1-8b --num-prompts 512 ...]

Weights are random (`load_format: dummy`; speed does not depend on their values). The
workload is the harness's random dataset (token ids from --tokenizer's vocabulary), every
request sent at once, `ignore_eos`. Offline runs in a process of its own. Served, once per
--modes and --stream-intervals value, each cluster started fresh: `colocated` is one decode
instance computing its prompts itself (what the served path costs); `disaggregated` is one
prefill and one decode instance sharing the GPU, every prompt computed by the prefill and
its KV handed over by --transport (`disaggregated-late`: the same, the first token sent by the
decode instance rather than by the router as the prefill answers); the clients use --backend (the router's gRPC API, or
its OpenAI HTTP front). Prints output tokens/s and each served run's ratio to offline;
then, on the same warm cluster, the median time to first token at concurrency 1
over --ttft-prompts fresh prompts of --input-len tokens (the figure that compares a prefill
instance's hand-off against a colocated engine computing the prompt itself).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import yaml

from vllm_cluster.cluster.local import LocalCluster

CLI = [sys.executable, "-m", "vllm_cluster.cluster.cli"]


def engine_section(args: argparse.Namespace, stream_interval: int) -> dict:
    return {
        "model": {"model": args.model, "load_format": "dummy",
                  "dtype": "bfloat16" if args.device == "cuda" else "float32"},
        "device": args.device,
        "stream_interval": stream_interval,
        "cache": {"enable_prefix_caching": False},  # random prompts: no hits, no hashing either
        **({"scheduler": {"max_model_len": args.max_model_len}} if args.max_model_len else {}),
    }


def workload(args: argparse.Namespace, num_prompts: int | None = None, range_ratio: float | None = None,
             seed: int = 0) -> list[str]:
    return ["--dataset-name", "random", "--num-prompts", str(num_prompts or args.num_prompts),
            "--tokenizer", args.tokenizer, "--random-input-len", str(args.input_len),
            "--random-output-len", str(args.output_len),
            "--random-range-ratio", str(args.range_ratio if range_ratio is None else range_ratio), "--seed", str(seed)]


def offline(args: argparse.Namespace, tmp: Path) -> float:
    path = tmp / "offline.yaml"
    path.write_text(yaml.safe_dump(engine_section(args, 1)))
    out = tmp / "offline.json"
    subprocess.run([*CLI, "bench", "throughput", "--config", str(path), *workload(args), "--num-warmups", "8",
                    "--output-json", str(out)], check=True)  # the same warm-ups as the served runs
    return float(json.loads(out.read_text())["output_tokens_per_second"])


@contextlib.contextmanager
def profiled(cluster: LocalCluster, profile_dir: Path | None, run: str) -> Iterator[None]:
    """With --profile-dir: py-spy samples every process of the cluster (each thread, idle time
    included; without pausing them, but the sampling still costs them time: read the TTFT of
    a profiled run from another run) while the body runs, one collapsed-stack file per
    process. Where the concurrency-1 TTFT goes in the prefill instance, its router and its
    decode instance."""
    if profile_dir is None:
        yield
        return
    profile_dir.mkdir(parents=True, exist_ok=True)
    spies = [subprocess.Popen(["py-spy", "record", "--pid", str(p.popen.pid), "--idle", "--threads", "--nonblocking",
                               "--rate", "1000", "--format", "raw", "--output",
                               str(profile_dir / f"{run}-{p.name}.txt")],
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
             for p in cluster.processes]  # fmt: skip
    try:
        yield
    finally:
        for spy in spies:
            spy.send_signal(signal.SIGINT)  # py-spy writes what it sampled and exits
        for spy in spies:
            _, err = spy.communicate(timeout=60)
            if spy.returncode:
                print(f"py-spy failed ({spy.returncode}): {err.decode(errors='replace')[-500:]}", file=sys.stderr)


def served(args: argparse.Namespace, tmp: Path, mode: str, stream_interval: int) -> dict:
    disaggregated = mode.startswith("disaggregated")
    config = {"engine": engine_section(args, stream_interval),
              "cluster": {"num_prefill": int(disaggregated), "num_decode": 1, "transport": args.transport},
              "router": {"min_prefill_tokens": 0 if disaggregated else 1 << 30, "queue_timeout_s": 600,
                         "early_first_token": mode != "disaggregated-late"}}
    path = tmp / f"served-{mode}-{stream_interval}.yaml"
    path.write_text(yaml.safe_dump(config))
    name = f"served-{mode}-{stream_interval}.json"
    with LocalCluster.from_yaml(path) as cluster:
        target = (["--backend", "grpc", "--address", cluster.router_address] if args.backend == "grpc"
                  else ["--backend", "openai", "--base-url", cluster.http_address])
        bench = [*CLI, "bench", "serve", *target, "--api-key", cluster.api_key or "", "--disable-tqdm",
                 "--save-result", "--result-dir", str(tmp)]
        subprocess.run([*bench, *workload(args), "--num-warmups", "8", "--num-client-processes",
                        str(args.client_processes), "--result-filename", name], check=True)
        if args.ttft_prompts:  # one request at a time, exact lengths, prompts the cluster has not seen
            with profiled(cluster, args.profile_dir, name.removesuffix(".json")):
                subprocess.run([*bench, *workload(args, args.ttft_prompts, 0.0, seed=1), "--max-concurrency", "1",
                                "--num-warmups", "2", "--result-filename", "ttft-" + name], check=True)
    run = json.loads((tmp / name).read_text())
    if args.ttft_prompts:
        run["ttft_c1_ms"] = json.loads((tmp / ("ttft-" + name)).read_text())["median_ttft_ms"]
    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="llama-3.1-8b")
    parser.add_argument("--tokenizer", required=True, help="HF tokenizer directory or .gguf for the random prompts")
    parser.add_argument("--num-prompts", type=int, default=512)
    parser.add_argument("--input-len", type=int, default=512)
    parser.add_argument("--output-len", type=int, default=256)
    parser.add_argument("--range-ratio", type=float, default=0.5)
    parser.add_argument("--client-processes", type=int, default=4)
    parser.add_argument("--stream-intervals", default="1,8")
    parser.add_argument("--modes", default="colocated",
                        help="comma-separated: colocated, disaggregated, disaggregated-late")
    parser.add_argument("--device", default="cuda", help="cpu: a quick check of the script itself")
    parser.add_argument("--transport", default="cuda_ipc", help="KV hand-off (disaggregated)")
    parser.add_argument("--max-model-len", type=int, default=0, help="0: the model's own (two instances on one "
                        "GPU may not hold llama-3.1-8b's 131,072 tokens each)")
    parser.add_argument("--ttft-prompts", type=int, default=16, help="concurrency-1 TTFT pass (0: skip)")
    parser.add_argument("--profile-dir", type=Path, default=None,
                        help="py-spy (pip install py-spy) every cluster process during the concurrency-1 pass, "
                             "collapsed stacks per process into this folder")
    parser.add_argument("--backend", choices=["grpc", "openai"], default="grpc",
                        help="the clients' API: the router's gRPC Generate, or the OpenAI HTTP front (/v1/completions)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as name:
        tmp = Path(name)
        base = offline(args, tmp)
        runs = {(mode, k): served(args, tmp, mode, k)
                for mode in args.modes.split(",") for k in map(int, args.stream_intervals.split(","))}
    print(f"\n{args.model}, {args.num_prompts} prompts x ({args.input_len} in / {args.output_len} out, "
          f"range ratio {args.range_ratio}), all at once; {args.client_processes} client processes\n")
    print("| path | output tok/s | of offline | median TTFT ms | median TPOT ms | TTFT at concurrency 1 ms "
          "| prompts recomputed |")
    print("|---|---|---|---|---|---|---|")
    print(f"| offline `bench throughput` (baseline) | {base:.0f} | 1.00 | - | - | - | - |")
    for (mode, interval), run in runs.items():
        tps = run["output_throughput"]
        ttft_c1 = f"{run['ttft_c1_ms']:.1f}" if "ttft_c1_ms" in run else "-"
        # A disaggregated row whose prompts decode recomputed (a failed hand-off) measured
        # something else: the count says so (HTTP: the front does not report it).
        recomputed = run.get("prompt_paths", {}).get("recomputed", 0) if args.backend == "grpc" else "-"
        print(f"| served `bench serve` ({args.backend}), {mode}, stream_interval {interval} | {tps:.0f} | "
              f"{tps / base:.2f} | {run['median_ttft_ms']:.0f} | {run['median_tpot_ms']:.1f} | {ttft_c1} "
              f"| {recomputed} |")


if __name__ == "__main__":
    main()
