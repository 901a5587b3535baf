"""One MoE layer at decode batch sizes on one GPU: the current decode path
(SparseMoeBlock.forward_dense, every expert on every token) against the selected-experts
kernels (kernels/moe/triton_grouped.py, only the routed experts' weights), both replayed
from CUDA graphs, on Qwen3-30B-A3B's layer shape (D 2048, I 768, 128 experts, top-8) and
Mixtral 8x7B's (D 4096, I 14336, 8 experts, top-2) in bf16. Prints the two times per batch
size, measured in the same run, and the largest difference between the two outputs.

    python benchmarks/bench_moe_decode_grouped.py
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from vllm_cluster.engine.models.mixtral import SparseMoeBlock, route
from vllm_cluster.kernels.moe.triton_grouped import moe_selected_experts

SHAPES = {"qwen3-30b-a3b": (2048, 768, 128, 8), "mixtral-8x7b": (4096, 14336, 8, 2)}
BATCHES = (1, 4, 16, 64)


def _graph_ms(fn: Callable[[], torch.Tensor], repeats: int = 50) -> float:
    """Mean time of one replay of `fn` captured in a CUDA graph."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()  # warm-up: Triton compiles outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    graph.replay()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(repeats):
        graph.replay()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / repeats * 1e3


@torch.inference_mode()
def bench(name: str, hidden: int, inter: int, num_experts: int, top_k: int) -> None:
    torch.manual_seed(0)
    block = SparseMoeBlock(hidden, inter, num_experts, top_k).cuda().to(torch.bfloat16)
    for param in block.parameters():
        param.data.normal_(0.0, 0.02)
    w13, w2 = block.stack.w13_weight, block.stack.w2_weight
    print(f"{name}: D {hidden}, I {inter}, {num_experts} experts, top-{top_k}, bf16")
    print("tokens  dense_ms  selected_ms  max_abs_diff")
    for num_tokens in BATCHES:
        x = torch.randn(num_tokens, hidden, device="cuda", dtype=torch.bfloat16)
        weights, ids = route(block.gate(x), top_k)
        dense = block.forward_dense(x, weights, ids)
        selected = moe_selected_experts(x, w13, w2, weights, ids)
        diff = (dense.float() - selected.float()).abs().max().item()
        t_dense = _graph_ms(lambda x=x, w=weights, i=ids: block.forward_dense(x, w, i))
        t_selected = _graph_ms(lambda x=x, w=weights, i=ids: moe_selected_experts(x, w13, w2, w, i))
        print(f"{num_tokens:6d}  {t_dense:8.3f}  {t_selected:11.3f}  {diff:12.2e}")


def main() -> None:
    assert torch.cuda.is_available(), "needs a CUDA GPU"
    for name, shape in SHAPES.items():
        bench(name, *shape)


if __name__ == "__main__":
    main()
