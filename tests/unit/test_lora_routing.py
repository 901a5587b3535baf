"""The router's LoRA terms: only instances with the request's adapter loaded are tried, one
where it is resident wins a tie, prefix overlap still outweighs that, and the Stats
residency reaches the scoring input."""

from __future__ import annotations

import random

from vllm_cluster.proto import cluster_pb2 as pb
from vllm_cluster.router.policy import InstanceLoad, PrefixWeights, prefix_aware, rank
from vllm_cluster.router.registry import Instance


def test_resident_adapter_wins_a_tie() -> None:
    loads = [InstanceLoad("cold", True, 1), InstanceLoad("warm", True, 1, lora_resident=True)]
    for seed in range(5):  # ties are broken at random: residency must decide every time
        assert prefix_aware(loads, 4, PrefixWeights(), random.Random(seed)) == ["warm", "cold"]


def test_prefix_overlap_outweighs_residency() -> None:
    loads = [InstanceLoad("warm", True, 1, lora_resident=True), InstanceLoad("cached", True, 1, num_cached_blocks=4)]
    assert prefix_aware(loads, 4, PrefixWeights(), random.Random(0)) == ["cached", "warm"]
    no_lora_term = PrefixWeights(lora=0.0)
    tie = [InstanceLoad("a", True, 1, lora_resident=True), InstanceLoad("b", True, 1)]
    assert sorted(prefix_aware(tie, 4, no_lora_term, random.Random(0))) == ["a", "b"]


def test_instance_load_reads_residency_from_stats() -> None:
    instance = Instance("decode-0", "decode", "127.0.0.1:1", channel=None, stub=None, healthy=True,  # type: ignore[arg-type]
                        stats=pb.WorkerStats(lora_names=["a", "b"], lora_resident_names=["a"]))
    assert instance.load(0, "a").lora_resident
    assert not instance.load(0, "b").lora_resident
    assert not instance.load(0, None).lora_resident
    assert instance.load(0, "b").lora_loaded and not instance.load(0, "c").lora_loaded
    assert instance.load(0, None).lora_loaded


def test_only_instances_with_the_adapter_are_tried() -> None:
    """Under every policy, an instance without the adapter is never tried while one has it;
    when none reports it yet (loaded a moment ago), all are tried."""
    loads = [InstanceLoad("without", True, 0, lora_loaded=False), InstanceLoad("with", True, 5)]
    for policy in ("round_robin", "power_of_two", "prefix_aware", "least_loaded"):
        for turn in range(4):
            assert rank(policy, loads, turn, random.Random(turn), 4) == ["with"]
    nobody = [InstanceLoad("a", True, 0, lora_loaded=False), InstanceLoad("b", True, 0, lora_loaded=False)]
    assert sorted(rank("least_loaded", nobody, 0)) == ["a", "b"]
