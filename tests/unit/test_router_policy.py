from __future__ import annotations

import pytest

from vllm_cluster.engine.errors import ConfigError
from vllm_cluster.router.handoff import Handoff, HandoffState, InvalidTransition
from vllm_cluster.router.policy import (
    InstanceLoad,
    PrefixWeights,
    least_loaded,
    power_of_two,
    prefix_aware,
    rank,
    round_robin,
    should_skip_prefill,
)
from vllm_cluster.worker.router_config import RouterConfig


def _load(name: str, inflight: int = 0, waiting: int = 0, usage: float = 0.0, healthy: bool = True) -> InstanceLoad:
    return InstanceLoad(name, healthy, inflight, num_waiting=waiting, kv_cache_usage=usage)


def test_least_loaded_orders_by_queue_then_cache_and_drops_unhealthy() -> None:
    loads = [_load("a", inflight=2), _load("b", waiting=1, usage=0.5), _load("c", usage=0.9), _load("d", healthy=False)]
    assert least_loaded(loads) == ["c", "b", "a"]


def test_round_robin_rotates_over_healthy_only() -> None:
    loads = [_load("a"), _load("b", healthy=False), _load("c")]
    assert round_robin(loads, 0) == ["a", "c"]
    assert round_robin(loads, 1) == ["c", "a"]
    assert round_robin(loads, 2) == ["a", "c"]
    assert round_robin([_load("x", healthy=False)], 3) == []
    assert rank("round_robin", loads, 1) == ["c", "a"]


def test_skip_prefill_threshold() -> None:
    assert should_skip_prefill(num_prompt_tokens=20, num_cached_tokens=0, min_prefill_tokens=32)
    assert not should_skip_prefill(100, 0, 32)
    assert should_skip_prefill(100, 80, 32)  # decode holds nearly all of it
    assert not should_skip_prefill(1, 0, 0)  # 0: always prefill


def test_handoff_transitions_and_idempotent_abort() -> None:
    h = Handoff("r")
    released: list[str] = []
    assert h.advance(HandoffState.RESERVED)
    h.on_abort(lambda: released.append("decode"))
    assert h.advance(HandoffState.PREFILLING)
    h.on_abort(lambda: released.append("prefill"))
    with pytest.raises(InvalidTransition):
        h.advance(HandoffState.FINISHED)
    assert h.abort("client went away")
    assert released == ["prefill", "decode"]  # newest leg first
    assert not h.abort("again") and released == ["prefill", "decode"]
    assert not h.advance(HandoffState.TRANSFERRED)  # the caller learns it was aborted
    assert not h.on_abort(lambda: released.append("late"))  # registered after abort: runs now
    assert released[-1] == "late"


def test_finished_handoff_releases_nothing() -> None:
    h = Handoff("r")
    released: list[str] = []
    h.advance(HandoffState.RESERVED)
    h.on_abort(lambda: released.append("decode"))
    h.advance(HandoffState.DECODING)  # prefill skipped
    h.advance(HandoffState.FINISHED)
    assert not h.abort("late abort") and released == []


def test_abort_survives_a_failing_release() -> None:
    h = Handoff("r")
    h.advance(HandoffState.RESERVED)

    def dead() -> None:
        raise ConnectionError("instance is gone")

    h.on_abort(dead)
    assert h.abort("deadline") and h.state == HandoffState.ABORTED


def test_abort_remembers_a_passed_deadline() -> None:
    h = Handoff("r")
    assert h.abort("deadline of 1s passed", deadline_passed=True) and h.deadline_passed
    assert not h.abort("the client went away")  # the first reason stands: the client hears DEADLINE_EXCEEDED
    assert h.deadline_passed and h.abort_reason == "deadline of 1s passed"


def test_router_config_errors_name_the_key() -> None:
    with pytest.raises(ConfigError, match="router.policy"):
        RouterConfig.from_dict({"policy": "random"})
    with pytest.raises(ConfigError, match="unknown key"):
        RouterConfig.from_dict({"polcy": "round_robin"})
    assert RouterConfig.from_dict(None).on_transfer_failure == "recompute"


def test_power_of_two_picks_the_lighter_of_two_random() -> None:
    import random

    loads = [_load("a", inflight=5), _load("b", inflight=1), _load("c", inflight=3), _load("d", healthy=False)]
    firsts = {power_of_two(loads, random.Random(seed))[0] for seed in range(50)}
    assert "a" not in firsts  # a is never the lighter of any pair
    assert firsts <= {"b", "c"}
    assert sorted(power_of_two(loads, random.Random(1))) == ["a", "b", "c"]


def test_prefix_aware_prefers_overlap_then_load_with_random_ties() -> None:
    import random

    weights = PrefixWeights(overlap=2.0, usage=1.0, load=1.0)
    holder = InstanceLoad("holder", True, 1, num_cached_blocks=60, kv_cache_usage=0.3)
    idle = InstanceLoad("idle", True, 0)
    assert prefix_aware([idle, holder], 64, weights, random.Random(0))[0] == "holder"
    # Overloaded enough, the holder loses to an idle instance.
    swamped = InstanceLoad("holder", True, 40, num_waiting=40, num_cached_blocks=8, kv_cache_usage=0.95)
    assert prefix_aware([idle, swamped], 64, weights, random.Random(0))[0] == "idle"
    # Equal instances: ties broken at random, so both get picked.
    twins = [InstanceLoad("x", True, 0), InstanceLoad("y", True, 0)]
    assert {prefix_aware(twins, 64, weights, random.Random(s))[0] for s in range(20)} == {"x", "y"}
    assert prefix_aware([InstanceLoad("z", False, 0)], 64, weights, random.Random(0)) == []


def test_prefix_aware_scores_device_over_host_over_disk_over_miss() -> None:
    import random

    weights = PrefixWeights()
    loads = [
        InstanceLoad("miss", True, 1),
        InstanceLoad("disk", True, 1, num_disk_blocks=32),
        InstanceLoad("host", True, 1, num_host_blocks=32),
        InstanceLoad("device", True, 1, num_cached_blocks=32),
    ]
    assert prefix_aware(loads, 32, weights, random.Random(0)) == ["device", "host", "disk", "miss"]
    # A prefix split between the device and the host tier beats a shorter one wholly on the device.
    split = InstanceLoad("split", True, 1, num_cached_blocks=8, num_host_blocks=24)
    short = InstanceLoad("short", True, 1, num_cached_blocks=16)
    assert prefix_aware([short, split], 32, weights, random.Random(0))[0] == "split"
    with pytest.raises(AssertionError):
        PrefixWeights(host=0.2, disk=0.5)
