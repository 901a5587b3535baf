"""The sampler on synthetic logits: greedy, seeded sampling, the truncation filters,
penalties, min_tokens masking and logprobs. No model is loaded."""

from __future__ import annotations

from collections import Counter
from dataclasses import replace

import pytest
import torch

from vllm_cluster.engine.request import Request, RequestId
from vllm_cluster.engine.sampler import Sampler
from vllm_cluster.engine.sampling_params import SamplingParams

EOS = 7
VOCAB = 50


def make_request(
    params: SamplingParams,
    prompt_token_ids: list[int] | None = None,
    output_token_ids: list[int] | None = None,
    request_id: str = "r",
) -> Request:
    request = Request(
        request_id=RequestId(request_id),
        prompt_token_ids=prompt_token_ids if prompt_token_ids is not None else [1, 2, 3],
        sampling_params=params,
        eos_token_id=EOS,
        max_tokens=params.max_tokens or 16,
    )
    request.output_token_ids = list(output_token_ids or [])
    return request


def flat_logits(vocab_size: int = VOCAB) -> torch.Tensor:
    # logits: [V], close to uniform but with distinct values, so every token is likely.
    return torch.linspace(0.0, 0.5, vocab_size)


def draw_many(logits: torch.Tensor, params: SamplingParams, num_draws: int) -> list[int]:
    """One draw per fresh request, each with its own seed; logits: [V]."""
    requests = [
        make_request(replace(params, seed=i), request_id=str(i))
        for i in range(num_draws)
    ]
    batch = logits.unsqueeze(0).expand(num_draws, -1)  # [num_draws, V]
    return [t.token_id for t in Sampler()(batch, requests)]


def sample_steps(request: Request, logits: torch.Tensor, num_steps: int) -> list[int]:
    """Draw `num_steps` tokens from the same request, one Sampler call each; logits: [V]."""
    sampler = Sampler()
    return [sampler(logits.unsqueeze(0), [request])[0].token_id for _ in range(num_steps)]


# --- greedy -------------------------------------------------------------------------


def test_greedy_is_argmax_per_row() -> None:
    torch.manual_seed(0)
    logits = torch.randn(4, VOCAB)  # [N, V]
    requests = [make_request(SamplingParams(temperature=0.0), request_id=str(i)) for i in range(4)]
    tokens = Sampler()(logits, requests)
    assert [t.token_id for t in tokens] == logits.argmax(dim=-1).tolist()
    assert all(t.logprobs is None for t in tokens)


def test_greedy_rows_unaffected_by_random_rows_in_the_batch() -> None:
    torch.manual_seed(1)
    logits = torch.randn(3, VOCAB)  # [N, V]
    requests = [
        make_request(SamplingParams(temperature=0.0), request_id="greedy-0"),
        make_request(SamplingParams(temperature=1.0, seed=3), request_id="random"),
        make_request(SamplingParams(temperature=0.0), request_id="greedy-2"),
    ]
    tokens = Sampler()(logits, requests)
    assert tokens[0].token_id == int(logits[0].argmax())
    assert tokens[2].token_id == int(logits[2].argmax())


def test_sampler_does_not_modify_the_callers_logits() -> None:
    logits = torch.randn(1, VOCAB)
    before = logits.clone()
    params = SamplingParams(temperature=0.7, repetition_penalty=1.5, presence_penalty=1.0, min_tokens=2, seed=0)
    Sampler()(logits, [make_request(params, output_token_ids=[4])])
    assert torch.equal(logits, before)


# --- seeded sampling ----------------------------------------------------------------


def test_same_seed_repeats_exactly_across_fresh_requests() -> None:
    logits = flat_logits()
    params = SamplingParams(temperature=1.0, seed=1234)
    first = sample_steps(make_request(params), logits, 200)
    second = sample_steps(make_request(params), logits, 200)
    assert first == second
    # The draws really are random: many distinct tokens over a flat distribution.
    assert len(set(first)) > 20


def test_other_seed_gives_other_tokens() -> None:
    logits = flat_logits()
    first = sample_steps(make_request(SamplingParams(temperature=1.0, seed=1)), logits, 200)
    other = sample_steps(make_request(SamplingParams(temperature=1.0, seed=2)), logits, 200)
    assert first != other


def test_seeded_tokens_do_not_depend_on_the_rest_of_the_batch() -> None:
    logits = flat_logits()
    alone = sample_steps(make_request(SamplingParams(temperature=1.0, seed=9)), logits, 50)
    seeded = make_request(SamplingParams(temperature=1.0, seed=9), request_id="seeded")
    neighbour = make_request(SamplingParams(temperature=1.0, seed=10), request_id="neighbour")
    sampler = Sampler()
    batch = torch.stack([logits, logits])  # [2, V]
    in_batch = [sampler(batch, [neighbour, seeded])[1].token_id for _ in range(50)]
    assert in_batch == alone


# --- truncation: top-k, top-p, min-p --------------------------------------------------


@pytest.mark.parametrize("top_k", [1, 3, 10])
def test_top_k_yields_only_the_k_most_likely(top_k: int) -> None:
    logits = flat_logits()
    # linspace is increasing: the k most likely ids are the last k.
    allowed = set(range(VOCAB - top_k, VOCAB))
    drawn = draw_many(logits, SamplingParams(temperature=1.0, top_k=top_k), 600)
    assert set(drawn) == allowed


def test_top_k_disabled_reaches_beyond_any_small_k() -> None:
    drawn = draw_many(flat_logits(), SamplingParams(temperature=1.0, top_k=-1), 600)
    assert len(set(drawn)) > 30


def test_no_truncating_row_skips_the_sort_and_draws_the_same(monkeypatch: pytest.MonkeyPatch) -> None:
    from vllm_cluster.engine import sampler as sampler_module

    plain = SamplingParams(temperature=1.0)  # top_k 0, top_p 1: nothing to truncate
    # Sorted, but no token of these flat logits is past top_p: the reference draws.
    sorted_draws = draw_many(flat_logits(), replace(plain, top_p=0.9999999), 40)

    def no_sort(*args: object) -> torch.Tensor:
        raise AssertionError("sorted, though no row truncates")

    monkeypatch.setattr(sampler_module, "_top_k_top_p", no_sort)
    assert draw_many(flat_logits(), plain, 40) == sorted_draws
    assert draw_many(flat_logits(), replace(plain, top_k=VOCAB), 40) == sorted_draws
    with pytest.raises(AssertionError, match="sorted"):
        draw_many(flat_logits(), replace(plain, top_k=VOCAB - 1), 1)


def test_top_p_keeps_smallest_set_covering_p() -> None:
    logits = torch.tensor([0.5, 0.3, 0.15, 0.05]).log()
    drawn = draw_many(logits, SamplingParams(temperature=1.0, top_p=0.7), 600)
    assert set(drawn) == {0, 1}


def test_top_p_just_above_a_boundary_includes_the_next_token() -> None:
    logits = torch.tensor([0.5, 0.3, 0.15, 0.05]).log()
    drawn = draw_many(logits, SamplingParams(temperature=1.0, top_p=0.85), 600)
    assert set(drawn) == {0, 1, 2}


def test_top_p_keeps_the_most_likely_token_even_below_p() -> None:
    logits = torch.tensor([0.5, 0.3, 0.15, 0.05]).log()
    drawn = draw_many(logits, SamplingParams(temperature=1.0, top_p=0.1), 100)
    assert set(drawn) == {0}


def test_top_p_frequencies_follow_renormalised_probabilities() -> None:
    logits = torch.tensor([0.5, 0.3, 0.15, 0.05]).log()
    counts = Counter(draw_many(logits, SamplingParams(temperature=1.0, top_p=0.7), 2000))
    # Renormalised over {0, 1}: 0.625 and 0.375.
    assert counts[0] / 2000 == pytest.approx(0.625, abs=0.05)


def test_min_p_masks_tokens_below_min_p_times_max() -> None:
    logits = torch.tensor([0.4, 0.3, 0.15, 0.1, 0.05]).log()
    # Threshold 0.3 * 0.4 = 0.12: tokens 3 (0.1) and 4 (0.05) are masked.
    drawn = draw_many(logits, SamplingParams(temperature=1.0, min_p=0.3), 600)
    assert set(drawn) == {0, 1, 2}


def test_min_p_zero_masks_nothing() -> None:
    logits = torch.tensor([0.4, 0.3, 0.15, 0.1, 0.05]).log()
    drawn = draw_many(logits, SamplingParams(temperature=1.0, min_p=0.0), 1000)
    assert set(drawn) == {0, 1, 2, 3, 4}


def test_low_temperature_concentrates_on_the_argmax() -> None:
    logits = torch.tensor([0.4, 0.3, 0.15, 0.1, 0.05]).log()
    drawn = draw_many(logits, SamplingParams(temperature=0.01), 200)
    assert set(drawn) == {0}


# --- penalties -------------------------------------------------------------------------


def test_presence_and_frequency_penalties_lower_generated_tokens() -> None:
    logits = torch.randn(1, VOCAB)  # [1, V]
    params = SamplingParams(presence_penalty=0.5, frequency_penalty=0.25)
    request = make_request(params, prompt_token_ids=[11, 12], output_token_ids=[3, 3, 3, 5])
    out = Sampler._apply_penalties_and_masks(logits, [request])
    expected = logits.clone()
    expected[0, 3] -= 3 * 0.25 + 0.5
    expected[0, 5] -= 1 * 0.25 + 0.5
    # Prompt tokens (11, 12) are not penalised by presence / frequency.
    torch.testing.assert_close(out, expected)


def test_negative_presence_penalty_raises_generated_tokens() -> None:
    logits = torch.zeros(1, VOCAB)
    request = make_request(SamplingParams(presence_penalty=-1.0), output_token_ids=[4, 4])
    out = Sampler._apply_penalties_and_masks(logits, [request])
    assert out[0, 4].item() == pytest.approx(1.0)
    assert out[0, 5].item() == 0.0


def test_repetition_penalty_divides_positive_and_multiplies_negative_seen_logits() -> None:
    logits = torch.zeros(1, VOCAB)
    logits[0, 1], logits[0, 2], logits[0, 3], logits[0, 4] = 2.0, -2.0, 3.0, -3.0
    # 1 (positive) and 2 (negative) are in the prompt, 3 (positive) in the output, 4 unseen.
    request = make_request(
        SamplingParams(repetition_penalty=2.0), prompt_token_ids=[1, 2], output_token_ids=[3]
    )
    out = Sampler._apply_penalties_and_masks(logits, [request])
    assert out[0, 1].item() == pytest.approx(1.0)
    assert out[0, 2].item() == pytest.approx(-4.0)
    assert out[0, 3].item() == pytest.approx(1.5)
    assert out[0, 4].item() == pytest.approx(-3.0)


def test_repetition_penalty_counts_each_seen_token_once() -> None:
    logits = torch.full((1, VOCAB), 4.0)
    request = make_request(
        SamplingParams(repetition_penalty=2.0), prompt_token_ids=[6, 6, 6], output_token_ids=[6]
    )
    out = Sampler._apply_penalties_and_masks(logits, [request])
    assert out[0, 6].item() == pytest.approx(2.0)


def test_penalties_apply_only_to_their_own_row() -> None:
    logits = torch.ones(2, VOCAB)
    penalised = make_request(SamplingParams(presence_penalty=1.0), output_token_ids=[2], request_id="a")
    plain = make_request(SamplingParams(), output_token_ids=[2], request_id="b")
    out = Sampler._apply_penalties_and_masks(logits, [penalised, plain])
    assert out[0, 2].item() == pytest.approx(0.0)
    assert torch.equal(out[1], logits[1])


def test_repetition_penalty_changes_the_greedy_choice() -> None:
    logits = torch.zeros(1, VOCAB)
    logits[0, 10], logits[0, 11] = 2.0, 1.5
    params = SamplingParams(temperature=0.0, repetition_penalty=2.0)
    token = Sampler()(logits, [make_request(params, prompt_token_ids=[10])])[0]
    assert token.token_id == 11


# --- min_tokens ------------------------------------------------------------------------


def test_min_tokens_masks_eos_and_stop_token_ids_until_reached() -> None:
    logits = torch.zeros(1, VOCAB)
    params = SamplingParams(min_tokens=3, stop_token_ids=[20, 21])
    request = make_request(params, output_token_ids=[1, 2])  # 2 < 3 generated
    out = Sampler._apply_penalties_and_masks(logits, [request])
    for banned in (EOS, 20, 21):
        assert out[0, banned].item() == float("-inf")
    assert torch.isfinite(out[0, [i for i in range(VOCAB) if i not in (EOS, 20, 21)]]).all()


def test_min_tokens_mask_lifts_once_reached() -> None:
    logits = torch.zeros(1, VOCAB)
    params = SamplingParams(min_tokens=3, stop_token_ids=[20])
    request = make_request(params, output_token_ids=[1, 2, 4])  # 3 generated
    out = Sampler._apply_penalties_and_masks(logits, [request])
    assert torch.equal(out, logits)


def test_min_tokens_keeps_greedy_off_eos() -> None:
    logits = torch.zeros(1, VOCAB)
    logits[0, EOS], logits[0, 30] = 10.0, 1.0
    params = SamplingParams(temperature=0.0, min_tokens=1)
    assert Sampler()(logits, [make_request(params)])[0].token_id == 30
    reached = make_request(params, output_token_ids=[30])
    assert Sampler()(logits, [reached])[0].token_id == EOS


def test_min_tokens_with_ignore_eos_leaves_eos_unmasked() -> None:
    logits = torch.zeros(1, VOCAB)
    params = SamplingParams(min_tokens=2, ignore_eos=True, stop_token_ids=[20])
    out = Sampler._apply_penalties_and_masks(logits, [make_request(params)])
    assert out[0, EOS].item() == 0.0
    assert out[0, 20].item() == float("-inf")


# --- logprobs --------------------------------------------------------------------------


@pytest.mark.parametrize("num_top", [0, 1, 5, 20])
def test_logprobs_of_greedy_token(num_top: int) -> None:
    torch.manual_seed(2)
    logits = torch.randn(1, VOCAB) * 3  # [1, V]
    params = SamplingParams(temperature=0.0, logprobs=num_top)
    token = Sampler()(logits, [make_request(params)])[0]
    assert token.logprobs is not None
    expected = torch.log_softmax(logits[0], dim=-1)
    assert token.logprobs.token_id == token.token_id == int(logits.argmax())
    assert token.logprobs.logprob == pytest.approx(float(expected[token.token_id]), abs=1e-6)
    assert token.logprobs.rank == 1
    top = token.logprobs.top
    assert len(top) == num_top
    values = list(top.values())
    assert values == sorted(values, reverse=True)
    assert list(top) == expected.topk(num_top).indices.tolist()
    for token_id, value in top.items():
        assert value == pytest.approx(float(expected[token_id]), abs=1e-6)


def test_logprobs_rank_of_sampled_tokens() -> None:
    torch.manual_seed(3)
    logits = torch.randn(VOCAB) * 0.5  # [V], flat enough that non-argmax tokens get drawn
    expected = torch.log_softmax(logits, dim=-1)
    order = expected.argsort(descending=True).tolist()
    params = SamplingParams(temperature=1.0, logprobs=2)
    requests = [make_request(replace(params, seed=i), request_id=str(i)) for i in range(100)]
    tokens = Sampler()(logits.unsqueeze(0).expand(100, -1), requests)
    ranks = []
    for token in tokens:
        assert token.logprobs is not None
        assert token.logprobs.logprob == pytest.approx(float(expected[token.token_id]), abs=1e-6)
        assert token.logprobs.rank == order.index(token.token_id) + 1
        assert len(token.logprobs.top) == 2
        ranks.append(token.logprobs.rank)
    assert max(ranks) > 2  # some draws were not among the top-2


def test_logprobs_are_of_the_raw_distribution_not_the_penalised_one() -> None:
    torch.manual_seed(4)
    logits = torch.randn(1, VOCAB)
    params = SamplingParams(temperature=0.5, seed=0, logprobs=3, repetition_penalty=1.8, presence_penalty=1.0)
    request = make_request(params, prompt_token_ids=list(range(10)), output_token_ids=[12, 13])
    token = Sampler()(logits, [request])[0]
    expected = torch.log_softmax(logits[0], dim=-1)
    assert token.logprobs is not None
    assert token.logprobs.logprob == pytest.approx(float(expected[token.token_id]), abs=1e-6)
    assert list(token.logprobs.top) == expected.topk(3).indices.tolist()


def test_logprobs_only_for_requests_that_ask() -> None:
    logits = torch.randn(2, VOCAB)
    requests = [
        make_request(SamplingParams(temperature=0.0, logprobs=2), request_id="a"),
        make_request(SamplingParams(temperature=0.0), request_id="b"),
    ]
    tokens = Sampler()(logits, requests)
    assert tokens[0].logprobs is not None
    assert tokens[1].logprobs is None

