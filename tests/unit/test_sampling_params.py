"""SamplingParams: vLLM's defaults and names, normalization, validation errors naming the field."""

from __future__ import annotations

from typing import Any

import pytest

from inferd.errors import InvalidRequestError
from inferd.sampling.params import SamplingParams

pytestmark = pytest.mark.unit


def test_defaults_are_vllms() -> None:
    p = SamplingParams()
    assert (p.n, p.temperature, p.top_p, p.top_k, p.min_p) == (1, 1.0, 1.0, 0, 0.0)
    assert (p.repetition_penalty, p.presence_penalty, p.frequency_penalty) == (1.0, 0.0, 0.0)
    assert (p.max_tokens, p.min_tokens, p.seed, p.logprobs) == (16, 0, None, None)
    assert p.skip_special_tokens and not p.include_stop_str_in_output and not p.ignore_eos
    assert p.stop_strings == ()
    assert not p.greedy


def test_top_k_minus_one_means_off() -> None:
    assert SamplingParams(top_k=-1).top_k == 0


@pytest.mark.parametrize(
    ("stop", "expected"),
    [(None, ()), ("\n", ("\n",)), (["a", "bc"], ("a", "bc")), ([], ())],
)
def test_stop_normalized_to_tuple(stop: Any, expected: tuple[str, ...]) -> None:
    assert SamplingParams(stop=stop).stop_strings == expected


@pytest.mark.parametrize(("temperature", "greedy"), [(0.0, True), (1e-6, True), (0.01, False)])
def test_greedy_below_epsilon(temperature: float, greedy: bool) -> None:
    assert SamplingParams(temperature=temperature).greedy is greedy


def test_for_child_keeps_seeds_distinct() -> None:
    p = SamplingParams(n=3, seed=7, temperature=0.5)
    children = [p.for_child(i) for i in range(3)]
    assert [c.seed for c in children] == [7, 8, 9]
    assert all(c.n == 1 and c.temperature == 0.5 for c in children)
    assert SamplingParams(n=2).for_child(1).seed is None


@pytest.mark.parametrize(
    ("kwargs", "param"),
    [
        ({"n": 0}, "n"),
        ({"n": 1.5}, "n"),
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"temperature": True}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"top_k": 2.0}, "top_k"),
        ({"min_p": -0.1}, "min_p"),
        ({"min_p": 1.1}, "min_p"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"repetition_penalty": float("inf")}, "repetition_penalty"),
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"frequency_penalty": -2.5}, "frequency_penalty"),
        ({"seed": "1"}, "seed"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"min_tokens": -1}, "min_tokens"),
        ({"min_tokens": 5, "max_tokens": 4}, "min_tokens"),
        ({"logprobs": 21}, "logprobs"),
        ({"logprobs": -1}, "logprobs"),
        ({"stop": ""}, "stop"),
        ({"stop": ["ok", ""]}, "stop"),
        ({"stop_token_ids": [-1]}, "stop_token_ids"),
    ],
)
def test_invalid_values_name_the_field(kwargs: dict[str, Any], param: str) -> None:
    with pytest.raises(InvalidRequestError) as err:
        SamplingParams(**kwargs)
    assert err.value.param == param
    assert isinstance(err.value, ValueError)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"temperature": 0.0, "max_tokens": 1},
        {"top_p": 1.0, "top_k": 50, "min_p": 1.0},
        {"presence_penalty": -2.0, "frequency_penalty": 2.0, "repetition_penalty": 0.5},
        {"max_tokens": None, "min_tokens": 100},
        {"logprobs": 0},
        {"logprobs": 20},
        {"stop_token_ids": [0, 2]},
        {"seed": 0},
    ],
)
def test_edge_values_accepted(kwargs: dict[str, Any]) -> None:
    params = SamplingParams(**kwargs)
    # Accepted as given: neither clamped nor replaced by a default.
    assert {name: getattr(params, name) for name in kwargs} == kwargs
