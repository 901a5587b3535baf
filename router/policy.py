"""Routing decisions as pure functions over a snapshot of instance load. No I/O here: the
router's shell gathers the snapshot and acts on the answer, so every rule is tested alone.
The Redis prefix index adds prefix overlap to `score` in a later step."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class InstanceLoad:
    name: str
    healthy: bool
    num_inflight: int  # requests this router has on it now (always fresh)
    num_waiting: int = 0  # from the instance's last Stats (may be a moment old)
    num_running: int = 0
    kv_cache_usage: float = 0.0  # 0..1


def score(load: InstanceLoad) -> float:
    """Lower is better: queued work first, then how full the KV cache is."""
    return load.num_inflight + load.num_waiting + load.kv_cache_usage


def least_loaded(loads: Sequence[InstanceLoad]) -> list[str]:
    """Healthy instances, best first (ties keep the given order)."""
    healthy = [load for load in loads if load.healthy]
    return [load.name for load in sorted(healthy, key=score)]


def round_robin(loads: Sequence[InstanceLoad], turn: int) -> list[str]:
    """Healthy instances, starting at position `turn` of the given order."""
    healthy = [load.name for load in loads if load.healthy]
    if not healthy:
        return []
    start = turn % len(healthy)
    return healthy[start:] + healthy[:start]


POLICIES = ("least_loaded", "round_robin")


def rank(policy: str, loads: Sequence[InstanceLoad], turn: int) -> list[str]:
    if policy == "round_robin":
        return round_robin(loads, turn)
    assert policy == "least_loaded", policy
    return least_loaded(loads)


def should_skip_prefill(num_prompt_tokens: int, num_cached_tokens: int, min_prefill_tokens: int) -> bool:
    """Decode computes the rest itself when fewer than `min_prefill_tokens` are missing: a
    short prompt, or one decode already holds nearly whole. The hand-off would cost more."""
    return num_prompt_tokens - num_cached_tokens < min_prefill_tokens
