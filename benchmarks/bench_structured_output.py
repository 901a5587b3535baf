"""Structured output's cost: output tokens/s of a batch constrained by a mid-size JSON
schema against the same batch unconstrained (and half of each), in one run.

    python benchmarks/bench_structured_output.py                # llama-3.1-8b dummy weights, CUDA, batch 64
    python benchmarks/bench_structured_output.py --tiny         # SmolLM2 on CPU, batch 4: a quick check

`LLM(preset, load_format="dummy", device="cuda", max_num_seqs=batch)`; --batch prompts of
random token ids (--prompt-len), all submitted at once through `LLM.generate`, greedy, up
to --max-tokens each. Dummy weights come without a tokenizer, so the grammar is compiled
against the bundled SmolLM2 tokenizer (49,152 tokens) with the bitmask sized to the
model's vocabulary (128,256): the host-side mask work is that of a 49k-token vocabulary,
the device-side masking that of the model's. Constrained requests end when the schema is
complete, so their batch thins out towards its end; each constrained row is therefore also
compared with the same requests unconstrained and cut to the same lengths (`max_tokens` =
each request's constrained length, `ignore_eos`): the same tokens and batch sizes, only the
grammar's work missing, which is its cost. Every row: the same engine, warmed up.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import random
import time
from pathlib import Path

import torch

from vllm_cluster.engine import LLM, SamplingParams
from vllm_cluster.engine.loader import bundled_model_path
from vllm_cluster.engine.structured_output import GrammarCache
from vllm_cluster.engine.structured_output_params import StructuredOutputsParams
from vllm_cluster.engine.tokenizer import load_tokenizer

# Mid-size: nested objects, arrays, enums, bounded strings and integers.
SCHEMA = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 0, "maximum": 1000000},
        "name": {"type": "string", "maxLength": 24},
        "email": {"type": "string", "pattern": "^[a-z]{1,12}@[a-z]{1,10}\\.(com|org|net)$"},
        "role": {"enum": ["admin", "editor", "viewer", "guest"]},
        "active": {"type": "boolean"},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 10}, "maxItems": 4},
        "address": {
            "type": "object",
            "properties": {
                "street": {"type": "string", "maxLength": 30},
                "city": {"type": "string", "maxLength": 20},
                "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
                "country": {"enum": ["US", "FR", "DE", "JP"]},
            },
            "required": ["street", "city", "zip", "country"],
            "additionalProperties": False,
        },
        "score": {"type": "integer", "minimum": -100, "maximum": 100},
    },
    "required": ["id", "name", "email", "role", "active", "tags", "address", "score"],
    "additionalProperties": False,
}


def build(args: argparse.Namespace) -> LLM:
    if args.tiny:
        return LLM("smollm2-135m-instruct", device="cpu", dtype="float32", num_threads=2, max_num_seqs=args.batch,
                   num_blocks=256, max_model_len=1024, max_num_batched_tokens=256)
    llm = LLM(args.preset, load_format="dummy", device="cuda", max_num_seqs=args.batch)
    core = llm.core
    tokenizer = Path(args.tokenizer) if args.tokenizer else bundled_model_path()
    core.grammars = GrammarCache(lambda: load_tokenizer(tokenizer), core.vocab_size, core.eos_token_id)
    return llm


def run(llm: LLM, prompts: list[list[int]], params: list[SamplingParams]) -> dict:
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - start
    lengths = [len(o.outputs[0].token_ids) for o in outputs]
    tokens = sum(lengths)
    valid = 0
    for output, p in zip(outputs, params, strict=True):
        if p.structured_outputs is not None and output.outputs[0].finish_reason == "stop":
            valid += 1
    return {"elapsed_s": round(elapsed, 3), "output_tokens": tokens, "output_tok_s": round(tokens / elapsed, 1),
            "constrained_finished": valid, "lengths": lengths}


def same_lengths(llm: LLM, prompts: list[list[int]], row: dict) -> dict:
    """The same prompts unconstrained, each cut to its length in `row`."""
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in row["lengths"]]
    return run(llm, prompts, params)


def profile(llm: LLM, prompts: list[list[int]], params: list[SamplingParams]) -> None:
    activities = [torch.profiler.ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as prof:
        row = run(llm, prompts, params)
    print(f"json_schema under torch.profiler: {row['elapsed_s']} s")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=60))
    python = cProfile.Profile()
    row = python.runcall(run, llm, prompts, params)
    print(f"json_schema under cProfile: {row['elapsed_s']} s")
    pstats.Stats(python).sort_stats("tottime").print_stats(30)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="llama-3.1-8b")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--tokenizer", default="", help="the grammar's tokenizer (default: the bundled SmolLM2's; "
                        "its HF directory, saved with save_pretrained, does as well)")
    parser.add_argument("--tiny", action="store_true", help="SmolLM2 on CPU, batch 4, 24 tokens: a quick check")
    parser.add_argument("--profile", action="store_true",
                        help="the json_schema batch twice more, under torch.profiler and under cProfile: their tables")
    args = parser.parse_args()
    if args.tiny:
        args.batch, args.prompt_len, args.max_tokens = 4, 16, 24
    llm = build(args)
    rng = random.Random(0)
    prompts = [[rng.randrange(100, 30000) for _ in range(args.prompt_len)] for _ in range(args.batch)]
    so = StructuredOutputsParams(json=SCHEMA)
    plain = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    constrained = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, structured_outputs=so)
    start = time.perf_counter()
    llm.core.grammars.compiled(so)
    compile_s = time.perf_counter() - start  # with the tokenizer's set-up, once per engine
    half = args.batch // 2
    # Warm-up: every batch shape the rows below go through (the first constrained batch of a
    # size compiles the mask kernel's variants for it, about 1.4 s on the H100 once).
    run(llm, prompts, [constrained] * args.batch)
    run(llm, prompts, [constrained] * half + [plain] * (args.batch - half))
    rows = {"unconstrained": run(llm, prompts, [plain] * args.batch)}
    rows["json_schema"] = run(llm, prompts, [constrained] * args.batch)
    rows["json_schema_lengths_unconstrained"] = same_lengths(llm, prompts, rows["json_schema"])
    rows["half_and_half"] = run(llm, prompts, [constrained] * half + [plain] * (args.batch - half))
    rows["half_and_half_lengths_unconstrained"] = same_lengths(llm, prompts, rows["half_and_half"])
    if args.profile:  # before the table, so that its rows stay together
        profile(llm, prompts, [constrained] * args.batch)
    name = "smollm2-135m-instruct (cpu)" if args.tiny else f"{args.preset} (dummy, {torch.cuda.get_device_name()})"
    summary = {label: {k: v for k, v in r.items() if k != "lengths"} for label, r in rows.items()}
    print(json.dumps({"model": name, "batch": args.batch, "grammar_setup_s": round(compile_s, 3), **summary}))
    base = rows["unconstrained"]["output_tok_s"]
    print(f"\n{name}, batch {args.batch}, prompt {args.prompt_len}, up to {args.max_tokens} tokens, greedy")
    print("| requests | output tokens | output tok/s | of unconstrained | of unconstrained, same lengths |")
    print("|---|---|---|---|---|")
    for label, r in rows.items():
        twin = rows.get(f"{label}_lengths_unconstrained")
        same = f"{r['output_tok_s'] / twin['output_tok_s']:.2f}" if twin else ""
        print(f"| {label} | {r['output_tokens']} | {r['output_tok_s']} | {r['output_tok_s'] / base:.2f} | {same} |")


if __name__ == "__main__":
    main()
