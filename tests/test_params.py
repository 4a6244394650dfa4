"""Sampling parameters are validated at construction, with the offending param named."""

from __future__ import annotations

import pickle
from types import MappingProxyType

import pytest

from mlx_trio.engine.errors import InvalidRequestError
from mlx_trio.engine.params import PreparedRequest, SamplingParams


@pytest.mark.parametrize(
    ("kwargs", "param", "message"),
    [
        ({"max_tokens": 0}, "max_tokens", r"^max_tokens must be >= 1, got 0$"),
        ({"max_tokens": 2.5}, "max_tokens", r"^max_tokens must be an integer, got 2\.5$"),
        ({"temperature": -0.1}, "temperature", r"^temperature must be in \[0, 2\], got -0\.1$"),
        ({"temperature": 2.5}, "temperature", r"^temperature must be in \[0, 2\], got 2\.5$"),
        ({"temperature": float("nan")}, "temperature", r"^temperature must be in"),
        ({"top_p": 0.0}, "top_p", r"^top_p must be in \(0, 1\], got 0\.0$"),
        ({"top_p": 1.5}, "top_p", r"^top_p must be in \(0, 1\]"),
        ({"top_k": -1}, "top_k", r"^top_k must be >= 0, got -1$"),
        ({"min_p": -0.5}, "min_p", r"^min_p must be in \[0, 1\]"),
        (
            {"repetition_penalty": 0},
            "repetition_penalty",
            r"^repetition_penalty must be in \(0, 2\]",
        ),
        ({"presence_penalty": 3}, "presence_penalty", r"^presence_penalty must be in \[-2, 2\]"),
        ({"frequency_penalty": -3}, "frequency_penalty", r"^frequency_penalty must be in"),
        ({"seed": -1}, "seed", r"^seed must be between 0 and"),
        ({"stop": ("a", "b", "c", "d", "e")}, "stop", r"^stop may hold at most 4 strings, got 5$"),
        ({"stop": ("",)}, "stop", r"^stop strings must not be empty$"),
        ({"stop": "abc"}, "stop", r"^stop must be a list of strings$"),
        ({"stop_token_ids": (-2,)}, "stop_token_ids", r"^stop_token_ids must be >= 0, got -2$"),
        ({"logit_bias": {5: 101.0}}, "logit_bias", r"^logit_bias must be in \[-100, 100\]"),
        ({"logit_bias": {-5: 1.0}}, "logit_bias", r"^logit_bias must be >= 0, got -5$"),
        (
            {"logprobs": True, "top_logprobs": 21},
            "top_logprobs",
            r"^top_logprobs must be between 0 and 20, got 21$",
        ),
        ({"top_logprobs": 3}, "top_logprobs", r"^top_logprobs requires logprobs to be true$"),
    ],
)
def test_out_of_range_values_are_refused(kwargs, param, message):
    with pytest.raises(InvalidRequestError, match=message) as info:
        SamplingParams(**kwargs)
    assert info.value.param == param


def test_defaults_and_edges_are_accepted():
    params = SamplingParams(
        temperature=0,
        top_p=1.0,
        top_k=0,
        seed=0,
        stop=("a", "b", "c", "d"),
        logprobs=True,
        top_logprobs=20,
        logit_bias={0: -100.0},
    )
    assert params.is_greedy
    assert not SamplingParams().is_greedy


def test_parameters_cross_to_an_engine_process_whole_logit_bias_included():
    params = SamplingParams(
        temperature=0.7, logit_bias=MappingProxyType({5: -100.0}), stop=("\n",), seed=3
    )
    copied = pickle.loads(pickle.dumps(PreparedRequest((1, 2, 3), params)))
    assert copied == PreparedRequest((1, 2, 3), params)
    assert isinstance(copied.params.logit_bias, MappingProxyType)
