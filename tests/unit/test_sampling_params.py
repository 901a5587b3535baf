"""SamplingParams validation: every bad value is refused with a message naming it."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest

from vllm_cluster.engine.errors import InvalidRequestError
from vllm_cluster.engine.sampling_params import SamplingParams


@pytest.mark.parametrize(
    ("options", "named"),
    [
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_p": -0.5}, "top_p"),
        ({"top_p": float("nan")}, "top_p"),
        ({"n": 0}, "^n must"),
        ({"n": -3}, "^n must"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": -1}, "max_tokens"),
        ({"top_k": -2}, "top_k"),
        ({"min_p": 2.0}, "min_p"),
        ({"min_p": -0.1}, "min_p"),
        ({"min_tokens": -1}, "min_tokens"),
        ({"min_tokens": 17, "max_tokens": 16}, "min_tokens"),
        ({"stop": [""]}, "stop"),
        ({"stop": ["ok", ""]}, "stop"),
        ({"stop": ""}, "stop"),
        ({"stop_token_ids": [-1]}, "stop_token_ids"),
        ({"logprobs": 21}, "logprobs"),
        ({"logprobs": -1}, "logprobs"),
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"presence_penalty": -2.5}, "presence_penalty"),
        ({"frequency_penalty": 2.1}, "frequency_penalty"),
        ({"frequency_penalty": -3.0}, "frequency_penalty"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"repetition_penalty": -1.0}, "repetition_penalty"),
        ({"repetition_penalty": 2.5}, "repetition_penalty"),
        ({"repetition_penalty": float("nan")}, "repetition_penalty"),
        ({"presence_penalty": float("nan")}, "presence_penalty"),
        ({"seed": 1.5}, "seed"),
    ],
)
def test_invalid_value_raises_naming_the_parameter(options: dict[str, Any], named: str) -> None:
    with pytest.raises(InvalidRequestError, match=named):
        SamplingParams(**options)


@pytest.mark.parametrize(
    "options",
    [
        {"temperature": 0.0},
        {"top_p": 1.0},
        {"top_p": 1e-3},
        {"n": 1},
        {"max_tokens": 1},
        {"max_tokens": None, "min_tokens": 100},
        {"top_k": 0},
        {"top_k": 1},
        {"min_p": 0.0},
        {"min_p": 1.0},
        {"min_tokens": 16, "max_tokens": 16},
        {"logprobs": 0},
        {"logprobs": 20},
        {"presence_penalty": 2.0, "frequency_penalty": -2.0},
        {"repetition_penalty": 2.0},
        {"seed": 0},
    ],
)
def test_boundary_values_are_accepted(options: dict[str, Any]) -> None:
    params = SamplingParams(**options)
    for name, value in options.items():
        assert getattr(params, name) == value


def test_invalid_request_error_is_a_value_error() -> None:
    # Callers that catch ValueError (as with vLLM) still catch it.
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-1.0)


def test_message_shows_the_offending_value() -> None:
    with pytest.raises(InvalidRequestError, match="1.5"):
        SamplingParams(top_p=1.5)


def test_top_k_minus_one_normalises_to_zero() -> None:
    assert SamplingParams(top_k=-1).top_k == 0


def test_str_stop_becomes_a_list() -> None:
    assert SamplingParams(stop="END").stop == ["END"]


def test_stop_sequences_are_copied_into_lists() -> None:
    stop = ("a", "b")
    stop_token_ids = (3, 4)
    params = SamplingParams(stop=stop, stop_token_ids=stop_token_ids)  # type: ignore[arg-type]
    assert params.stop == ["a", "b"]
    assert params.stop_token_ids == [3, 4]


def test_default_lists_are_not_shared() -> None:
    first, second = SamplingParams(), SamplingParams()
    first.stop.append("x")
    assert second.stop == []


@pytest.mark.parametrize(
    ("temperature", "greedy"), [(0.0, True), (1e-6, True), (0.01, False), (1.0, False)]
)
def test_is_greedy(temperature: float, greedy: bool) -> None:
    assert SamplingParams(temperature=temperature).is_greedy is greedy


@pytest.mark.parametrize(
    ("options", "has"),
    [
        ({}, False),
        ({"presence_penalty": 0.1}, True),
        ({"frequency_penalty": -0.1}, True),
        ({"repetition_penalty": 1.1}, True),
    ],
)
def test_has_penalties(options: dict[str, Any], has: bool) -> None:
    assert SamplingParams(**options).has_penalties is has


def test_replace_validates_again() -> None:
    with pytest.raises(InvalidRequestError, match="^n must"):
        replace(SamplingParams(), n=0)
