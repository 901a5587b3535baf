"""The chaos run's schedule and its report, without a cluster (tests/e2e/test_chaos.py runs
one against `vllm-cluster up`)."""

from __future__ import annotations

import json
import random
from collections import Counter

from vllm_cluster.cluster.chaos import report_dict
from vllm_cluster.loadtest.chaos import ChaosReport, schedule

NAMES = ["redis", "prefill-0", "decode-0", "decode-1", "router"]


def test_every_kind_of_fault_comes_once_before_any_repeats() -> None:
    faults = schedule(NAMES, num_faults=12, rng=random.Random(0))
    kinds = {f"kill {n}" for n in NAMES} | {"stop redis", "burst", "slow_client", "malformed"}
    assert len(faults) == 12 and set(faults[: len(kinds)]) == kinds and set(faults) == kinds
    assert schedule(NAMES, 12, random.Random(0)) == faults != schedule(NAMES, 12, random.Random(1))


def test_no_redis_no_redis_stop() -> None:
    assert "stop redis" not in schedule(["prefill-0", "decode-0", "router"], 3, random.Random(0))


def test_the_report_is_clean_only_with_nothing_unclean_and_the_cluster_healed() -> None:
    report = ChaosReport(faults=[(0.0, "kill router")], outcomes=Counter({"completed": 9, "grpc UNAVAILABLE": 3}),
                         recovered_after_s=12.5)
    printed = json.loads(json.dumps(report_dict(report)))
    assert printed["outcomes"] == {"completed": 9, "grpc UNAVAILABLE": 3} and printed["clean"] is True
    for spoiled in (ChaosReport(recovered_after_s=1.0, unclean=Counter({"http 500": 1})), ChaosReport(),
                    ChaosReport(recovered_after_s=1.0, blocks_in_use={"decode-0": 2}),
                    ChaosReport(recovered_after_s=1.0, final_mismatches=["prompt 0 over grpc: hung"])):
        assert not report_dict(spoiled)["clean"]
