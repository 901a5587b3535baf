"""Ray as the offline LLM's launcher: `LLM(..., distributed_executor_backend="ray")` runs
ranks 1..N-1 as Ray actors in one placement group, on a local Ray on loopback that the
launcher starts (CPU bundles, gloo).

SmolLM2-135M at tensor_parallel_size=3 (its 9 query heads and 3 KV heads allow 1 and 3,
not 2) gives the same greedy tokens as one process; a rank whose actor process is killed
fails the next step naming that rank; and after shutdown no actor, rank or Ray process is
left. One LLM for the module (Ray's start costs seconds on 2 cores); the tests run in order.
"""

from __future__ import annotations

import importlib.util
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from vllm_cluster.cluster.procs import ProcessRef, wait_gone
from vllm_cluster.cluster.ray_launcher import RayLauncher
from vllm_cluster.engine import LLM, SamplingParams
from vllm_cluster.engine.errors import WorkerDiedError
from vllm_cluster.engine.outputs import RequestOutput

pytestmark = pytest.mark.slow

if importlib.util.find_spec("ray") is None:
    pytest.skip("needs the ray package", allow_module_level=True)

BUDGET = 32
PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village by the sea, there lived an old fisherman who "
    "every morning rowed out past the lighthouse and",  # longer than BUDGET: chunked
]
PARAMS = SamplingParams(temperature=0.0, max_tokens=8)


def _tokens(outputs: list[RequestOutput]) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


def _descendants(pid: int) -> set[ProcessRef]:
    """Every live process below `pid` (children, their children, ...)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            fields = stat[stat.rindex(")") + 2 :].split()
            if fields[0] != "Z":
                children.setdefault(int(fields[1]), []).append(int(entry.name))
    found, todo = set(), [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.add(ProcessRef.of(child))
            todo.append(child)
    return {ref for ref in found if ref.alive()}


def _ray_is_connected() -> bool:
    # Not imported here: the launcher imports Ray itself, after setting up a local one.
    return "ray" in sys.modules and bool(sys.modules["ray"].is_initialized())


@pytest.fixture(scope="module")
def before() -> set[ProcessRef]:
    assert not _ray_is_connected(), "another test left Ray connected"
    return _descendants(os.getpid())


@pytest.fixture(scope="module")
def under_ray(smollm2: LLM, before: set[ProcessRef]) -> Iterator[LLM]:
    llm = smollm2.derive(
        max_num_batched_tokens=BUDGET, tensor_parallel_size=3, distributed_executor_backend="ray", num_threads=1
    )
    yield llm
    llm.core.shutdown()
    torch.set_num_threads(2)


def _launcher(llm: LLM) -> RayLauncher:
    executor = llm.core.executor
    assert executor is not None and isinstance(executor.launcher, RayLauncher)
    return executor.launcher


def test_tp3_under_ray_equals_one_process(smollm2: LLM, under_ray: LLM) -> None:
    want = _tokens(smollm2.derive(max_num_batched_tokens=BUDGET).generate(PROMPTS, PARAMS, use_tqdm=False))
    assert _tokens(under_ray.generate(PROMPTS, PARAMS, use_tqdm=False)) == want
    launcher = _launcher(under_ray)
    pids = {launcher.pid(rank) for rank in (1, 2)}
    assert len(pids) == 2 and os.getpid() not in pids  # each rank in an actor process of its own
    assert _ray_is_connected()
    groups = sys.modules["ray"].util.placement_group_table().values()
    assert [len(g["bundles"]) for g in groups if g["state"] == "CREATED"] == [3]  # one bundle per rank


def test_dead_rank_fails_the_step_by_name(under_ray: LLM) -> None:
    """It breaks the engine for good: the next test checks what shutdown leaves."""
    os.kill(_launcher(under_ray).pid(2), signal.SIGKILL)
    message = r"rank 2 \(pipeline stage 0, tensor rank 2\) died with its Ray actor"
    with pytest.raises(WorkerDiedError, match=message):
        under_ray.generate(PROMPTS, PARAMS, use_tqdm=False)
    with pytest.raises(WorkerDiedError, match=message):  # and stays failed
        under_ray.generate(PROMPTS, PARAMS, use_tqdm=False)


def test_shutdown_leaves_no_actor_or_process(under_ray: LLM, before: set[ProcessRef]) -> None:
    pids = [ProcessRef.of(_launcher(under_ray).pid(rank)) for rank in (1, 2)]
    under_ray.core.shutdown()
    assert not _ray_is_connected()  # the Ray the launcher started is stopped
    assert wait_gone(pids, 10.0)
    left = _descendants(os.getpid()) - before
    assert wait_gone(left, 10.0), f"left behind: {[(r.pid, _cmdline(r.pid)) for r in left if r.alive()]}"


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()[:120]
    except OSError:
        return "?"


def test_engine_never_imports_ray() -> None:
    code = (
        "import sys, engine, engine.llm, engine.parallel.worker, engine.parallel.executor\n"
        "assert 'ray' not in sys.modules and 'cluster' not in sys.modules, sorted(sys.modules)\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
