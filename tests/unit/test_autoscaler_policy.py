"""The autoscaler's decision, exact: pool sizes wanted from an observation, and the p99 of
a histogram's window; its YAML section refused with what to change."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from vllm_cluster.cluster.autoscaler_config import AutoscalerConfig
from vllm_cluster.cluster.autoscaler_policy import Observation, decide, window_p99_ms
from vllm_cluster.cluster.config_file import load_deployment
from vllm_cluster.cluster.scale_plan import PoolSizes
from vllm_cluster.engine.errors import ConfigError

CONFIG = AutoscalerConfig(enabled=True, ttft_p99_ms=1000, itl_p99_ms=100, max_queue=2, min_prefill=0,
                          max_prefill=2, min_decode=1, max_decode=3, interval_s=5, cooldown_s=30)
CALM = Observation(ttft_p99_ms=200, itl_p99_ms=20, prefill_queues=(0,), decode_queues=(0, 0), since_change_s=60)


def _seen(**changes: object) -> Observation:
    return dataclasses.replace(CALM, **changes)  # type: ignore[arg-type]


@pytest.mark.parametrize(("now", "seen", "wanted"), [
    # cooldown: nothing changes, however bad
    (PoolSizes(1, 2), _seen(itl_p99_ms=900, since_change_s=29), PoolSizes(1, 2)),
    # outside the bounds: back to the nearest
    (PoolSizes(1, 5), CALM, PoolSizes(1, 3)),
    (PoolSizes(0, 0), CALM, PoolSizes(0, 1)),
    # inter-token latency or decode's queue: decode grows
    (PoolSizes(1, 2), _seen(itl_p99_ms=101), PoolSizes(1, 3)),
    (PoolSizes(1, 2), _seen(decode_queues=(3, 2)), PoolSizes(1, 3)),
    (PoolSizes(1, 2), _seen(decode_queues=(2, 2)), PoolSizes(1, 2)),  # at max_queue: not over it
    # prefill's queue: prefill grows
    (PoolSizes(1, 2), _seen(prefill_queues=(3,)), PoolSizes(2, 2)),
    # TTFT alone: the pool with the longer queue, prefill on a tie
    (PoolSizes(1, 2), _seen(ttft_p99_ms=1500, prefill_queues=(1,), decode_queues=(2, 2)), PoolSizes(1, 3)),
    (PoolSizes(1, 2), _seen(ttft_p99_ms=1500), PoolSizes(2, 2)),
    (PoolSizes(2, 2), _seen(ttft_p99_ms=1500), PoolSizes(2, 3)),  # prefill at its max: decode
    # over a target at every max: stay
    (PoolSizes(2, 3), _seen(ttft_p99_ms=1500, itl_p99_ms=500), PoolSizes(2, 3)),
    # calm, with half to spare and empty queues: prefill shrinks first, then decode
    (PoolSizes(1, 2), CALM, PoolSizes(0, 2)),
    (PoolSizes(0, 2), _seen(prefill_queues=()), PoolSizes(0, 1)),
    (PoolSizes(0, 2), _seen(ttft_p99_ms=None, itl_p99_ms=None, prefill_queues=()), PoolSizes(0, 1)),
    (PoolSizes(0, 2), _seen(ttft_p99_ms=600, prefill_queues=()), PoolSizes(0, 2)),  # not half to spare
    (PoolSizes(0, 2), _seen(decode_queues=(0, 1), prefill_queues=()), PoolSizes(0, 2)),  # one waits
    (PoolSizes(0, 1), _seen(prefill_queues=()), PoolSizes(0, 1)),  # at the mins
])
def test_decide(now: PoolSizes, seen: Observation, wanted: PoolSizes) -> None:
    assert decide(CONFIG, now, seen) == wanted


def test_window_p99_takes_the_bucket_of_the_window_only() -> None:
    inf = float("inf")
    before = {0.1: 90.0, 0.5: 100.0, 1.0: 100.0, inf: 100.0}
    assert window_p99_ms(before, before) is None
    # 100 new observations: 98 under 0.1 s, 2 in (0.5, 1.0]: the 99th is in the 1.0 bucket
    after = {0.1: 188.0, 0.5: 198.0, 1.0: 200.0, inf: 200.0}
    assert window_p99_ms(before, after) == pytest.approx(1000.0)
    after = {0.1: 188.0, 0.5: 200.0, 1.0: 200.0, inf: 200.0}
    assert window_p99_ms(before, after) == pytest.approx(500.0)
    after = {0.1: 189.0, 0.5: 200.0, 1.0: 200.0, inf: 200.0}  # 99 of 100 under 0.1 s
    assert window_p99_ms(before, after) == pytest.approx(100.0)
    after = {0.1: 90.0, 0.5: 100.0, 1.0: 100.0, inf: 110.0}  # beyond the last bound
    assert window_p99_ms(before, after) == pytest.approx(1000.0)
    assert window_p99_ms({}, {0.1: 1.0, inf: 1.0}) == pytest.approx(100.0)


@pytest.mark.parametrize(("section", "message"), [
    ("  max_decode: 1\n  min_decode: 2\n", "autoscaler.max_decode: 1 is below autoscaler.min_decode"),
    ("  min_decode: 0\n", "autoscaler.min_decode: 0 must be >= 1"),
    ("  ttft_p99_ms: 0\n", "autoscaler.ttft_p99_ms: 0 must be > 0"),
    ("  cooldown_s: -1\n", "autoscaler.cooldown_s: -1 must be >= 0"),
    ("  enabeld: true\n", "enabeld"),
])
def test_the_section_is_checked_on_load(tmp_path: Path, section: str, message: str) -> None:
    path = tmp_path / "cluster.yaml"
    path.write_text("engine:\n  model:\n    model: smollm2-135m-instruct\nautoscaler:\n" + section)
    with pytest.raises(ConfigError, match=message) as info:
        load_deployment(str(path), [])
    assert str(info.value).startswith(f"{path}:")


def test_off_by_default(tmp_path: Path) -> None:
    path = tmp_path / "cluster.yaml"
    path.write_text("engine:\n  model:\n    model: smollm2-135m-instruct\n")
    assert load_deployment(str(path), []).autoscaler == AutoscalerConfig()
    assert not AutoscalerConfig().enabled


def test_the_router_histograms_are_read_from_its_metrics_text() -> None:
    from prometheus_client import generate_latest

    from vllm_cluster.cluster.autoscaler import ITL, TTFT, histogram_buckets
    from vllm_cluster.metrics import RouterMetrics

    metrics = RouterMetrics("m")
    before = histogram_buckets(generate_latest(metrics.registry).decode(), (TTFT, ITL))
    for seconds in [0.01] * 98 + [3.0, 3.0]:
        metrics.time_to_first_token.observe(seconds)
    after = histogram_buckets(generate_latest(metrics.registry).decode(), (TTFT, ITL))
    assert set(after) == {TTFT, ITL} and after[TTFT][float("inf")] == 100
    p99_ms = window_p99_ms(before[TTFT], after[TTFT])
    assert p99_ms is not None and 3000 <= p99_ms == 1000 * min(b for b in after[TTFT] if b >= 3.0)
    assert window_p99_ms(before[ITL], after[ITL]) is None
