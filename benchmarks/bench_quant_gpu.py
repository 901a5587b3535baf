"""Quantized decoding on one H200: bf16 against FP8 W8A8 and INT8 weight-only (and INT4,
where the gptq / awq method can build dummy weights), dummy llama-3.1-8b, same run.

    PYTHONPATH=. python benchmarks/bench_quant_gpu.py [--methods bf16,fp8,int8,gptq] [--no-throughput] [--pdl off,on]
        [--lane-sums off,on] [--decode-rotary off,on] [--lm-head cublas,gemv] [--vary MODULE.ATTR=A,B]
        [--int4-gemv mma,read] [--rounds 3] [--num-prompts 128]

Methods: bf16 and the quantization names; gptq-lm-head is gptq with lm_head quantized too
(a checkpoint declaring `lm_head: true`), so the logits GEMV reads INT4 as well; fp8-lm-head
and int8-lm-head are fp8 and int8 with `quantize_lm_head` (1-byte logits GEMV).
Per method: batch-1 inter-token latency (as benchmarks/bench_gpu.py: a 128-token prompt,
(time of 256 tokens - time of 1) / 255, decode replayed from CUDA graphs; the median of
`--rounds`) and offline
throughput (128 prompts of 512 random tokens, 128 generated each, all submitted at once;
`--num-prompts 16,32,128` for fewer at once: decode steps of that many rows).
Weights are random (no checkpoints can be downloaded here); speed does not depend on them.
`--pdl off,on` repeats the batch-1 runs with programmatic dependent launch off and on
(kernels/sync/pdl.py; the ratios are against the bf16 of the same setting) and checks that both
settings give the same greedy tokens. `--lane-sums off,on` does the same for the 1-byte
GEMV's per-thread partial sums (kernels/linear/triton_w8_gemv.LANE_SUMS), `--decode-rotary off,on`
for the decode attention rotating and caching the new token itself
(rotary_paged_attention, kernels/attention/dispatch.py) against the separate rotary + KV write launch before it,
`--lm-head cublas,gemv` for the logits through cuBLAS or the Triton GEMV, and `--vary
MODULE.ATTR=A,B` for any module-level switch read at graph capture. Every
combination runs every method. `--int4-gemv read` is a bound, not a kernel: each INT4 GEMV
of 1 to 8 rows (the MMA GEMV's calls) is replaced by a plain read of its packed weight
(every byte once, no arithmetic, 8 programs an SM striding over it; the outputs are zeros),
launched under PDL as the GEMV is: the INT4 step if the GEMVs cost only a read of their bytes, everything
else (norms, attention, rotary, lm_head where cuBLAS, launches) as it is. Its tokens are
not the model's.
"""

from __future__ import annotations

import argparse
import gc
import itertools
import json
import statistics
from typing import Any

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_wait

from benchmarks import vary
from benchmarks.bench_gpu import num_params, ours_generate, prompts, roofline
from vllm_cluster.engine import LLM, SamplingParams
from vllm_cluster.engine.errors import EngineError
from vllm_cluster.engine.layers import attention
from vllm_cluster.engine.models.llama import CausalLM
from vllm_cluster.kernels.attention import dispatch as attention_ops
from vllm_cluster.kernels.int4 import layouts, triton_mma, triton_mma_gemv
from vllm_cluster.kernels.int4.weight import Int4Weight
from vllm_cluster.kernels.linear import triton_w8_gemv
from vllm_cluster.kernels.linear.dispatch import linear
from vllm_cluster.kernels.sync import pdl

PRESET = "llama-3.1-8b"
RESULTS: list[dict[str, Any]] = []


def record(**row: Any) -> None:
    RESULTS.append(row)
    print(json.dumps(row), flush=True)


# Methods beyond the quantization names, (quantization, hf_overrides, LLM options): a GPTQ
# checkpoint that quantizes lm_head too, and the online methods asked to.
VARIANTS: dict[str, tuple[str, dict[str, Any], dict[str, Any]]] = {
    "gptq-lm-head": ("gptq", {"quantization_config": {"quant_method": "gptq", "bits": 4, "group_size": 128,
                                                      "lm_head": True}}, {}),
    "fp8-lm-head": ("fp8", {}, {"quantize_lm_head": True}),
    "int8-lm-head": ("int8", {}, {"quantize_lm_head": True}),
}


def make_llm(method: str, max_num_seqs: int, num_blocks: int, max_model_len: int, batched: int) -> LLM:
    quantization, overrides, options = VARIANTS.get(method, (method, {}, {}))
    return LLM(PRESET, load_format="dummy", device="cuda", dtype="bfloat16", num_blocks=num_blocks,
               block_size=16, max_model_len=max_model_len, max_num_batched_tokens=batched,
               max_num_seqs=max_num_seqs, enable_prefix_caching=False,
               quantization=None if method == "bf16" else quantization, hf_overrides=overrides, **options)


def batch1_itl(method: str, rounds: int = 3) -> tuple[float, list[int]]:
    """(inter-token latency in s, the median of `rounds` timings; the first 64 greedy tokens)."""
    llm = make_llm(method, max_num_seqs=8, num_blocks=1024, max_model_len=4096, batched=2048)
    p = prompts(1, 128, llm.core.vocab_size)
    ours_generate(llm, p, 8)
    n = 256
    itls = []
    for _ in range(rounds):
        ttft = ours_generate(llm, p, 1)
        itls.append((ours_generate(llm, p, n) - ttft) / (n - 1))
    itl = statistics.median(itls)
    greedy = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
    tokens = list(llm.generate(p, greedy, use_tqdm=False)[0].outputs[0].token_ids)
    _free(llm)
    return itl, tokens


def throughput(method: str, num: int = 128, in_len: int = 512, out_len: int = 128) -> float:
    max_len = in_len + out_len
    llm = make_llm(method, max_num_seqs=num, num_blocks=num * (-(-max_len // 16)) + 64,
                   max_model_len=max_len, batched=8192)
    batch = prompts(num, in_len, llm.core.vocab_size, seed=2)
    ours_generate(llm, batch[:4], 4)
    t = ours_generate(llm, batch, out_len)
    _free(llm)
    return num * out_len / t


def _apply(name: str, value: str) -> None:
    """One setting: pdl / decode-rotary / lane-sums on|off, or MODULE.ATTR (a Python literal)."""
    if name == "pdl":
        pdl.ENABLED = value == "on"
    elif name == "decode-rotary":
        attention.rotary_paged_attention = (
            attention_ops.rotary_paged_attention if value == "on" else _rotary_write_then_attend
        )
    elif name == "lane-sums":
        triton_w8_gemv.LANE_SUMS = value == "on"
    elif name == "int4-gemv":
        triton_mma.mma_gemv.gemv_pairs_mma = _MMA_GEMV if value == "mma" else _read_only_gemv
    elif name == "lm-head":  # cuBLAS (CausalLM.compute_logits: nn.Linear) or the Triton GEMV
        CausalLM.compute_logits = _COMPUTE_LOGITS if value == "cublas" else _gemv_logits  # type: ignore[method-assign]
    else:
        vary.set_attribute(name, value)


_COMPUTE_LOGITS = CausalLM.compute_logits
_MMA_GEMV = triton_mma_gemv.gemv_pairs_mma


@triton.jit
def _read_only_kernel(w_ptr, y_ptr, num_words, n_out, OUT_BLOCK: tl.constexpr, PDL: tl.constexpr):
    """Reads the packed weight once, 4 KB a program a step, the programs striding over it
    (16 bytes a thread a load); writes zeros to y through a test the compiler cannot fold,
    so that the loads stay."""
    if PDL:  # before any load, as the GEMV must wait before it reads x
        gdc_wait()
    pid = tl.program_id(0)
    offs = tl.arange(0, 1024)
    acc = tl.zeros((1024,), tl.int32)
    for start in range(pid * 1024, num_words, tl.num_programs(0) * 1024):
        acc ^= tl.load(w_ptr + start + offs, mask=start + offs < num_words, other=0)
    cols = pid * OUT_BLOCK + tl.arange(0, OUT_BLOCK)
    hit = tl.sum(acc, axis=0) == 0x5A5A5A5A
    tl.store(y_ptr + cols, tl.where(hit, 1.0, 0.0).to(y_ptr.dtype.element_ty), mask=cols < n_out)


def _read_only_gemv(
    x: torch.Tensor, weight: Int4Weight, config: triton_mma_gemv.MmaGemvConfig, silu_mul: bool = False
) -> torch.Tensor:
    """`--int4-gemv read`: the MMA GEMV's call replaced by a read of its packed weight by
    8 programs an SM (or fewer, one per 4 KB)."""
    qweight = weight.qweight
    m, (n, _) = x.shape[0], layouts.pairs_shape(qweight)
    n_out = n // 2 if silu_mul else n
    y = torch.empty(m, n_out, dtype=x.dtype, device=x.device)
    programs = min(8 * torch.cuda.get_device_properties(x.device).multi_processor_count,
                   triton.cdiv(qweight.numel(), 1024))
    use_pdl = pdl.enabled(x)
    out_block = triton.next_power_of_2(triton.cdiv(m * n_out, programs))
    _read_only_kernel[(programs,)](qweight, y, qweight.numel(), m * n_out, OUT_BLOCK=out_block, PDL=use_pdl,
                                   num_warps=4, launch_pdl=use_pdl)  # fmt: skip
    return y


def _gemv_logits(self: CausalLM, hidden: torch.Tensor) -> torch.Tensor:
    """`--lm-head gemv`: the logits of a batch-1 row through the Triton GEMV."""
    return linear(hidden, self.lm_head.weight)


def _rotary_write_then_attend(  # type: ignore[no-untyped-def]
    q, k, v, cos, sin, kv_cache, meta, scale, k_scale=None, v_scale=None, sliding_window=None, softcap=None
):
    """`--decode-rotary off`: the rotary + KV write launch, then the attention, for decode too."""
    q, k = attention_ops.rotary_write_kv_cache(q, k, v, cos, sin, kv_cache, meta.slot_mapping, k_scale, v_scale)
    return attention_ops.paged_attention(q, k, v, kv_cache, meta, scale, k_scale, v_scale, sliding_window, softcap)


def _free(llm: LLM) -> None:
    del llm
    gc.collect()
    torch.cuda.empty_cache()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--methods", default="bf16,fp8,int8,gptq")
    parser.add_argument("--no-throughput", action="store_true", help="batch-1 ITL only (a shorter run)")
    parser.add_argument("--pdl", default="on", help="on, off, or off,on: programmatic dependent launch")
    parser.add_argument("--rounds", type=int, default=3, help="batch-1 timings per setting; the median counts")
    parser.add_argument("--num-prompts", default="128", help="offline throughput's prompts at once, e.g. 16,32,128")
    parser.add_argument("--vary", action="append", default=[], metavar="MODULE.ATTR=A,B",
                        help="also compare these values of a module attribute, "
                             "e.g. kernels.sync.pdl.SILU_MUL_LATE_TRIGGER=False,True")
    parser.add_argument("--lm-head", default="cublas", help="cublas, gemv, or cublas,gemv: the batch-1 logits")
    parser.add_argument("--int4-gemv", default="mma",
                        help="mma, read, or mma,read: the INT4 GEMVs, or a plain read of their bytes (a bound)")
    parser.add_argument("--decode-rotary", default="on",
                        help="on, off, or off,on: decode attention rotates and caches the new token itself")
    parser.add_argument("--lane-sums", default="off" if not triton_w8_gemv.LANE_SUMS else "on",
                        help="on, off, or off,on: the 1-byte GEMV's per-thread partial sums")
    args = parser.parse_args()
    copy_bw, _ = roofline()
    _, bf16_bytes = num_params(PRESET)
    record(bench="roofline_bf16_itl", model=PRESET, ms=round(bf16_bytes / copy_bw * 1e3, 3))
    axes: list[tuple[str, list[str]]] = [
        ("pdl", args.pdl.split(",")), ("decode-rotary", args.decode_rotary.split(",")),
        ("lane-sums", args.lane_sums.split(",")), ("lm-head", args.lm_head.split(",")),
        ("int4-gemv", args.int4_gemv.split(",")),
    ] + vary.parse(args.vary)  # fmt: skip
    tokens: dict[tuple[str, str], list[int]] = {}
    for values in itertools.product(*(v for _, v in axes)):
        for (name, _), value in zip(axes, values, strict=True):
            _apply(name, value)
        setting = ", ".join(f"{name} {value}" for (name, _), value in zip(axes, values, strict=True))
        base_itl = None
        for method in args.methods.split(","):
            try:
                itl, tokens[method, setting] = batch1_itl(method, args.rounds)
            except EngineError as e:  # e.g. an INT4 method that cannot build dummy weights yet
                record(bench="skipped", method=method, reason=str(e))
                continue
            base_itl = itl if method == "bf16" else base_itl
            ratio = round(itl / base_itl, 3) if base_itl else None
            same = {s: tokens[method, s] == tokens[method, setting] for m, s in tokens if m == method and s != setting}
            record(bench="batch1_itl", model=PRESET, method=method, setting=setting, ms=round(itl * 1e3, 3),
                   vs_bf16=ratio, same_tokens_as=same)
            if not args.no_throughput:
                for num in (int(n) for n in args.num_prompts.split(",")):
                    record(bench="throughput", model=PRESET, method=method, setting=setting, num_prompts=num,
                           input_len=512, output_len=128, tok_s=round(throughput(method, num)))
    print("RESULTS " + json.dumps(RESULTS))


if __name__ == "__main__":
    main()
