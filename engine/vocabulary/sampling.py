"""Per-request samplers and logits processors.

Greedy rows get ``None`` (the batch's shared argmax, one call for all greedy rows). Every other
row gets a :class:`RowSampler` that owns its PRNG key (from the request's ``seed``, or a fresh
random one): no row reads or writes MLX's global random state, so one row's draws do not depend
on which rows share its batch, and a sampler that fails cannot break the draws of the rest.

The sampler's arithmetic is ``row_sampler.py`` (MLX alone); penalties and logit bias are
mlx-lm's processors, here.
"""

from __future__ import annotations

import logging
import secrets
from collections.abc import Callable
from functools import partial
from typing import Any

from .. import _blas  # noqa: F401  (loads OpenBLAS: before MLX below)

# isort: split
import mlx.core as mx
from mlx_lm.sample_utils import apply_top_k, greedy_sampler, make_logits_processors

from ..errors import InvalidRequestError
from ..params import PreparedRequest, SamplingParams
from .grammar import grammar_processor
from .row_sampler import RowSampler

logger = logging.getLogger(__name__)

Sampler = Callable[[mx.array], mx.array]
LogitsProcessor = Callable[[mx.array, mx.array], mx.array]

# OpenAI's penalties look at everything generated so far, mlx-lm's at the last N tokens.
PENALTY_CONTEXT_SIZE = 1024


class FailingSampler:
    """Fault injection (the chaos harness's ``sampler_error``): samples as ``inner`` until its
    ``fail_at``-th call (from 0), which fails inside MLX's sampling path the way a bad request
    once did: mlx-lm's compiled ``apply_top_k`` raising mid-trace with ``top_k`` equal to the
    vocabulary, which also leaves MLX's global random state broken."""

    def __init__(self, inner: Sampler | None, fail_at: int) -> None:
        self._inner = inner or greedy_sampler
        self._calls = 0
        self._fail_at = fail_at

    def __call__(self, logprobs: mx.array) -> mx.array:
        self._calls += 1
        if self._calls > self._fail_at:
            return apply_top_k(logprobs, logprobs.shape[-1])
        return self._inner(logprobs)


def make_row_sampler(params: SamplingParams) -> Sampler | None:
    """The sampler for one request; None means greedy."""
    return None if params.is_greedy else RowSampler(params)


def with_injected_fault(sampler: Sampler | None, request: PreparedRequest) -> Sampler | None:
    """``sampler``, or a :class:`FailingSampler` around it where the request carries an
    injected sampler fault."""
    if request.fail_sampler_at is None:
        return sampler
    return FailingSampler(sampler, request.fail_sampler_at)


def repair_random_state() -> None:
    """Re-seed MLX's global random state if a failed compiled function left it unusable.
    Nothing of ours draws from it, but mlx-lm or a model may."""
    try:
        mx.eval(mx.random.state)
    except Exception:  # "Attempting to eval an array without a primitive"
        mx.random.seed(secrets.randbits(32))
        logger.warning("MLX's global random state was broken by a failed sampler; re-seeded it")


def with_history(processors: list[LogitsProcessor], history: list[int]) -> list[LogitsProcessor]:
    """``processors`` for a ``generate_step`` that starts past ``history`` (a prompt-cache hit,
    or a row that left the batch): ``generate_step`` hands them only the tokens it was given
    and sampled, so each gets the last ``PENALTY_CONTEXT_SIZE`` tokens of ``history`` first."""
    if not processors or not history:
        return processors
    before = mx.array(history[-PENALTY_CONTEXT_SIZE:])
    return [partial(_after, before, processor) for processor in processors]


def _after(
    before: mx.array, processor: LogitsProcessor, tokens: mx.array, logits: mx.array
) -> mx.array:
    return processor(mx.concatenate([before, tokens.astype(before.dtype)]), logits)


def make_row_processors(params: SamplingParams, tokenizer: Any = None) -> list[LogitsProcessor]:
    """Logit bias and penalties for one request (empty when none is set), then its grammar's
    mask (``engine/vocabulary/grammar.py``; it needs the model's ``tokenizer``)."""
    processors = make_logits_processors(
        logit_bias=dict(params.logit_bias) or None,
        repetition_penalty=params.repetition_penalty if params.repetition_penalty != 1.0 else None,
        repetition_context_size=PENALTY_CONTEXT_SIZE,
        presence_penalty=params.presence_penalty or None,
        presence_context_size=PENALTY_CONTEXT_SIZE,
        frequency_penalty=params.frequency_penalty or None,
        frequency_context_size=PENALTY_CONTEXT_SIZE,
    )
    if params.grammar is not None:
        if tokenizer is None:
            raise InvalidRequestError("a grammar needs the model's tokenizer", param="grammar")
        processors.append(grammar_processor(params.grammar, tokenizer))
    return processors
