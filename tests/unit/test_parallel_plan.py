"""The pure parts of tensor/pipeline parallelism: config parsing, which rank holds what,
the model checks, micro-batches and the step message. No processes here (the real ones
run in tests/correctness/test_parallel.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from vllm_cluster.engine.block_pool import BlockId
from vllm_cluster.engine.config import EngineConfig
from vllm_cluster.engine.errors import ConfigError, WorkerDiedError
from vllm_cluster.engine.loader import ModelSource, load_model
from vllm_cluster.engine.models import ModelArchConfig
from vllm_cluster.engine.parallel.executor import ParallelExecutor
from vllm_cluster.engine.parallel.launch import WorkerExit, WorkerSpec
from vllm_cluster.engine.parallel.messages import (
    KVCacheInit,
    decode_init,
    decode_step,
    encode_init,
    encode_step,
    kv_cache_dtype_of,
)
from vllm_cluster.engine.parallel.pipeline import split_micro_batches
from vllm_cluster.engine.parallel.topology import Topology, check_model, kv_heads_of
from vllm_cluster.engine.request import RequestId
from vllm_cluster.engine.scheduler_output import ScheduledRequest, SchedulerOutput

SMOLLM2 = dict(
    vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
    num_attention_heads=9, num_key_value_heads=3, head_dim=64,
)


def _arch(**overrides: Any) -> ModelArchConfig:
    return ModelArchConfig.from_hf_dict({**SMOLLM2, **overrides})


# --- config ---------------------------------------------------------------------------


def test_yaml_parallel_section_and_flat_kwargs(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text("engine:\n  device: cpu\n  parallel:\n    tensor_parallel_size: 2\n    pipeline_parallel_size: 3\n")
    config = EngineConfig.from_yaml(path)
    assert (config.parallel.tensor_parallel_size, config.parallel.pipeline_parallel_size) == (2, 3)
    assert config.parallel.world_size == 6
    flat = EngineConfig.from_kwargs("m", tensor_parallel_size=2, pipeline_parallel_size=3, device="cpu")
    assert flat.parallel == config.parallel
    assert EngineConfig().parallel.world_size == 1


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({"parallel": {"tensor_parallel_size": 0}}, r"parallel\.tensor_parallel_size: 0 must be >= 1"),
        ({"parallel": {"pipeline_parallel_size": -1}}, r"parallel\.pipeline_parallel_size: -1 must be >= 1"),
        ({"parallel": {"distributed_timeout_s": 0}}, r"parallel\.distributed_timeout_s: 0"),
        ({"parallel": {"tensor_parallel_size": "2"}}, r"parallel\.tensor_parallel_size: '2' has type str"),
        ({"parallel": {"data_parallel_size": 2}}, r"unknown key parallel\.data_parallel_size"),
        (
            {"parallel": {"pipeline_parallel_size": 2}, "role": "prefill"},
            "role 'prefill' splits by tensor parallelism only",
        ),
        ({"parallel": {"pipeline_parallel_size": 2}, "device": "cuda:1"}, "use device: cuda"),
    ],
)
def test_bad_parallel_config_says_what_to_change(data: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        EngineConfig.from_dict(data)


# --- the model checks -----------------------------------------------------------------


def test_tp_must_divide_the_heads() -> None:
    with pytest.raises(ConfigError, match=r"tensor_parallel_size 2: it must divide num_attention_heads \(9\); "
                       r"for this model use one of \[1, 3\]"):
        check_model(_arch(), 2, 1)
    check_model(_arch(), 3, 1)


def test_kv_heads_split_or_replicated() -> None:
    # 8 query heads over 4 KV heads: tp 2 splits them, tp 8 replicates each on 2 ranks,
    # tp 4 gives one each; 3 KV heads cannot serve tp 2 (neither divides the other).
    arch = _arch(num_attention_heads=8, num_key_value_heads=4, intermediate_size=64)
    for tp in (1, 2, 4, 8):
        check_model(arch, tp, 1)
    assert [kv_heads_of(r, 2, 4) for r in range(2)] == [range(0, 2), range(2, 4)]
    assert [kv_heads_of(r, 8, 4) for r in range(8)] == [range(h, h + 1) for h in (0, 0, 1, 1, 2, 2, 3, 3)]
    with pytest.raises(
        ConfigError,
        match=r"tensor_parallel_size 2: KV heads are split across ranks or replicated, so it must divide "
        r"num_key_value_heads \(3\) or be a multiple of it; for this model use one of \[1, 3, 6\]",
    ):
        check_model(_arch(num_attention_heads=6, num_key_value_heads=3), 2, 1)


def test_tp_must_divide_the_intermediate_size() -> None:
    with pytest.raises(ConfigError, match=r"intermediate_size \(1537\)"):
        check_model(_arch(intermediate_size=1537), 3, 1)


def test_pp_at_most_the_layers() -> None:
    check_model(_arch(), 1, 30)
    with pytest.raises(ConfigError, match="pipeline_parallel_size 31 exceeds the model's 30 layers: use at most 30"):
        check_model(_arch(), 1, 31)


# --- the grid -------------------------------------------------------------------------


def test_rank_zero_holds_the_last_stage() -> None:
    grid = Topology(tensor_parallel_size=2, pipeline_parallel_size=3, num_layers=10)
    places = [grid.place(r) for r in range(grid.world_size)]
    assert [(p.stage, p.tp_rank) for p in places] == [(2, 0), (2, 1), (0, 0), (0, 1), (1, 0), (1, 1)]
    assert [p.layers for p in places[::2]] == [range(7, 10), range(0, 4), range(4, 7)]
    assert places[0].is_last_stage and places[2].is_first_stage and not places[4].is_first_stage
    assert grid.stage_ranks(0) == [2, 3] and grid.stage_ranks(2) == [0, 1]
    for rank in range(grid.world_size):
        place = grid.place(rank)
        assert grid.rank_of(place.stage, place.tp_rank) == rank


def test_single_stage_is_the_usual_layout() -> None:
    grid = Topology(tensor_parallel_size=4, pipeline_parallel_size=1, num_layers=2)
    assert [(grid.place(r).stage, grid.place(r).tp_rank) for r in range(4)] == [(0, r) for r in range(4)]
    assert grid.place(3).layers == range(0, 2)


def test_layers_cover_the_model_once() -> None:
    for num_layers in (1, 7, 30):
        for pp in range(1, num_layers + 1):
            grid = Topology(1, pp, num_layers)
            layers = [i for s in range(pp) for i in grid.stage_layers(s)]
            assert layers == list(range(num_layers))
            sizes = [len(grid.stage_layers(s)) for s in range(pp)]
            assert max(sizes) - min(sizes) <= 1 and min(sizes) >= 1


# --- micro-batches --------------------------------------------------------------------


def _item(rid: str, num_tokens: int, samples: bool = True) -> ScheduledRequest:
    return ScheduledRequest(RequestId(rid), list(range(num_tokens)), 0, [BlockId(1)], True, samples)


def test_micro_batches_are_contiguous_and_balanced() -> None:
    items = [_item("a", 40), _item("b", 1), _item("c", 1), _item("d", 38)]
    assert [[i.request_id for i in mb] for mb in split_micro_batches(items, 2)] == [["a"], ["b", "c", "d"]]
    assert [len(mb) for mb in split_micro_batches(items, 4)] == [1, 1, 1, 1]
    assert split_micro_batches(items, 1) == [items]
    decode = [_item(str(i), 1) for i in range(7)]
    assert [len(mb) for mb in split_micro_batches(decode, 3)] == [3, 2, 2]


def test_micro_batches_never_empty() -> None:
    for sizes in ([1], [100, 1], [1, 100], [5, 5, 5], [1, 1, 1, 1, 90]):
        items = [_item(str(i), n) for i, n in enumerate(sizes)]
        for num in range(1, 6):
            chunks = split_micro_batches(items, num)
            assert len(chunks) == min(num, len(items))
            assert all(chunks) and [i for mb in chunks for i in mb] == items


# --- what crosses processes -----------------------------------------------------------


def test_step_message_round_trips() -> None:
    output = SchedulerOutput(
        scheduled=[
            ScheduledRequest(RequestId("r-1"), [5, 6, 7], 16, [BlockId(3), BlockId(9)], True, False),
            ScheduledRequest(RequestId("é\"x"), [1], 40, [], False, True),
        ],
        num_scheduled_tokens=4,
        removed_request_ids=frozenset({RequestId("gone"), RequestId("old")}),
    )
    assert decode_step(encode_step(output)) == output
    init = KVCacheInit(num_blocks=100, block_size=16, max_model_len=2048, kv_cache_dtype="float8_e4m3fn")
    assert decode_init(encode_init(init)) == init
    assert kv_cache_dtype_of(init) == torch.float8_e4m3fn


def test_worker_spec_round_trips_as_json() -> None:
    spec = WorkerSpec(1, 4, 2, 2, "127.0.0.1", 1234, "127.0.0.1", "cpu", "float32", 1, 30.0, dict(SMOLLM2))
    assert WorkerSpec.from_json(spec.to_json()) == spec
    with pytest.raises(ValueError, match="exactly the keys"):
        WorkerSpec.from_json('{"rank": 1}')


class _DeadLauncher:
    """Workers that exit before joining: the executor must say so rather than wait."""

    def start(self, specs: Any) -> None:
        self.ranks = [spec.rank for spec in specs]

    def exited(self) -> list[WorkerExit]:
        return [WorkerExit(rank, "exited with code 3") for rank in self.ranks]

    def stop(self, timeout_s: float) -> None:
        pass


def test_worker_that_dies_at_start_is_reported() -> None:
    tiny = {**SMOLLM2, "vocab_size": 64, "hidden_size": 24, "intermediate_size": 48, "num_hidden_layers": 2,
            "num_attention_heads": 3, "num_key_value_heads": 3, "head_dim": 8}
    source = ModelSource("dummy", None, tiny)
    model = load_model(source, torch.float32, torch.device("cpu"))
    config = EngineConfig.from_kwargs("x", load_format="dummy", device="cpu", tensor_parallel_size=3)
    with pytest.raises(WorkerDiedError, match=r"rank 1 \(pipeline stage 0, tensor rank 1\) exited with code 3; "
                       r"rank 2 .* exited with code 3"):
        ParallelExecutor.start(config, source, torch.float32, torch.device("cpu"), model, launcher=_DeadLauncher())
