"""Where a prefill instance's time to first token goes, in one process, no servers: one
prompt computed by a colocated engine against the same prompt on a prefill-role engine over
the same weights, with (a) a push that sends nothing, (b) a push that copies each layer's
blocks into a decode engine's cache (what CUDA IPC does, minus the wire), and (c) the
colocated engine with async scheduling off, as the prefill role runs. Each figure is the median wall time from
add_request to the step that samples, over --repeats fresh prompts, after warm-ups.

    python benchmarks/bench_prefill_role.py --model llama-3.2-1b --input-len 512
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import dataclass

import torch

from vllm_cluster.engine import LLM, SamplingParams
from vllm_cluster.engine.engine_core import EngineCore


@dataclass
class NoPush:
    num_skip_blocks: int = 0

    def push_layer(self, layer: int, src_block_ids: list[int]) -> None:
        pass

    def finish(self) -> None:
        pass


@dataclass
class CopyPush:
    src: EngineCore
    dst: EngineCore
    dst_block_ids: list[int]
    num_skip_blocks: int = 0

    def push_layer(self, layer: int, src_block_ids: list[int]) -> None:
        dst = self.dst_block_ids[: len(src_block_ids)]
        self.dst.transfer_caches[layer][dst] = self.src.transfer_caches[layer][src_block_ids]

    def finish(self) -> None:
        sync()


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def first_token_ms(core: EngineCore, prompt: list[int], push_of: object = None, decode: EngineCore | None = None,
                   rid: str = "r") -> float:
    params = SamplingParams(temperature=0.0, max_tokens=1)
    push = None
    if push_of == "none":
        push = NoPush()
    elif push_of == "copy":
        assert decode is not None
        block_ids = decode.reserve(decode.make_request(rid, prompt, params), lease_s=60)
        assert block_ids is not None
        push = CopyPush(core, decode, block_ids)
    sync()
    start = time.perf_counter()
    core.add_request(core.make_request(rid, prompt, params), push)
    while core.has_unfinished():
        core.step()
    sync()
    elapsed = (time.perf_counter() - start) * 1e3
    if decode is not None:
        decode.abort(rid)
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="llama-3.2-1b")
    parser.add_argument("--input-len", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--device", default="cuda", help="cpu: a quick check of the script (--model a path)")
    args = parser.parse_args()
    if args.device == "cuda":
        common = {"load_format": "dummy", "device": "cuda", "dtype": "bfloat16", "enable_prefix_caching": False,
                  "num_blocks": 2048, "max_model_len": 8192}
    else:
        common = {"device": "cpu", "dtype": "float32", "enable_prefix_caching": False, "num_blocks": 256,
                  "max_model_len": 2048}
    llm = LLM(args.model, **common)
    gen = torch.Generator().manual_seed(0)

    def prompt() -> list[int]:
        return torch.randint(100, 32000, (args.input_len,), generator=gen).tolist()

    prefill = llm.derive(role="prefill").core
    colocated_sync = llm.derive(async_scheduling=False).core if args.device == "cuda" else llm.core
    decode = llm.derive(role="decode").core
    rows = {
        "colocated": lambda i: first_token_ms(llm.core, prompt(), rid=f"c{i}"),
        "prefill role, push sends nothing": lambda i: first_token_ms(prefill, prompt(), "none", rid=f"n{i}"),
        "prefill role, push copies into decode's cache": lambda i: first_token_ms(
            prefill, prompt(), "copy", decode, rid=f"p{i}"),
        "colocated, async scheduling off": lambda i: first_token_ms(colocated_sync, prompt(), rid=f"s{i}"),
    }
    print(f"\n{args.model}, {args.input_len}-token prompts, median of {args.repeats} after 3 warm-ups\n")
    print("| engine | first token ms |\n|---|---|")
    for name, run in rows.items():
        for i in range(3):
            run(-1 - i)
        times = [run(i) for i in range(args.repeats)]
        print(f"| {name} | {statistics.median(times):.2f} |")


if __name__ == "__main__":
    main()
