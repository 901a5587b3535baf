"""Engine start-up on the bundled model: how long `resolve` (the config) and `load_model`
(the weights) take with the GGUF file's metadata parsed afresh each time (as before the
parse was shared, engine/loader/gguf_file.py) against shared within the process, in the
same run; then the tokenizer, which HF transformers builds from the same file's metadata:
converted afresh (an empty tokenizer cache) against read back from the cache, same run.

    .venv/bin/python benchmarks/bench_startup.py [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time

import torch

from vllm_cluster.engine.config import ModelConfig
from vllm_cluster.engine.loader import gguf_file, load_model, resolve
from vllm_cluster.engine.tokenizer import load_tokenizer


def start(config: ModelConfig, fresh: bool) -> tuple[float, float]:
    """-> (resolve s, load_model s); fresh: each forgets the parsed metadata first (one parse
    for the config, one for the weights, as before)."""
    if fresh:
        gguf_file._parsed.cache_clear()
    t0 = time.perf_counter()
    source = resolve(config)
    t1 = time.perf_counter()
    if fresh:
        gguf_file._parsed.cache_clear()
    load_model(source, torch.float32, torch.device("cpu"))
    return t1 - t0, time.perf_counter() - t1


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    config = ModelConfig(model="smollm2-135m-instruct")
    start(config, fresh=True)  # imports, allocator
    for mode in ("parsed afresh", "parse shared"):
        runs = [start(config, fresh=mode == "parsed afresh") for _ in range(args.rounds)]
        print(json.dumps({
            "mode": mode, "resolve_s": round(statistics.median(r[0] for r in runs), 2),
            "load_model_s": round(statistics.median(r[1] for r in runs), 2),
            "total_s": round(statistics.median(sum(r) for r in runs), 2),
        }), flush=True)  # fmt: skip
    path = resolve(config).path
    assert path is not None
    for mode in ("tokenizer converted", "tokenizer cached"):
        times = []
        for _ in range(args.rounds):
            with tempfile.TemporaryDirectory() as cache_home:
                os.environ["XDG_CACHE_HOME"] = cache_home
                if mode == "tokenizer cached":
                    load_tokenizer(path)
                t0 = time.perf_counter()
                load_tokenizer(path)
                times.append(time.perf_counter() - t0)
        print(json.dumps({"mode": mode, "tokenizer_s": round(statistics.median(times), 2)}), flush=True)


if __name__ == "__main__":
    main()
