"""A design for the INT4 batch-1 GEMV, built and measured: weights staged in shared memory
and read before the PDL wait, in Gluon (Triton 3.6's `triton.experimental.gluon`: explicit
layouts and shared memory), against the production kernel (kernels/int4/triton_mma_gemv.py)
in the same run. Both variants are slower (docs/benchmarks.md, "Quantization"); the Gluon
port is the place to start a Gluon kernel from.

On plain reads (benchmarks/bench_layer_stream.py), a GEMV reading four steps of its weights
before its PDL wait brings a 32-layer chain from 33.4 to 28.0-28.6 us a layer, but only while
the kernel holds few registers. Here the steps ahead sit in shared memory, not registers
(benchmarks/gluon_int4_gemv.py says how): `tma:KB` a ring of TMA stages of at most KB a
program, all issued before the wait; `cp:S` the production loop with S more steps copied by
cp.async before the wait (`cp:0`: the Gluon port's control). Both with the production
configs (`pick_mma_gemv_config`; `--small`: 4-warp programs of one block a step, 64-80
registers, so that a successor can be resident beside them).

Timed: each shape's 32 layers in a chain on one x, and the layers' chain (qkv, o, gate_up as
a plain [gate | up] GEMV of 28672 outputs, down; each GEMV reading what the one before
wrote), distinct weights per layer (32 x 109 MB), every kernel under PDL, one CUDA graph per
variant. Checked: each shape against the torch reference, and the first layer's chain
against the production kernel's.

    PYTHONPATH=. python benchmarks/bench_int4_gluon_gemv.py [--variants tma:32,cp:0,cp:1,cp:3] [--small]
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import torch

from benchmarks.bench_layer_stream import graph_ms
from benchmarks.gluon_int4_gemv import GROUP, descriptor, gemv_cp, gemv_tma, stages_for
from vllm_cluster.kernels.int4 import reference as int4_reference
from vllm_cluster.kernels.int4.layouts import gptq_to_pairs, pairs_to_tiles
from vllm_cluster.kernels.int4.triton_mma_gemv import MmaGemvConfig, gemv_pairs_mma, pick_mma_gemv_config
from vllm_cluster.kernels.int4.weight import Int4Weight

# llama-3.1-8b's projections, (K, N); gate_up plain (no SiLU), as both kernels run it here.
SHAPES = {"qkv": (4096, 6144), "o": (4096, 4096), "gate_up": (4096, 28672), "down": (14336, 4096)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--variants", default="tma:32,cp:0,cp:1,cp:3",
                        help="tma:KB (the TMA ring, at most KB a program) "
                             "or cp:S (S steps by cp.async before the wait), comma-separated")  # fmt: skip
    parser.add_argument("--small", action="store_true",
                        help="qkv, o and down on 4-warp programs of one tile, "
                             "one block a warp and step (64 registers)")  # fmt: skip
    args = parser.parse_args()
    torch.manual_seed(0)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    configs = {name: pick_mma_gemv_config(n, k, sms) for name, (k, n) in SHAPES.items()}
    if args.small:
        configs |= {
            name: MmaGemvConfig(tiles=1, unroll=1, split_k=1, num_warps=4, k_warps=4) for name in ("qkv", "o", "down")
        }
    print(f"{args.layers} layers; configs: " + "; ".join(f"{name} {c}" for name, c in configs.items()))
    layers = []
    for _ in range(args.layers):
        layer = {}
        for name, (k, n) in SHAPES.items():
            qweight = torch.randint(-(2**31), 2**31, (k // 8, n), device="cuda", dtype=torch.int32)
            tiles = pairs_to_tiles(gptq_to_pairs(qweight))
            # scales keep a chain's activations near unit size: E[(q - zero - 1)^2] ~ 43.5
            scales = (torch.rand(k // GROUP, n, device="cuda") * (14.5 * k) ** -0.5).to(torch.bfloat16)
            zeros = torch.randint(-(2**31), 2**31, (k // GROUP, n // 8), device="cuda", dtype=torch.int32)
            layer[name] = {"qweight": qweight, "tiles": tiles, "qzeros": zeros, "scales": scales,
                           "desc": descriptor(tiles, configs[name])}  # fmt: skip
        layers.append(layer)

    def variant(spec: str) -> Callable[[torch.Tensor, dict, str], torch.Tensor]:
        kind, value = spec.split(":")

        def run(x: torch.Tensor, w: dict, name: str) -> torch.Tensor:
            k, n = SHAPES[name]
            cfg = configs[name]
            if kind == "production":
                return gemv_pairs_mma(x, Int4Weight(w["tiles"], w["qzeros"], w["scales"], None, GROUP, "tiles", 1), cfg)
            y = torch.empty(1, n, device="cuda", dtype=torch.bfloat16)
            if kind == "tma":
                return gemv_tma(x, w["desc"], w["qzeros"], w["scales"], n, k, cfg, stages_for(k, cfg, int(value)), y)
            return gemv_cp(x, w["tiles"], w["qzeros"], w["scales"], n, k, cfg, int(value), y)

        return run

    specs = ["production:"] + args.variants.split(",")
    gemvs = {spec: variant(spec) for spec in specs}

    # each shape alone against the torch reference (GPTQ's zero + 1, as checkpoints store it)
    for name, (k, _) in SHAPES.items():
        w = layers[0][name]
        x = torch.randn(1, k, device="cuda").to(torch.bfloat16)
        ref = int4_reference.int4_gemm(
            x.float(), Int4Weight(w["qweight"], w["qzeros"], w["scales"].float(), None, GROUP, "gptq", 1)
        )
        errs = [f"{spec} {float((fn(x, w, name).float() - ref).norm() / ref.norm()):.5f}" for spec, fn in gemvs.items()]
        print(f"{name}: relative error " + ", ".join(errs), flush=True)

    # each shape alone: its 32 layers' GEMVs in a chain on one x (each still waits for the one before)
    print(f"| us a GEMV ({args.layers} in a chain, one x) | " + " | ".join(specs) + " |")
    print("|---|" + "---|" * len(specs))
    for name, (k, _) in SHAPES.items():
        x = torch.randn(1, k, device="cuda").to(torch.bfloat16)
        cells = []
        for fn in gemvs.values():

            def alone(fn: Callable = fn, x: torch.Tensor = x, name: str = name) -> None:
                for layer in layers:
                    fn(x, layer[name], name)

            cells.append(f"{graph_ms(alone) * 1000 / len(layers):.2f}")
        print(f"| {name} | " + " | ".join(cells) + " |", flush=True)

    # the layers: each GEMV reads what the one before wrote (random weights let the
    # activations drift over many layers, so outputs are compared after the first layer)
    x0 = torch.randn(1, 4096, device="cuda").to(torch.bfloat16)
    print("| chain of the layers | us a layer | first layer's output against production's (relative) |")
    print("|---|---|---|")
    first = None
    for spec, fn in gemvs.items():

        def chain(fn: Callable = fn, count: int = len(layers)) -> torch.Tensor:
            x = x0
            for layer in layers[:count]:
                for name, (k, _) in SHAPES.items():
                    x = fn(x[:, :k], layer[name], name)
            return x

        out = chain(count=1).float()
        first = out if first is None else first
        ms = graph_ms(chain)
        print(f"| {spec} | {ms * 1000 / args.layers:.2f} | {float((out - first).norm() / first.norm()):.2e} |",
              flush=True)

if __name__ == "__main__":
    main()
