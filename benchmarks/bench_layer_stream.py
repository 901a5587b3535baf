"""What a persistent kernel over a decode layer, or a deeper PDL prologue, could give,
measured on reads alone (H200).

Batch-1 INT4 decode is a chain of GEMVs, each one kernel: a kernel ramps up, drains, and
hands over to the next under PDL (kernels/sync/pdl.py). Two designs could keep the memory busy
across those hand-overs: a persistent kernel running a layer's four projections in one
launch, its programs meeting at a grid barrier between them; or each kernel reading more of
its weights before its PDL wait, while the kernel before drains. This benchmark bounds both
before anyone builds them: every projection is replaced by a plain read of its packed INT4
weight (llama-3.1-8b: qkv, o, gate_up, down; 109 MB a layer), and one run times, over 32
layers of distinct weights (3.5 GB, no L2 reuse), per config (programs an SM x warps x
16-byte loads a thread a step) and `--ahead` (steps a program reads before it waits):

- `launches`: four read kernels a layer under PDL, as the GEMVs are launched: a program
  reads its first `ahead` steps before `gdc_wait`, then x (8 KB, as a GEMV must), then the
  rest, and lets the next kernel launch once its loop is done (the INT4 GEMV's late
  trigger). `--hold R`: each thread also keeps R registers from before the wait to the end,
  as a GEMV's fragments and accumulators do, which decides whether the kernel after can be
  resident (and reading) beside it;
- `barriers`: one kernel for all layers (or `--layers-per-launch`), its programs meeting at
  a grid barrier between the projections (an arrival counter; the last to arrive raises a
  flag on another line that the others poll); a program reads its first `ahead` steps of
  the next projection before it waits at the barrier. Run only where every program fits on
  the SMs at once;
- `stream`: the same kernel without the barriers: the reads with no dependence at all.

    PYTHONPATH=. python benchmarks/bench_layer_stream.py --configs 8x4x2,1x16x4,2x8x2 --ahead 1,4 --hold 0,64
"""

from __future__ import annotations

import argparse
import itertools
import statistics

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

# Packed INT4 bytes of a llama-3.1-8b layer's projections (N x K / 2).
SHAPES = {"qkv": 6144 * 4096 // 2, "o": 4096 * 4096 // 2, "gate_up": 28672 * 4096 // 2, "down": 4096 * 14336 // 2}
X_WORDS = 2048  # x: 4096 bf16


@triton.jit
def _read_step(w_ptr, start, num_words, CHUNK: tl.constexpr):
    offs = start + tl.arange(0, CHUNK)
    return tl.load(w_ptr + offs, mask=offs < num_words, other=0)


@triton.jit
def _read_first(w_ptr, num_words, CHUNK: tl.constexpr, AHEAD: tl.constexpr):
    """The program's first AHEAD steps ([AHEAD, CHUNK] words; grid-stride, CHUNK words a step)."""
    stride = tl.num_programs(0) * CHUNK
    offs = tl.program_id(0) * CHUNK + tl.arange(0, AHEAD)[:, None] * stride + tl.arange(0, CHUNK)[None, :]
    return tl.load(w_ptr + offs, mask=offs < num_words, other=0)


@triton.jit
def _read_rest(w_ptr, num_words, acc, first, CHUNK: tl.constexpr, AHEAD: tl.constexpr):
    """The program's steps after its first AHEAD, folded into acc with `first`."""
    pid = tl.program_id(0)
    stride = tl.num_programs(0) * CHUNK
    for start in range(pid * CHUNK + AHEAD * stride, num_words, stride):
        acc ^= _read_step(w_ptr, start, num_words, CHUNK)
    return acc ^ tl.reduce(first, 0, _xor)


@triton.jit
def _xor(a, b):
    return a ^ b


@triton.jit
def _launch_kernel(w_ptr, x_ptr, y_ptr, num_words, CHUNK: tl.constexpr, AHEAD: tl.constexpr,
                   HOLD: tl.constexpr = 0):  # fmt: skip
    """One projection a launch, under PDL as the INT4 GEMV: first step, wait, x, the rest, trigger.
    HOLD: words a program keeps in registers from before the wait to the end (a GEMV's
    registers, which decide how many of its programs an SM holds beside the kernel before)."""
    pid = tl.program_id(0)
    first = _read_first(w_ptr, num_words, CHUNK, AHEAD)
    if HOLD > 0:
        held = tl.load(x_ptr + tl.arange(0, HOLD) % 2048, volatile=True)
    gdc_wait()
    acc = tl.load(x_ptr + tl.arange(0, CHUNK) % 2048)
    acc = _read_rest(w_ptr, num_words, acc, first, CHUNK, AHEAD)
    gdc_launch_dependents()
    total = tl.sum(acc, axis=0)
    if HOLD > 0:
        total ^= tl.reduce(held, 0, _xor)
    tl.store(y_ptr + pid, total)


@triton.jit
def _barrier(counter_ptr, target):
    """Arrive at the grid barrier and wait until `target` programs have arrived: the last to
    arrive raises a flag on another line (counter_ptr + 32), which the others poll, so the
    polls do not queue behind the arrivals' atomics."""
    old = tl.atomic_add(counter_ptr, 1, sem="acq_rel", scope="gpu")
    if old == target - 1:
        tl.atomic_xchg(counter_ptr + 32, target, sem="release", scope="gpu")
    seen = tl.atomic_add(counter_ptr + 32, 0, sem="acquire", scope="gpu")
    while seen < target:
        seen = tl.atomic_add(counter_ptr + 32, 0, sem="acquire", scope="gpu")


@triton.jit
def _phase(w_ptr, x_ptr, counter_ptr, acc, phase, programs, WORDS: tl.constexpr, CHUNK: tl.constexpr,
           BARRIER: tl.constexpr, AHEAD: tl.constexpr):  # fmt: skip
    """One projection of the persistent kernel: its first step, the barrier, x, the rest."""
    first = _read_first(w_ptr, WORDS, CHUNK, AHEAD)
    if BARRIER:
        if phase > 0:
            _barrier(counter_ptr, phase * programs)
        acc ^= tl.load(x_ptr + tl.arange(0, CHUNK) % 2048)
    return _read_rest(w_ptr, WORDS, acc, first, CHUNK, AHEAD)


@triton.jit
def _layers_kernel(
    w_ptr, x_ptr, y_ptr, counter_ptr, layer_words,
    QKV: tl.constexpr, O_WORDS: tl.constexpr, GATE_UP: tl.constexpr, DOWN: tl.constexpr,
    LAYERS: tl.constexpr, CHUNK: tl.constexpr, BARRIER: tl.constexpr, AHEAD: tl.constexpr = 1,
):  # fmt: skip
    """LAYERS layers' four projections in one launch; with BARRIER the programs meet between them."""
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    acc = tl.load(x_ptr + tl.arange(0, CHUNK) % 2048)
    for layer in range(LAYERS):
        base = w_ptr + layer.to(tl.int64) * layer_words
        phase = layer * 4
        acc = _phase(base, x_ptr, counter_ptr, acc, phase, programs, QKV, CHUNK, BARRIER, AHEAD)
        acc = _phase(base + QKV, x_ptr, counter_ptr, acc, phase + 1, programs, O_WORDS, CHUNK, BARRIER, AHEAD)
        acc = _phase(base + QKV + O_WORDS, x_ptr, counter_ptr, acc, phase + 2, programs, GATE_UP, CHUNK, BARRIER, AHEAD)
        acc = _phase(base + QKV + O_WORDS + GATE_UP, x_ptr, counter_ptr, acc, phase + 3, programs, DOWN, CHUNK,
                     BARRIER, AHEAD)
    tl.store(y_ptr + pid, tl.sum(acc, axis=0))


def graph_ms(fn, replays: int = 20) -> float:
    """Median ms of `replays` replays of one CUDA graph of fn (one call warms it up first)."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def _resident(kernel, num_warps: int) -> int:
    """Programs of a compiled kernel an SM holds at once (registers and threads; no shared memory)."""
    kernel._init_handles()  # loads the module: n_regs is known from here
    regs_per_warp = -(-kernel.n_regs * 32 // 256) * 256
    return min(65536 // (regs_per_warp * num_warps), 64 // num_warps, 32)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--configs", default="8x4x2,1x16x4",
                        help="programs an SM x warps a program x 16-byte loads a thread a step, comma-separated")
    parser.add_argument("--ahead", default="1,4",
                        help="steps a program reads before its wait or barrier, comma-separated")
    parser.add_argument("--hold", default="0", help="`launches`: registers a thread holds throughout, comma-separated")
    parser.add_argument("--variants", default="launches,stream,barriers")
    parser.add_argument("--layers-per-launch", default="32", help="for `barriers`, comma-separated")
    args = parser.parse_args()

    sms = torch.cuda.get_device_properties(0).multi_processor_count
    words = {name: size // 4 for name, size in SHAPES.items()}
    layer_words = sum(words.values())
    layers = args.layers
    w = torch.randint(-(2**31), 2**31 - 1, (layers, layer_words), dtype=torch.int32, device="cuda")
    x = torch.randint(0, 100, (X_WORDS,), dtype=torch.int32, device="cuda")
    offsets = dict(zip(SHAPES, itertools.accumulate([0, *list(words.values())[:-1]]), strict=True))
    shape_args = {"QKV": words["qkv"], "O_WORDS": words["o"], "GATE_UP": words["gate_up"], "DOWN": words["down"]}
    layer_mb = layer_words * 4 / 1e6
    variants = args.variants.split(",")
    print(f"{layers} layers of {layer_mb:.1f} MB ({', '.join(f'{k} {v * 4 / 1e6:.1f}' for k, v in words.items())})")
    print("| variant | programs/SM x warps x loads a step x steps ahead | registers | ms (all layers) "
          "| us a layer | TB/s |")
    print("|---|---|---|---|---|---|")

    for spec, ahead in itertools.product(args.configs.split(","), (int(a) for a in args.ahead.split(","))):
        pps, num_warps, unroll = (int(v) for v in spec.split("x"))
        chunk = num_warps * 32 * 4 * unroll
        grid = (sms * pps,)
        y = torch.empty(grid[0], dtype=torch.int32, device="cuda")
        counters = torch.zeros(layers, 64, dtype=torch.int32, device="cuda")
        label = f"{spec}x{ahead}"

        def row(name: str, regs: int, ms: float, label: str = label) -> None:
            us = ms * 1000 / layers
            print(f"| {name} | {label} | {regs} | {ms:.3f} | {us:.2f} | {layer_mb / us:.2f} |", flush=True)

        def launches(hold: int, grid=grid, y=y, chunk=chunk, ahead=ahead, num_warps=num_warps) -> None:  # noqa: ANN001
            for layer in range(layers):
                for name in SHAPES:
                    sub = w[layer, offsets[name] : offsets[name] + words[name]]
                    _launch_kernel[grid](sub, x, y, words[name], CHUNK=chunk, AHEAD=ahead, HOLD=hold,
                                         num_warps=num_warps, launch_pdl=True)  # fmt: skip

        def persistent(per_launch: int, barrier: bool, grid=grid, y=y, chunk=chunk, ahead=ahead,  # noqa: ANN001
                       num_warps=num_warps, counters=counters) -> None:  # fmt: skip
            counters.zero_()
            for first in range(0, layers, per_launch):
                _layers_kernel[grid](w[first], x, y, counters[first // per_launch], layer_words, **shape_args,
                                     LAYERS=per_launch, CHUNK=chunk, BARRIER=barrier, AHEAD=ahead,
                                     num_warps=num_warps)  # fmt: skip

        def compiled(kernel, *call_args, grid=grid, num_warps=num_warps, **kwargs):  # noqa: ANN001, ANN202
            handle = kernel.warmup(*call_args, grid=grid, num_warps=num_warps, **kwargs)
            return handle, _resident(handle, num_warps)

        if "launches" in variants:
            for hold in (int(h) * 32 * num_warps for h in args.hold.split(",")):
                handle, _ = compiled(_launch_kernel, w[0], x, y, words["qkv"], CHUNK=chunk, AHEAD=ahead, HOLD=hold)
                row(f"launches (PDL), {hold // (32 * num_warps)} registers held", handle.n_regs,
                    graph_ms(lambda hold=hold: launches(hold)))  # fmt: skip
        if "stream" in variants:
            handle, _ = compiled(_layers_kernel, w[0], x, y, counters[0], layer_words, **shape_args, LAYERS=layers,
                                 CHUNK=chunk, BARRIER=False, AHEAD=ahead)  # fmt: skip
            row(f"stream (no barriers, {layers} layers a launch)", handle.n_regs,
                graph_ms(lambda: persistent(layers, False)))
        for per_launch in (int(v) for v in args.layers_per_launch.split(",")) if "barriers" in variants else ():
            handle, resident = compiled(_layers_kernel, w[0], x, y, counters[0], layer_words, **shape_args,
                                        LAYERS=per_launch, CHUNK=chunk, BARRIER=True, AHEAD=ahead)  # fmt: skip
            if resident < pps:  # a grid barrier needs every program resident
                print(f"| barriers, {per_launch} layer(s) a launch | {label} | {handle.n_regs} | not run: "
                      f"{resident} programs an SM fit | | |")  # fmt: skip
                continue
            row(f"barriers, {per_launch} layer(s) a launch", handle.n_regs,
                graph_ms(lambda n=per_launch: persistent(n, True)))  # fmt: skip


if __name__ == "__main__":
    main()
