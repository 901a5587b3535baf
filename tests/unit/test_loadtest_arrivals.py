"""Arrival schedules: gamma inter-arrival gaps with the requested mean and burstiness
(statistical checks on 20000 seeded draws, tolerances stated), the edge cases, argument
validation, and trace timestamps."""

from __future__ import annotations

import math

import numpy as np
import pytest

from vllm_cluster.loadtest.arrivals import arrival_offsets, trace_offsets
from vllm_cluster.loadtest.datasets import SampleRequest

N = 20000
RATE = 8.0


def gaps_of(offsets: list[float]) -> np.ndarray:
    return np.diff(np.asarray(offsets))


@pytest.mark.parametrize("burstiness", [0.25, 1.0, 4.0])
def test_gaps_have_requested_mean_and_burstiness(burstiness: float) -> None:
    offsets = arrival_offsets(N, RATE, burstiness, seed=123)
    gaps = gaps_of(offsets)
    assert len(offsets) == N and offsets[0] == 0.0
    assert np.all(gaps >= 0)

    # Gamma(k, θ) gaps have coefficient of variation 1/sqrt(k). The sample mean's relative
    # standard error is cv/sqrt(n); allow 5 of them (about 1.8% at k=0.25, 0.35% at k=4).
    expected_cv = 1.0 / math.sqrt(burstiness)
    mean_tolerance = 5 * expected_cv / math.sqrt(len(gaps))
    assert gaps.mean() == pytest.approx(1.0 / RATE, rel=mean_tolerance)

    # The sample CV's relative standard error is about sqrt((kurtosis - 1) / (4n)), with
    # kurtosis 3 + 6/k for a gamma: 1.8% at k=0.25, 1.0% at k=1, 0.66% at k=4. Allow 5.
    kurtosis = 3 + 6 / burstiness
    cv_tolerance = 5 * math.sqrt((kurtosis - 1) / (4 * len(gaps)))
    assert gaps.std() / gaps.mean() == pytest.approx(expected_cv, rel=cv_tolerance)


def test_burstier_means_more_clumped() -> None:
    cvs = [
        gaps_of(arrival_offsets(N, RATE, b, seed=5)).std() / (1 / RATE) for b in (0.25, 1.0, 4.0)
    ]
    assert cvs[0] > 1.5 > cvs[1] > 0.75 > cvs[2]


def test_seed_makes_the_schedule_repeatable() -> None:
    assert arrival_offsets(50, 3.0, 0.5, seed=9) == arrival_offsets(50, 3.0, 0.5, seed=9)
    assert arrival_offsets(50, 3.0, 0.5, seed=9) != arrival_offsets(50, 3.0, 0.5, seed=10)


def test_infinite_rate_sends_everything_at_once() -> None:
    assert arrival_offsets(5, math.inf, burstiness=0.3) == [0.0] * 5


def test_infinite_burstiness_is_a_fixed_gap() -> None:
    assert arrival_offsets(4, 2.0, burstiness=math.inf) == [0.0, 0.5, 1.0, 1.5]


def test_small_counts() -> None:
    assert arrival_offsets(0, 1.0) == []
    assert arrival_offsets(1, 1.0) == [0.0]


@pytest.mark.parametrize(
    ("args", "fragment"),
    [
        ((10, 0.0, 1.0), "request_rate must be > 0"),
        ((10, -2.0, 1.0), "request_rate must be > 0"),
        ((10, math.nan, 1.0), "request_rate must be > 0"),
        ((10, 1.0, 0.0), "burstiness must be > 0"),
        ((10, 1.0, math.nan), "burstiness must be > 0"),
        ((-1, 1.0, 1.0), "num_requests must be an integer >= 0"),
        ((2.5, 1.0, 1.0), "num_requests must be an integer >= 0"),
    ],
)
def test_arrival_offsets_rejects_bad_arguments(args: tuple, fragment: str) -> None:
    with pytest.raises(ValueError, match=fragment):
        arrival_offsets(*args)


def test_trace_offsets_are_relative_to_the_first() -> None:
    requests = [SampleRequest([1], 1, 1, timestamp_s=t) for t in (10.0, 10.0, 10.25, 13.0)]
    assert trace_offsets(requests) == [0.0, 0.0, 0.25, 3.0]
    assert trace_offsets([]) == []


def test_trace_offsets_needs_every_timestamp() -> None:
    requests = [SampleRequest([1], 1, 1, timestamp_s=0.0), SampleRequest("x", 1, 1)]
    with pytest.raises(ValueError, match=r"request \[1\] has no timestamp"):
        trace_offsets(requests)


def test_trace_offsets_rejects_unsorted_timestamps() -> None:
    requests = [SampleRequest([1], 1, 1, timestamp_s=t) for t in (1.0, 3.0, 2.0)]
    with pytest.raises(ValueError, match=r"request \[2\] .* earlier than the one before it"):
        trace_offsets(requests)
