"""A rank other than 0: `python -m engine.parallel.worker SPEC_JSON`, or `run_worker(spec)`
from a Ray actor.

Lifecycle:
  1. join the driver's store, say hello, build the process groups;
  2. build the model with empty weights, receive rank 0's, keep this rank's shard;
  3. receive INIT, allocate this rank's KV cache, meet the others at a barrier;
  4. run this rank's part of every STEP (and KV move, kv_mirror.py), in order, until STOP.
An error is written to the store (`error/<rank>`) for the driver to report, and ends the
process; the driver going away ends it too (its sockets close, the wait fails).
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import sys

import torch
import torch.distributed as dist

from vllm_cluster.engine.loader import build_model
from vllm_cluster.engine.models import ModelArchConfig
from vllm_cluster.engine.parallel.context import ParallelContext
from vllm_cluster.engine.parallel.groups import join_store
from vllm_cluster.engine.parallel.launch import WorkerSpec, error_key, hello_key
from vllm_cluster.engine.parallel.messages import (
    ControlChannel,
    Kind,
    decode_block_ids,
    decode_init,
    decode_step,
    kv_cache_dtype_of,
)
from vllm_cluster.engine.parallel.stage_runner import StageRunner
from vllm_cluster.engine.parallel.topology import Topology

logger = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def run_worker(spec: WorkerSpec) -> None:
    torch.set_num_threads(spec.num_threads)
    device = torch.device(spec.device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    timeout = datetime.timedelta(seconds=spec.timeout_s)
    store = join_store(spec.store_host, spec.store_port, spec.world_size, timeout)
    try:
        _serve(spec, store, device, timeout)
    except BaseException as e:
        _report(store, spec.rank, e)
        raise


def _serve(spec: WorkerSpec, store: dist.Store, device: torch.device, timeout: datetime.timedelta) -> None:
    arch = ModelArchConfig.from_hf_dict(spec.hf_config)
    topology = Topology(
        spec.tensor_parallel_size, spec.pipeline_parallel_size, arch.num_hidden_layers, spec.enable_expert_parallel
    )
    store.set(hello_key(spec.rank), "1")
    ctx = ParallelContext.create(store, topology, spec.rank, device, timeout, spec.host)
    dtype = DTYPES[spec.dtype]
    model = build_model(arch, dtype, device)
    ctx.broadcast_weights(model)
    ctx.shard(model)
    model.eval()
    channel = ControlChannel(ctx.control)
    kind, payload = channel.receive()
    if kind == Kind.STOP:  # the driver gave up before allocating the KV cache
        return
    assert kind == Kind.INIT, kind
    init = decode_init(payload)
    runner = StageRunner(
        model, ctx, init.num_blocks, init.block_size, init.max_model_len, dtype, kv_cache_dtype_of(init)
    )
    ctx.control.barrier()
    logger.info("rank %d ready: stage %d, layers %s, tensor rank %d",
                spec.rank, ctx.place.stage, ctx.place.layers, ctx.place.tp_rank)
    while True:
        kind, payload = channel.receive()
        if kind == Kind.STOP:
            return
        if kind == Kind.STEP:
            runner.execute(decode_step(payload))
        elif kind == Kind.GATHER_KV:
            with torch.inference_mode():
                runner.kv_mirror().gather(decode_block_ids(payload))
        else:
            assert kind == Kind.SCATTER_KV, kind
            with torch.inference_mode():
                runner.kv_mirror().scatter(decode_block_ids(payload))


def _report(store: dist.Store, rank: int, error: BaseException) -> None:
    with contextlib.suppress(Exception):  # the driver (and its store) may be gone already
        store.set(error_key(rank), f"{type(error).__name__}: {error}")


def main() -> None:
    if len(sys.argv) != 2:
        sys.exit("usage: python -m engine.parallel.worker SPEC_JSON (started by the engine, not by hand)")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    run_worker(WorkerSpec.from_json(sys.argv[1]))


if __name__ == "__main__":
    main()
