"""Per-row samplers: each filter keeps what it should, on the tempered distribution."""

from __future__ import annotations

import mlx.core as mx
import pytest

from mlx_trio.engine.params import SamplingParams
from mlx_trio.engine.vocabulary.sampling import RowSampler

# Five tokens: probabilities 0.5, 0.25, 0.15, 0.07, 0.03.
LOGPROBS = mx.log(mx.array([[0.5, 0.25, 0.15, 0.07, 0.03]]))


def drawn(params: SamplingParams, n: int = 400) -> set[int]:
    sampler = RowSampler(params)
    return {sampler(LOGPROBS).item() for _ in range(n)}


@pytest.mark.parametrize(
    ("knobs", "kept"),
    [
        ({}, {0, 1, 2, 3, 4}),
        ({"top_k": 2}, {0, 1}),
        ({"top_p": 0.7}, {0, 1}),  # 0.5 + 0.25 reaches 0.7
        ({"min_p": 0.4}, {0, 1}),  # at least 0.4 x 0.5
        # The temperature comes first: at 0.5 the probabilities are 0.73, 0.18, 0.07, 0.01,
        # 0.003, and top_p 0.8 keeps two tokens; on the untempered ones it keeps three.
        ({"temperature": 0.5, "top_p": 0.8}, {0, 1}),
        ({"temperature": 1.0, "top_p": 0.8}, {0, 1, 2}),
    ],
)
def test_each_filter_keeps_only_its_tokens(knobs, kept):
    params = SamplingParams(**{"temperature": 1.0, "seed": 3, **knobs})
    assert drawn(params) == kept


def test_a_seeded_row_repeats_and_unseeded_rows_differ():
    params = SamplingParams(temperature=1.0, seed=11)
    first, again = RowSampler(params), RowSampler(params)
    assert [first(LOGPROBS).item() for _ in range(20)] == [
        again(LOGPROBS).item() for _ in range(20)
    ]
    unseeded = SamplingParams(temperature=1.0)
    runs = {tuple(RowSampler(unseeded)(LOGPROBS).item() for _ in range(20)) for _ in range(3)}
    assert len(runs) > 1
