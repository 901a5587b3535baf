"""The small per-layer kernels of a batch-1 decode step, Llama-3.1-8B shapes, on one GPU.

    PYTHONPATH=. python benchmarks/bench_decode_small_kernels.py [--baseline-attention PATH]

Each figure is microseconds per layer: 32 calls, one per layer (each layer its own q/k/v,
cache and block table, as in the step), captured in one CUDA graph and replayed; the
median of 5 timings of 50 replays. Small working sets stay in L2 between replays, so these
are launch and latency costs, the part the fusions remove.
  1. rotary + KV cache write: triton_ops.rotary_embedding then write_kv_cache (two
     launches) against triton_rotary_kv.rotary_write_kv_cache (one), bf16 and fp8 caches.
  2. decode attention at batch 1, max_seq_len 4096 (the graphs' max_model_len, so the
     split count the engine captures), contexts 128..4096; --baseline-attention times
     another version's `decode_attention` (a module file, e.g. a candidate kernel, or the
     previous one from git) the same way.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
from collections.abc import Callable
from typing import Any

import torch

from vllm_cluster.kernels.attention import triton_kv_write
from vllm_cluster.kernels.attention.fp8_kv import FP8_KV_DTYPE
from vllm_cluster.kernels.attention.triton_decode import _num_sms, choose_num_splits, decode_attention
from vllm_cluster.kernels.attention.triton_rotary_kv import rotary_write_kv_cache
from vllm_cluster.kernels.elementwise import triton_ops

NUM_LAYERS, NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE, MAX_SEQ_LEN = 32, 32, 8, 128, 16, 4096


def record(**row: Any) -> None:
    print(json.dumps(row), flush=True)


def per_layer_us(layer_call: Callable[[int], Any]) -> float:
    """Median time of one layer's call, replayed from a graph of NUM_LAYERS calls."""
    for i in range(NUM_LAYERS):  # compile outside the capture
        layer_call(i)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(NUM_LAYERS):
            layer_call(i)
    graph.replay()
    times = []
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(50):
            graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / 50 / NUM_LAYERS)
    return statistics.median(times)


def bench_rotary_kv_write() -> None:
    device = torch.device("cuda")
    q_size, kv_size = NUM_HEADS * HEAD_DIM, NUM_KV_HEADS * HEAD_DIM
    qkv = [torch.randn(1, q_size + 2 * kv_size, device=device, dtype=torch.bfloat16) for _ in range(NUM_LAYERS)]
    views = [
        tuple(t.view(1, -1, HEAD_DIM) for t in x.split([q_size, kv_size, kv_size], dim=-1)) for x in qkv
    ]
    angles = torch.rand(1, HEAD_DIM // 2, device=device) * 6.28  # a rotation: replays keep |q|, |k|
    cos, sin = angles.cos(), angles.sin()
    slots = torch.tensor([777], device=device)
    scale = torch.tensor([0.01], device=device)
    for name, dtype in (("bf16", torch.bfloat16), ("fp8", FP8_KV_DTYPE)):
        caches = [torch.zeros(256, 2, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, device=device).to(dtype)
                  for _ in range(NUM_LAYERS)]  # fmt: skip

        def unfused(i: int, caches: list[torch.Tensor] = caches) -> None:
            q, k, v = views[i]
            _, k_rot = triton_ops.rotary_embedding(q, k, cos, sin)
            triton_kv_write.write_kv_cache(k_rot, v, caches[i], slots, scale, scale)

        def fused(i: int, caches: list[torch.Tensor] = caches) -> None:
            q, k, v = views[i]
            rotary_write_kv_cache(q, k, v, cos, sin, caches[i], slots, scale, scale)

        record(bench="rotary_kv_write", kv_cache=name, unfused_us=round(per_layer_us(unfused), 2),
               fused_us=round(per_layer_us(fused), 2))  # fmt: skip


def bench_decode_attention(baseline: Any) -> None:
    device = torch.device("cuda")
    blocks_per_seq = MAX_SEQ_LEN // BLOCK_SIZE
    qs = [torch.randn(1, NUM_HEADS, HEAD_DIM, device=device, dtype=torch.bfloat16) for _ in range(NUM_LAYERS)]
    caches = [torch.randn(blocks_per_seq, 2, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, device=device, dtype=torch.bfloat16)
              for _ in range(NUM_LAYERS)]  # fmt: skip
    tables = [torch.randperm(blocks_per_seq, device=device).to(torch.int32)[None] for _ in range(NUM_LAYERS)]
    seq_lens = torch.zeros(1, dtype=torch.int32, device=device)
    scale = HEAD_DIM**-0.5
    num_splits = choose_num_splits(1, NUM_KV_HEADS, MAX_SEQ_LEN, _num_sms(device))
    for context in (128, 192, 256, 400, 1024, 4096):
        seq_lens.fill_(context)
        row: dict[str, Any] = dict(bench="decode_attention_b1", context=context, num_splits=num_splits)
        if baseline is not None:
            row["baseline_us"] = round(per_layer_us(
                lambda i: baseline.decode_attention(
                    qs[i], caches[i], tables[i], seq_lens, scale, max_seq_len=MAX_SEQ_LEN
                )
            ), 2)  # fmt: skip
        row["us"] = round(per_layer_us(
            lambda i: decode_attention(qs[i], caches[i], tables[i], seq_lens, scale, max_seq_len=MAX_SEQ_LEN)
        ), 2)  # fmt: skip
        record(**row)


def load_module(path: str) -> Any:
    spec = importlib.util.spec_from_file_location("baseline_decode_attention", path)
    assert spec is not None and spec.loader is not None, f"cannot load {path}"
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--baseline-attention", default="", help="a module file with another decode_attention")
    args = parser.parse_args()
    bench_rotary_kv_write()
    bench_decode_attention(load_module(args.baseline_attention) if args.baseline_attention else None)


if __name__ == "__main__":
    main()
