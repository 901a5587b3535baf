"""The autoscaler's decision, pure: what the router observed over the last interval and the
pool sizes now -> the pool sizes wanted. The shell (cluster/autoscaler.py) gathers the
observation and applies the answer through `vllm-cluster scale`'s code path.

One rule at a time, first match wins, one instance per step:
  1. Within `cooldown_s` of the last change: no change (a new instance needs time to
     take load before it is judged).
  2. A pool outside its [min, max]: back to the nearest bound.
  3. Grow (below its max): decode when the inter-token p99 is over its target or decode's
     mean queue is over `max_queue`; prefill when its mean queue is over `max_queue`; when
     only the time-to-first-token p99 is over its target, the pool with the longer mean
     queue (prefill on a tie), prefill only while it may grow.
  4. Shrink (above its min), when every target is met with half to spare and no request
     waits anywhere: prefill first (decode computes prompts when prefill is short), then
     decode.
No observation (no request in the window) counts as meeting the targets.
"""

from __future__ import annotations

from dataclasses import dataclass

from vllm_cluster.cluster.autoscaler_config import AutoscalerConfig
from vllm_cluster.cluster.scale_plan import PoolSizes

_SPARE = 0.5  # shrink only below this fraction of each target


@dataclass(frozen=True, slots=True)
class Observation:
    ttft_p99_ms: float | None  # None: no first token in the window
    itl_p99_ms: float | None
    prefill_queues: tuple[int, ...]  # waiting requests per prefill instance
    decode_queues: tuple[int, ...]
    since_change_s: float  # since the pools last changed (or the cluster started)


def _mean(queues: tuple[int, ...]) -> float:
    return sum(queues) / len(queues) if queues else 0.0


def _over(value: float | None, target: float) -> bool:
    return value is not None and value > target


def decide(config: AutoscalerConfig, now: PoolSizes, seen: Observation) -> PoolSizes:
    if seen.since_change_s < config.cooldown_s:
        return now
    bounded = PoolSizes(min(max(now.num_prefill, config.min_prefill), config.max_prefill),
                        min(max(now.num_decode, config.min_decode), config.max_decode))
    if bounded != now:
        return bounded
    prefill_queue, decode_queue = _mean(seen.prefill_queues), _mean(seen.decode_queues)
    can_grow_prefill = now.num_prefill < config.max_prefill
    can_grow_decode = now.num_decode < config.max_decode
    grow_decode = _over(seen.itl_p99_ms, config.itl_p99_ms) or decode_queue > config.max_queue
    grow_prefill = prefill_queue > config.max_queue
    if not (grow_decode or grow_prefill) and _over(seen.ttft_p99_ms, config.ttft_p99_ms):
        grow_prefill = can_grow_prefill and prefill_queue >= decode_queue
        grow_decode = not grow_prefill
    if grow_decode and can_grow_decode:
        return PoolSizes(now.num_prefill, now.num_decode + 1)
    if grow_prefill and can_grow_prefill:
        return PoolSizes(now.num_prefill + 1, now.num_decode)
    if grow_decode or grow_prefill:
        return now  # over a target, at the max
    relaxed = (
        not _over(seen.ttft_p99_ms, _SPARE * config.ttft_p99_ms)
        and not _over(seen.itl_p99_ms, _SPARE * config.itl_p99_ms)
        and not any(seen.prefill_queues) and not any(seen.decode_queues)
    )
    if relaxed and now.num_prefill > config.min_prefill:
        return PoolSizes(now.num_prefill - 1, now.num_decode)
    if relaxed and now.num_decode > config.min_decode:
        return PoolSizes(now.num_prefill, now.num_decode - 1)
    return now


def window_p99_ms(before: dict[float, float], after: dict[float, float]) -> float | None:
    """The p99 of a Prometheus histogram's observations between two scrapes, in ms: the upper
    bound of the bucket it falls in (the largest finite bound for the +Inf bucket). Each
    argument maps a bucket's upper bound `le` (seconds) to its cumulative count; None when
    nothing was observed in between."""
    bounds = sorted(after)
    counts = [after[b] - before.get(b, 0.0) for b in bounds]
    if not counts or counts[-1] <= 0:
        return None
    for bound, count in zip(bounds, counts, strict=True):
        if count >= 0.99 * counts[-1]:
            finite = bound if bound != float("inf") else max(b for b in bounds if b != float("inf"))
            return finite * 1000.0
    raise AssertionError("the +Inf bucket holds every observation")
