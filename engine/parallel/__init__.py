"""Tensor, pipeline and expert parallelism, applied to a built model from outside: the
model files have no distributed code.

How the pieces fit (`LLM(model, tensor_parallel_size=tp, pipeline_parallel_size=pp,
enable_expert_parallel=..., distributed_executor_backend="mp" | "ray")`):

  topology.py      the tp x pp grid: rank -> (pipeline stage, tensor rank, layers, KV
                   heads), and `check_model` (a ConfigError before any process starts).
                   Rank 0 is the driver and holds tensor rank 0 of the LAST stage.
  launch.py        `WorkerLauncher`: starts ranks 1..N-1 from JSON `WorkerSpec`s;
                   `ProcessLauncher` runs them as local processes ("mp");
                   cluster/ray_launcher.py as Ray actors ("ray", imported by name).
  worker.py        what ranks 1..N-1 run (`run_worker(spec)`): join, receive weights,
                   shard, then step on every message until STOP.
  groups.py        process groups over the driver's TCPStore (gloo on CPU, NCCL on GPUs),
                   built without a global default group.
  context.py       one rank's groups (control, world, tp) and `shard(model)`: pipeline
                   stage, then tensor split, then (enable_expert_parallel) the experts.
  tensor.py        `apply_tp`: column-parallel qkv / gate_up, row-parallel o / down
                   (+ all-reduce), vocab-parallel embedding and lm_head (layers.py).
  pipeline.py      `apply_pp` (keep this stage's layers), `run_stage`, micro-batches.
  messages.py      INIT / STEP / STOP from rank 0: JSON bytes broadcast as a uint8 tensor.
  stage_runner.py  one rank's part of a step, micro-batch by micro-batch: receive hidden
                   states, run its layers on its KV cache shard, send them on, or (last
                   stage) compute the logits.
  executor.py      the driver's side, EngineCore's Executor when tp x pp > 1: starts the
                   workers, loads and broadcasts the weights, each step broadcasts the
                   SchedulerOutput and returns the logits; a dead worker raises
                   WorkerDiedError.
  expert.py        expert parallelism for MoE models (shard_experts): over a stage's tp
                   ranks, each keeps num_experts / tp experts of every MoE layer.

A step on the driver: scheduler.schedule() -> executor.execute(): STEP broadcast on the
control group -> every rank's StageRunner runs its stage (first stage embeds, hidden
states and residual go stage to stage, tp ranks all-reduce within a stage) -> the last
stage's logits are gathered on rank 0 -> the sampler -> scheduler.update_from_output().
With tp = pp = 1 none of this is imported into the step: EngineCore's LocalExecutor runs ModelRunner.
"""

from vllm_cluster.engine.parallel.executor import ParallelExecutor
from vllm_cluster.engine.parallel.groups import Group, make_group
from vllm_cluster.engine.parallel.launch import ProcessLauncher, WorkerExit, WorkerLauncher, WorkerSpec
from vllm_cluster.engine.parallel.topology import Placement, Topology, check_model

__all__ = [
    "Group",
    "ParallelExecutor",
    "Placement",
    "ProcessLauncher",
    "Topology",
    "WorkerExit",
    "WorkerLauncher",
    "WorkerSpec",
    "check_model",
    "make_group",
]
