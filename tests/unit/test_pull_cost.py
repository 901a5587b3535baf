"""The pull cost model as measured: it starts at the configured figures and follows what
pulls and prefills show, and the pull decision follows it."""

from __future__ import annotations

import pytest

from vllm_cluster.kv_index import TierOverlap
from vllm_cluster.router.pull import PullCost, plan_pull
from vllm_cluster.router.pull_cost import ALPHA, MIN_PROMPT_TOKENS, MeasuredPullCost

CONFIGURED = PullCost(link_bytes_per_s=1e9, recompute_tokens_per_s=1000.0, setup_s=0.01)


def test_it_starts_at_the_configured_figures() -> None:
    measured = MeasuredPullCost(CONFIGURED)
    assert measured.current() == CONFIGURED


def test_a_pull_moves_the_link_estimate_towards_its_bandwidth_less_the_fixed_cost() -> None:
    measured = MeasuredPullCost(CONFIGURED)
    measured.observe_pull(num_bytes=10**8, elapsed_s=0.01 + 0.5)  # 0.2 GB/s once the setup is taken off
    expected = 1e9 + ALPHA * (2e8 - 1e9)
    assert measured.current().link_bytes_per_s == pytest.approx(expected)
    for _ in range(60):
        measured.observe_pull(num_bytes=10**8, elapsed_s=0.51)
    assert measured.current().link_bytes_per_s == pytest.approx(2e8, rel=1e-3)
    assert measured.num_link_samples == 61


def test_prompt_samples_move_the_rate_and_short_prompts_are_not_samples() -> None:
    measured = MeasuredPullCost(CONFIGURED)
    measured.observe_prompt(MIN_PROMPT_TOKENS - 1, 0.0001)  # a few tokens: the step's overhead, not a rate
    measured.observe_prompt(4096, 0.0)  # no time: nothing to learn
    assert measured.current().recompute_tokens_per_s == 1000.0 and measured.num_prompt_samples == 0
    measured.observe_prompt(4096, 1.024)  # 4,000 tokens/s
    assert measured.current().recompute_tokens_per_s == pytest.approx(1000.0 + ALPHA * 3000.0)


def test_the_decision_follows_the_measured_link() -> None:
    """A prefix worth pulling over the configured link is not once pulls show the link slow."""
    block_bytes, block_size = 2**20, 16
    overlap = {"holder": TierOverlap(num_device=64)}

    def plan(cost: PullCost) -> object:
        return plan_pull(overlap, "target", {"holder", "target"}, 64 * block_size + 1, block_size, 0, block_bytes, cost)

    measured = MeasuredPullCost(CONFIGURED)
    assert plan(measured.current()) is not None  # 64 MiB at 1 GB/s: 0.08 s against 1.02 s of compute
    for _ in range(40):
        measured.observe_pull(num_bytes=2**20, elapsed_s=0.01 + 0.1)  # about 10 MB/s
    assert plan(measured.current()) is None
