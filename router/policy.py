"""Routing decisions as pure functions over a snapshot of instance load and prefix overlap.
No I/O here: the router's shell gathers the snapshot (its own in-flight counts, the
instances' last Stats, the Redis prefix index) and acts on the answer, so every rule is
tested alone. Randomness comes in as a `random.Random`, so tests fix it.
"""

from __future__ import annotations

import random
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
    num_cached_blocks: int = 0  # leading blocks of this prompt the instance holds (prefix index)
    # Of the leading blocks past those, held in the instance's host-memory / disk KV tier
    # (loaded there instead of recomputed).
    num_host_blocks: int = 0
    num_disk_blocks: int = 0
    lora_resident: bool = False  # the request's LoRA adapter sits in a slot there (no swap-in)
    lora_loaded: bool = True  # the request's LoRA adapter (if any) is loaded there


@dataclass(frozen=True, slots=True)
class PrefixWeights:
    """prefix_aware: score = overlap * overlap_fraction - usage * kv_cache_usage - load * load_share
    + lora * lora_resident, where overlap_fraction counts a block in the device cache as 1, one
    in the host tier as `host` and one on disk as `disk`: what a load saves of a recompute
    (a host load costs about a tenth of recomputing on a GPU, a disk read more)."""

    overlap: float = 2.0
    usage: float = 1.0
    load: float = 1.0
    lora: float = 0.5
    host: float = 0.8
    disk: float = 0.4

    def __post_init__(self) -> None:
        assert 1.0 >= self.host >= self.disk >= 0.0, "a device hit >= a host hit >= a disk hit >= a miss"


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


def power_of_two(loads: Sequence[InstanceLoad], rng: random.Random) -> list[str]:
    """Two healthy instances drawn at random, the less loaded first (then the rest, by load)."""
    healthy = [load for load in loads if load.healthy]
    if len(healthy) <= 2:
        return least_loaded(healthy)
    pair = rng.sample(healthy, 2)
    first = min(pair, key=score)
    return [first.name] + [load.name for load in sorted(healthy, key=score) if load is not first]


def prefix_aware(
    loads: Sequence[InstanceLoad], num_prompt_blocks: int, weights: PrefixWeights, rng: random.Random
) -> list[str]:
    """Best first by overlap against KV usage and load; ties broken at random, so equally
    good instances share the work instead of the first one taking it all."""
    healthy = [load for load in loads if load.healthy]
    if not healthy:
        return []
    total_load = sum(load.num_inflight + load.num_waiting for load in healthy)

    def value(load: InstanceLoad) -> float:
        held = load.num_cached_blocks + weights.host * load.num_host_blocks + weights.disk * load.num_disk_blocks
        overlap = held / num_prompt_blocks if num_prompt_blocks else 0.0
        share = (load.num_inflight + load.num_waiting) / total_load if total_load else 0.0
        resident = weights.lora if load.lora_resident else 0.0
        return weights.overlap * overlap - weights.usage * load.kv_cache_usage - weights.load * share + resident

    keyed = [(-value(load), rng.random(), load.name) for load in healthy]
    return [name for _, _, name in sorted(keyed)]


def rank(
    policy: str,
    loads: Sequence[InstanceLoad],
    turn: int,
    rng: random.Random | None = None,
    num_prompt_blocks: int = 0,
    weights: PrefixWeights | None = None,
) -> list[str]:
    """The instances to try, in order, under `policy`. A request for a LoRA adapter goes
    only to instances that report it loaded, or to all when none does yet (an adapter just
    loaded through the API shows in their stats at the next poll)."""
    rng = rng or random.Random(turn)
    loads = [load for load in loads if load.lora_loaded] or list(loads)
    if policy == "round_robin":
        return round_robin(loads, turn)
    if policy == "power_of_two":
        return power_of_two(loads, rng)
    if policy == "prefix_aware":
        return prefix_aware(loads, num_prompt_blocks, weights or PrefixWeights(), rng)
    assert policy == "least_loaded", policy
    return least_loaded(loads)


def should_skip_prefill(num_prompt_tokens: int, num_cached_tokens: int, min_prefill_tokens: int) -> bool:
    """Decode computes the rest itself when fewer than `min_prefill_tokens` are missing: a
    short prompt, or one decode already holds nearly whole. The hand-off would cost more."""
    return num_prompt_tokens - num_cached_tokens < min_prefill_tokens
