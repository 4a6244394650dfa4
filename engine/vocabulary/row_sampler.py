"""A row's sampler: the temperature, top-p, min-p and top-k, then a categorical draw from the
row's own key, in MLX alone (no mlx-lm: the kernel primers' ``sampler`` compiles these kernels
in a process that imports nothing else, ``engine/primers.py``).

The filters are written here rather than taken from ``mlx_lm.sample_utils``: mlx-lm compiles
its filters with MLX's global random state as an input and output, and a filter that raises
while being traced (``apply_top_k`` with ``top_k`` >= the vocabulary, say) leaves that state a
placeholder that every later unseeded draw fails on ("Attempting to eval an array without a
primitive"); its compiled functions also take ``top_p``, ``min_p`` and the temperature as
constants, one trace kept per value a client chooses. Ours capture no state and take those as
arrays. Penalties and logit bias are mlx-lm's processors (``sampling.py``).
"""

from __future__ import annotations

import math
import secrets

from .. import _blas  # noqa: F401  (loads OpenBLAS: before MLX below)

# isort: split
import mlx.core as mx

from ..params import SamplingParams


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
