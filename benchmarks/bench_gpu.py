"""GPU benchmarks on one H200 (dummy weights, bf16), every figure against a same-run baseline.

    python benchmarks/bench_gpu.py [--quick] [--only itl,ttft,throughput] [--compare-sync]

Baselines measured in the same run: the roofline (device-to-device copy bandwidth and a
bf16 8192^3 matmul rate), HF transformers `generate` (sdpa, default dynamic cache) and, at
batch 1, HF with `cache_implementation="static"` (compiled decode step). Weights are random
(no checkpoints can be downloaded here); speed does not depend on their values. Our engine
runs with async scheduling (its default on CUDA); batch-1 latency is also measured with it
off (`ours_sync_ms`), and with --compare-sync so is every other figure.
"""

from __future__ import annotations

import argparse
import gc
import json
import time
from collections.abc import Callable
from typing import Any

import torch

from vllm_cluster.engine import LLM, SamplingParams
from vllm_cluster.engine.loader.presets import PRESETS

RESULTS: list[dict[str, Any]] = []


def record(**row: Any) -> None:
    RESULTS.append(row)
    print(json.dumps(row), flush=True)


def cuda_time(fn: Callable[[], Any]) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - start


def roofline() -> tuple[float, float]:
    from triton.testing import do_bench

    x = torch.empty(2 * 1024**3, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    ms = do_bench(lambda: y.copy_(x))
    copy_bw = 2 * x.numel() / (ms * 1e-3)  # bytes read + written per second
    a = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    b = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    ms = do_bench(lambda: a @ b)
    flops = 2 * 8192**3 / (ms * 1e-3)
    record(bench="roofline", copy_bandwidth_GBps=round(copy_bw / 1e9), bf16_matmul_TFLOPs=round(flops / 1e12))
    return copy_bw, flops


def make_llm(preset: str, max_num_seqs: int, num_blocks: int, max_model_len: int, batched: int) -> LLM:
    return LLM(preset, load_format="dummy", device="cuda", dtype="bfloat16", num_blocks=num_blocks,
               block_size=16, max_model_len=max_model_len, max_num_batched_tokens=batched,
               max_num_seqs=max_num_seqs, enable_prefix_caching=False, async_scheduling=True)


def sync_twin(llm: LLM) -> LLM:
    """The same engine (same weights) with async scheduling off."""
    return llm.derive(async_scheduling=False)


def make_hf(preset: str) -> Any:
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = dict(PRESETS[preset])
    cfg["model_type"] = "llama" if "Llama" in cfg["architectures"][0] else "qwen2"
    config = AutoConfig.for_model(**cfg)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16, attn_implementation="sdpa")
    return model.eval()


def prompts(num: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(1000, vocab - 1000, (num, length), generator=g).tolist()


def ours_generate(llm: LLM, batch: list[list[int]], out_len: int) -> float:
    params = SamplingParams(temperature=0.0, max_tokens=out_len, ignore_eos=True)
    return cuda_time(lambda: llm.generate(batch, params, use_tqdm=False))


def hf_generate(hf: Any, batch: list[list[int]], out_len: int, **kwargs: Any) -> float:
    ids = torch.tensor(batch, device="cuda")
    with torch.inference_mode():
        return cuda_time(lambda: hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=out_len,
                                             min_new_tokens=out_len, do_sample=False, pad_token_id=0, **kwargs))


class StepClock:
    """A `generate(streamer=...)` hook: HF calls put() with the prompt, then once per new
    token after that token exists on the host, so the gaps between calls are its steps."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def put(self, value: Any) -> None:
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass

    def itl(self) -> float:
        steps = self.times[2:]  # [0] the prompt, [1] the first token (after prefill)
        return (steps[-1] - self.times[1]) / len(steps)


def hf_static_itl(hf: Any, prompt: list[int], n: int) -> float:
    # One fixed max_new_tokens and prompt length: the static cache keeps its shape, so the
    # compiled step is built during the warm-up calls and only replayed when timed.
    for _ in range(2):
        hf_generate(hf, [prompt], n, cache_implementation="static")
    clock = StepClock()
    hf_generate(hf, [prompt], n, cache_implementation="static", streamer=clock)
    return clock.itl()


def batch1_itl(preset: str, hf: Any, copy_bw: float, weight_bytes: int, quick: bool) -> None:
    llm = make_llm(preset, max_num_seqs=8, num_blocks=1024, max_model_len=4096, batched=2048)
    vocab = llm.core.vocab_size
    p = prompts(1, 128, vocab)
    n = 256

    def itl_of(engine: LLM) -> float:
        ours_generate(engine, p, 8)
        ttft = ours_generate(engine, p, 1)
        return (ours_generate(engine, p, n) - ttft) / (n - 1)

    itl = itl_of(llm)
    sync_llm = sync_twin(llm)
    itl_sync = itl_of(sync_llm)
    del sync_llm
    n_hf = 16 if quick else 32
    hf_generate(hf, p, 2)
    hf_itl = (hf_generate(hf, p, n_hf) - hf_generate(hf, p, 1)) / (n_hf - 1)
    row: dict[str, Any] = dict(bench="batch1_itl", model=preset, ours_ms=round(itl * 1e3, 3),
                               ours_sync_ms=round(itl_sync * 1e3, 3),
                               hf_dynamic_ms=round(hf_itl * 1e3, 2),
                               roofline_ms=round(weight_bytes / copy_bw * 1e3, 3))
    if not quick:
        row["hf_static_ms"] = round(hf_static_itl(hf, p[0], 64) * 1e3, 2)
    record(**row)
    del llm
    gc.collect()
    torch.cuda.empty_cache()


def ttft_2k(preset: str, hf: Any, flops: float, matmul_params: int, compare_sync: bool) -> None:
    llm = make_llm(preset, max_num_seqs=8, num_blocks=1024, max_model_len=4096, batched=4096)
    p = prompts(1, 2048, llm.core.vocab_size, seed=1)
    ours_generate(llm, p, 1)
    ours = min(ours_generate(llm, p, 1) for _ in range(3))
    extra: dict[str, Any] = {}
    if compare_sync:
        sync_llm = sync_twin(llm)
        ours_generate(sync_llm, p, 1)
        extra["ours_sync_ms"] = round(min(ours_generate(sync_llm, p, 1) for _ in range(3)) * 1e3, 1)
        del sync_llm
    hf_generate(hf, p, 1)
    theirs = min(hf_generate(hf, p, 1) for _ in range(3))
    record(bench="ttft_2k", model=preset, ours_ms=round(ours * 1e3, 1), hf_ms=round(theirs * 1e3, 1),
           roofline_ms=round(2 * matmul_params * 2048 / flops * 1e3, 1), **extra)
    del llm
    gc.collect()
    torch.cuda.empty_cache()


def throughput(preset: str, hf: Any, num: int, in_len: int, out_len: int, hf_out_len: int,
               compare_sync: bool) -> None:
    max_len = in_len + out_len
    blocks = num * (-(-max_len // 16)) + 64
    llm = make_llm(preset, max_num_seqs=num, num_blocks=blocks, max_model_len=max_len, batched=8192)
    batch = prompts(num, in_len, llm.core.vocab_size, seed=2)
    ours_generate(llm, batch[:4], 4)
    t = ours_generate(llm, batch, out_len)
    extra: dict[str, Any] = {}
    if compare_sync:
        sync_llm = sync_twin(llm)
        ours_generate(sync_llm, batch[:4], 4)
        extra["ours_sync_tok_s"] = round(num * out_len / ours_generate(sync_llm, batch, out_len))
        del sync_llm
    del llm
    gc.collect()
    torch.cuda.empty_cache()
    # HF at the same batch; a long output is cut short (hf_out_len) to fit the device budget,
    # which flatters HF: its per-token cost only grows with the context.
    t_hf = hf_generate(hf, batch, hf_out_len)
    record(bench="throughput", model=preset, num_prompts=num, input_len=in_len, output_len=out_len,
           ours_tok_s=round(num * out_len / t), hf_tok_s=round(num * hf_out_len / t_hf),
           hf_output_len=hf_out_len, **extra)


def num_params(preset: str) -> tuple[int, int]:
    """(parameters a prefill token multiplies with, bytes a decode step reads at batch 1)."""
    c = PRESETS[preset]
    h, i, L, v = c["hidden_size"], c["intermediate_size"], c["num_hidden_layers"], c["vocab_size"]
    d = c.get("head_dim", h // c["num_attention_heads"])
    attn = h * d * (c["num_attention_heads"] * 2 + c["num_key_value_heads"] * 2)
    per_layer = attn + 3 * h * i
    # The embedding is a lookup, and the lm_head runs on the last token only.
    per_token = L * per_layer
    read_per_step = L * per_layer + v * h  # bf16 weights; the embedding row read is negligible
    return per_token, read_per_step * 2


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="skip HF static cache and shrink runs")
    parser.add_argument("--only", default="", help="comma list of: itl,ttft,throughput")
    parser.add_argument("--compare-sync", action="store_true",
                        help="also measure TTFT and throughput with async scheduling off")
    parser.add_argument("--presets", default="llama-3.2-1b,llama-3.1-8b")
    args = parser.parse_args()
    only = set(filter(None, args.only.split(",")))
    copy_bw, flops = roofline()
    for preset in args.presets.split(","):
        total, read_bytes = num_params(preset)
        hf = make_hf(preset)
        if not only or "itl" in only:
            batch1_itl(preset, hf, copy_bw, read_bytes, args.quick)
        if preset == "llama-3.1-8b" and (not only or "ttft" in only):
            ttft_2k(preset, hf, flops, total, args.compare_sync)
        if not only or "throughput" in only:
            if preset == "llama-3.1-8b":
                throughput(preset, hf, 128, 1024, 128, 128, args.compare_sync)
                throughput(preset, hf, 128, 128, 2048, 64, args.compare_sync)
            else:
                throughput(preset, hf, 256, 128, 2048, 64, args.compare_sync)
        del hf
        gc.collect()
        torch.cuda.empty_cache()
    print("RESULTS " + json.dumps(RESULTS))


if __name__ == "__main__":
    main()
