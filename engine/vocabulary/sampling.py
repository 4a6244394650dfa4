"""Per-request samplers and logits processors.

Greedy rows get ``None`` (the batch's shared argmax, one call for all greedy rows). Every other
row gets a :class:`RowSampler` that owns its PRNG key (from the request's ``seed``, or a fresh
random one): no row reads or writes MLX's global random state, so one row's draws do not depend
on which rows share its batch, and a sampler that fails cannot break the draws of the rest.

The filters are written here rather than taken from ``mlx_lm.sample_utils``: mlx-lm compiles
its filters with MLX's global random state as an input and output, and a filter that raises
while being traced (``apply_top_k`` with ``top_k`` >= the vocabulary, say) leaves that state a
placeholder that every later unseeded draw fails on ("Attempting to eval an array without a
primitive"); its compiled functions also take ``top_p``, ``min_p`` and the temperature as
constants, one trace kept per value a client chooses. Ours capture no state and take those as
arrays. Penalties and logit bias are mlx-lm's processors.
"""

from __future__ import annotations

import logging
import math
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

logger = logging.getLogger(__name__)

Sampler = Callable[[mx.array], mx.array]
LogitsProcessor = Callable[[mx.array, mx.array], mx.array]

# OpenAI's penalties look at everything generated so far, mlx-lm's at the last N tokens.
PENALTY_CONTEXT_SIZE = 1024


def keep_top_k(logprobs: mx.array, k: int) -> mx.array:
    """Mask all but the ``k`` most likely tokens; a ``k`` past the vocabulary keeps all.
    (Not compiled: ``argpartition`` takes ``k`` as a constant, one trace per value.)"""
    vocab = logprobs.shape[-1]
    if k >= vocab:
        return logprobs
    dropped = mx.argpartition(-logprobs, kth=k - 1, axis=-1)[..., k:]
    return mx.put_along_axis(logprobs, dropped, mx.array(-math.inf, logprobs.dtype), axis=-1)


def keep_top_p(logits: mx.array, p: mx.array) -> mx.array:
    """Keep the smallest set of most likely tokens whose probability reaches ``p`` (``logits``
    need not be normalized: the mass is summed here)."""
    ascending = mx.sort(logits, axis=-1)
    probs = mx.exp(ascending.astype(mx.float32))
    mass_above = mx.cumsum(probs, axis=-1, reverse=True, inclusive=False)
    total = mass_above[..., :1] + probs[..., :1]
    num_dropped = (mass_above >= p * total).sum(axis=-1, keepdims=True)
    threshold = mx.take_along_axis(ascending, num_dropped, axis=-1)
    return mx.where(logits < threshold, -math.inf, logits)


def keep_min_p(logits: mx.array, log_min_p: mx.array) -> mx.array:
    """Keep the tokens at least ``exp(log_min_p)`` times as likely as the most likely one."""
    floor = mx.max(logits, axis=-1, keepdims=True) + log_min_p
    return mx.where(logits < floor, -math.inf, logits)


def temper(
    logprobs: mx.array,
    inv_temperature: mx.array,
    top_p: mx.array | None = None,
    log_min_p: mx.array | None = None,
) -> mx.array:
    """The temperature, then top-p and min-p (each off where None) on the tempered
    distribution. The parameters are arrays, so one compiled trace serves every value."""
    logits = logprobs * inv_temperature
    if top_p is not None:
        logits = keep_top_p(logits, top_p)
    if log_min_p is not None:
        logits = keep_min_p(logits, log_min_p)
    return logits


def draw(logits: mx.array, key: mx.array) -> tuple[mx.array, mx.array]:
    """A categorical draw from ``key``; returns the token and the next key."""
    key, subkey = mx.random.split(key)
    return mx.random.categorical(logits, key=subkey), key


# Compiled, each is one launch of fused kernels rather than one per op (on a GPU a row's draw is
# launch-bound). They capture no state: one that raises while being traced breaks nothing else.
# A filter that is off is a None, a constant of the trace: at most four traces of each.
_temper = mx.compile(temper)
_draw = mx.compile(draw)
_temper_and_draw = mx.compile(lambda logprobs, key, *filters: draw(temper(logprobs, *filters), key))


def random_seed() -> int:
    """A fresh seed for a row that asked for none."""
    return secrets.randbits(63)


class RowSampler:
    """The temperature, then top-p, min-p and top-k filtering of the tempered distribution (the
    order of Hugging Face's and vLLM's samplers, so a model's ``generation_config.json`` means
    here what its authors meant), then a categorical draw from the row's own key."""

    def __init__(self, params: SamplingParams) -> None:
        assert not params.is_greedy
        self._key = mx.random.key(params.seed if params.seed is not None else random_seed())
        self._filters = (  # temper's parameters
            mx.array(1.0 / params.temperature),
            mx.array(params.top_p) if 0.0 < params.top_p < 1.0 else None,
            mx.array(math.log(params.min_p)) if params.min_p > 0.0 else None,
        )
        self._top_k = params.top_k

    def __call__(self, logprobs: mx.array) -> mx.array:
        if self._top_k > 0:  # top-k cannot be compiled for every k: three launches
            logits = keep_top_k(_temper(logprobs, *self._filters), self._top_k)
            token, self._key = _draw(logits, self._key)
        else:
            token, self._key = _temper_and_draw(logprobs, self._key, *self._filters)
        return token


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
