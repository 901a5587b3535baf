"""When each request of a load test starts: offsets in seconds from the start of the run.

`arrival_offsets` draws a renewal process as vLLM's `bench serve` does: gaps between
arrivals are gamma distributed with shape `burstiness` and mean 1/`request_rate`, so
burstiness 1 is a Poisson process, below 1 arrivals clump (coefficient of variation
1/sqrt(burstiness) > 1) and above 1 they even out; infinite burstiness is a fixed gap.
Unlike vLLM, the first request starts at 0 and the gaps are not rescaled to make the
run last exactly num_requests/request_rate, so the gaps stay a true gamma sample.
`trace_offsets` replays the timestamps a trace carries.
"""

from __future__ import annotations

import math

import numpy as np

from vllm_cluster.loadtest.datasets import SampleRequest


def arrival_offsets(
    num_requests: int, request_rate: float, burstiness: float = 1.0, seed: int = 0
) -> list[float]:
    """Non-decreasing start offsets (s), the first 0; all 0 when request_rate is inf."""
    if isinstance(num_requests, bool) or not isinstance(num_requests, int) or num_requests < 0:
        raise ValueError(f"num_requests must be an integer >= 0, got {num_requests!r}")
    if math.isnan(request_rate) or request_rate <= 0:
        raise ValueError(
            f"request_rate must be > 0 requests/s (inf sends all at once), got {request_rate}"
        )
    if math.isnan(burstiness) or burstiness <= 0:
        raise ValueError(
            f"burstiness must be > 0 (1 is Poisson, < 1 burstier, > 1 more uniform), "
            f"got {burstiness}"
        )
    if num_requests == 0:
        return []
    if math.isinf(request_rate):
        return [0.0] * num_requests
    mean_gap_s = 1.0 / request_rate
    if math.isinf(burstiness):
        gaps_s = np.full(num_requests - 1, mean_gap_s)
    else:
        rng = np.random.default_rng(seed)
        gaps_s = rng.gamma(shape=burstiness, scale=mean_gap_s / burstiness, size=num_requests - 1)
    offsets_s: list[float] = np.concatenate(([0.0], np.cumsum(gaps_s))).tolist()
    return offsets_s


def trace_offsets(requests: list[SampleRequest]) -> list[float]:
    """Each request's timestamp minus the first request's, in list order."""
    offsets_s: list[float] = []
    for i, request in enumerate(requests):
        if request.timestamp_s is None:
            raise ValueError(
                f"request [{i}] has no timestamp; replay a trace dataset (mooncake) or "
                "use arrival_offsets with a request rate"
            )
        offset_s = request.timestamp_s - (requests[0].timestamp_s or 0.0)
        if offsets_s and offset_s < offsets_s[-1]:
            raise ValueError(
                f"request [{i}] has timestamp {request.timestamp_s} s, earlier than the one "
                "before it; sort the requests by timestamp"
            )
        offsets_s.append(offset_s)
    return offsets_s
