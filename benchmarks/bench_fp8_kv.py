"""The FP8 KV cache on one H200: bf16 against fp8 (kv_cache_dtype), same run.

    PYTHONPATH=. python benchmarks/bench_fp8_kv.py [--memory-fraction 0.05] [--no-throughput]

1. Paged decode attention alone (kernels/attention/triton_decode.py): batch 64 x 2k context,
   Hq 32 / Hkv 8, D 128, block 16 (llama-3.1-8b's attention); time and effective bandwidth
   (the KV bytes read + q and out), against a device-to-device copy measured here.
2. Offline throughput of dummy llama-3.1-8b with kv_cache_dtype auto (bf16) and fp8 at the
   same KV memory budget (memory_fraction of the free memory after the weights): the number
   of blocks each gets, and tokens/s over a batch long enough that the KV cache, not
   max_num_seqs, bounds how many sequences run at once.
Weights are random (no checkpoints can be downloaded here); speed does not depend on them.
"""

from __future__ import annotations

import argparse
import gc
import json

import torch

from benchmarks.bench_gpu import RESULTS, ours_generate, prompts, record
from vllm_cluster.engine import LLM
from vllm_cluster.kernels.attention.fp8_kv import FP8_KV_DTYPE, quantize
from vllm_cluster.kernels.attention.triton_decode import _num_sms, choose_num_splits, decode_attention

PRESET = "llama-3.1-8b"


def copy_gbps() -> float:
    from triton.testing import do_bench

    src = torch.empty(1024 * 2**20, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    return 2 * src.numel() / do_bench(lambda: dst.copy_(src)) / 1e6  # read + write


def decode_attention_kernel(copy_bw_gbps: float) -> None:
    from triton.testing import do_bench

    batch_size, num_heads, num_kv_heads, head_dim, block_size, seq_len = 64, 32, 8, 128, 16, 2048
    blocks_per_seq = seq_len // block_size
    num_blocks = batch_size * blocks_per_seq
    gen = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(batch_size, num_heads, head_dim, device="cuda", dtype=torch.bfloat16, generator=gen)
    bf16_cache = torch.randn(num_blocks, 2, block_size, num_kv_heads, head_dim, device="cuda",
                             dtype=torch.bfloat16, generator=gen)
    k_scale = torch.tensor([4.0 / 448], device="cuda")
    v_scale = torch.tensor([4.0 / 448], device="cuda")
    fp8_cache = torch.empty(bf16_cache.shape, dtype=FP8_KV_DTYPE, device="cuda")
    fp8_cache[:, 0] = quantize(bf16_cache[:, 0], k_scale, FP8_KV_DTYPE)
    fp8_cache[:, 1] = quantize(bf16_cache[:, 1], v_scale, FP8_KV_DTYPE)
    tables = torch.randperm(num_blocks, device="cuda", generator=gen).view(batch_size, -1).to(torch.int32)
    seq_lens = torch.full((batch_size,), seq_len, device="cuda", dtype=torch.int32)
    splits = choose_num_splits(batch_size, num_kv_heads, seq_len, _num_sms(q.device))
    outs = {}
    for name, cache, scales in (("bf16", bf16_cache, (None, None)), ("fp8", fp8_cache, (k_scale, v_scale))):
        def run(cache: torch.Tensor = cache, scales: tuple = scales) -> torch.Tensor:
            return decode_attention(q, cache, tables, seq_lens, head_dim**-0.5, max_seq_len=seq_len,
                                    k_scale=scales[0], v_scale=scales[1])

        outs[name] = run()
        ms = do_bench(run)
        num_bytes = cache.numel() * cache.element_size() + 2 * q.numel() * q.element_size()
        gbps = num_bytes / ms / 1e6
        record(bench="decode_attention", kv_cache=name, batch=batch_size, context=seq_len, splits=splits,
               us=round(ms * 1e3, 1), GBps=round(gbps), fraction_of_copy=round(gbps / copy_bw_gbps, 2))
    record(bench="decode_attention_fp8_error",
           max_abs_vs_bf16=round(float((outs["fp8"] - outs["bf16"]).abs().max()), 4))


def throughput(kv_cache_dtype: str, memory_fraction: float, num: int, in_len: int, out_len: int) -> None:
    max_len = in_len + out_len
    llm = LLM(PRESET, load_format="dummy", device="cuda", dtype="bfloat16", block_size=16,
              memory_fraction=memory_fraction, max_model_len=max_len, max_num_batched_tokens=8192,
              max_num_seqs=num, enable_prefix_caching=False, kv_cache_dtype=kv_cache_dtype)
    num_blocks = llm.core.kv.pool.num_blocks
    batch = prompts(num, in_len, llm.core.vocab_size, seed=2)
    ours_generate(llm, batch[:4], 4)
    t = ours_generate(llm, batch, out_len)
    record(bench="throughput", model=PRESET, kv_cache_dtype=kv_cache_dtype, memory_fraction=memory_fraction,
           num_blocks=num_blocks, max_concurrent_seqs=num_blocks * 16 // max_len,
           num_prompts=num, input_len=in_len, output_len=out_len, tok_s=round(num * out_len / t))
    del llm
    gc.collect()
    torch.cuda.empty_cache()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--memory-fraction", type=float, default=0.05,
                        help="KV budget: this fraction of the free memory after the weights")
    parser.add_argument("--num-prompts", type=int, default=512)
    parser.add_argument("--input-len", type=int, default=1024)
    parser.add_argument("--output-len", type=int, default=256)
    parser.add_argument("--no-throughput", action="store_true", help="the kernel comparison only")
    args = parser.parse_args()
    assert torch.cuda.is_available(), "the benchmark needs a CUDA GPU"
    copy_bw = copy_gbps()
    record(bench="copy", GBps=round(copy_bw))
    decode_attention_kernel(copy_bw)
    if not args.no_throughput:
        for kv_cache_dtype in ("auto", "fp8"):
            throughput(kv_cache_dtype, args.memory_fraction, args.num_prompts, args.input_len, args.output_len)
    print("RESULTS " + json.dumps(RESULTS))


if __name__ == "__main__":
    main()
