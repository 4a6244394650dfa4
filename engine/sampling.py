"""Per-request samplers and logits processors, built from mlx-lm's parts.

Greedy rows get ``None`` (the batch's shared argmax, one call for all greedy rows). A seeded
row gets a :class:`SeededSampler` that owns its own PRNG key, so its draws do not depend on
which other rows share the batch. Unseeded sampling uses mlx-lm's ``make_sampler``.
"""

from __future__ import annotations

from collections.abc import Callable

import mlx.core as mx
from mlx_lm.sample_utils import (
    apply_min_p,
    apply_top_k,
    apply_top_p,
    make_logits_processors,
    make_sampler,
)

from mlx_trio.engine.params import SamplingParams

Sampler = Callable[[mx.array], mx.array]
LogitsProcessor = Callable[[mx.array, mx.array], mx.array]

# OpenAI's penalties look at everything generated so far, mlx-lm's at the last N tokens.
PENALTY_CONTEXT_SIZE = 1024


class SeededSampler:
    """Top-p / min-p / top-k filtering, then a categorical draw from a per-request key."""

    def __init__(self, params: SamplingParams) -> None:
        assert params.seed is not None and not params.is_greedy
        self._key = mx.random.key(params.seed)
        self._inv_temperature = 1.0 / params.temperature
        self._params = params

    def __call__(self, logprobs: mx.array) -> mx.array:
        p = self._params
        if 0.0 < p.top_p < 1.0:
            logprobs = apply_top_p(logprobs, p.top_p)
        if p.min_p > 0.0:
            logprobs = apply_min_p(logprobs, p.min_p)
        if p.top_k > 0:
            logprobs = apply_top_k(logprobs, p.top_k)
        self._key, key = mx.random.split(self._key)
        return mx.random.categorical(logprobs * self._inv_temperature, key=key)


def make_row_sampler(params: SamplingParams) -> Sampler | None:
    """The sampler for one request; None means greedy."""
    if params.is_greedy:
        return None
    if params.seed is not None:
        return SeededSampler(params)
    return make_sampler(
        temp=params.temperature, top_p=params.top_p, min_p=params.min_p, top_k=params.top_k
    )


def make_row_processors(params: SamplingParams) -> list[LogitsProcessor]:
    """Logit bias and penalties for one request (empty when none is set)."""
    return make_logits_processors(
        logit_bias=dict(params.logit_bias) or None,
        repetition_penalty=params.repetition_penalty if params.repetition_penalty != 1.0 else None,
        repetition_context_size=PENALTY_CONTEXT_SIZE,
        presence_penalty=params.presence_penalty or None,
        presence_context_size=PENALTY_CONTEXT_SIZE,
        frequency_penalty=params.frequency_penalty or None,
        frequency_context_size=PENALTY_CONTEXT_SIZE,
    )
