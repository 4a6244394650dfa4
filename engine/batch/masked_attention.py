"""The batch's masked prefill attention in plain MLX ops on CUDA, not through cuDNN.

mlx-lm's batch prefill (``PromptProcessingBatch.prompt``) pads its rows and attends with an
array mask. On CUDA, MLX runs attention of more than one query through cuDNN, which builds a
graph for every new shape (rows, query length, key length: ``sdpa_cache`` in MLX's
``scaled_dot_product_attention.cpp``) and keeps up to 256. Measured on an H100 (design/030,
section 6), the first call at a new shape took 44-1,412 ms (728-1,412 ms at 128 rows), later
ones 0.4-2.2 ms; the same attention as two matmuls and a softmax took 0.6-18 ms the first time
and 0.6-3.6 ms after. A burst of requests reaches the batch in waves of whatever size the
server's pace makes, each a new shape: a join paid the build, the first burst after startup
the most.

:func:`plain_masked_attention` swaps ``mx.fast.scaled_dot_product_attention`` for
:func:`attention` while the batch prefills (the only caller is the engine thread). It computes
array-masked attention of several queries in plain ops where the scores stay within
``MAX_SCORES`` elements, and leaves every other call to MLX: one query (a decode step, MLX's
own kernel), a causal or no mask (the prompts prefilled alone), attention sinks, larger scores.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import Any

from .. import _blas  # noqa: F401  (loads OpenBLAS: before MLX below)

# isort: split
import mlx.core as mx

# The scores of one layer's attention, as elements (float32 in the softmax: 1 GiB).
MAX_SCORES = 1 << 28

_fused = mx.fast.scaled_dot_product_attention


def attention(
    queries: mx.array,
    keys: mx.array,
    values: mx.array,
    *,
    scale: float,
    mask: Any = None,
    sinks: mx.array | None = None,
    **kwargs: Any,
) -> mx.array:
    """``mx.fast.scaled_dot_product_attention``, in plain ops where :func:`takes` says so."""
    if not takes(queries, keys, mask, sinks):
        return _fused(queries, keys, values, scale=scale, mask=mask, sinks=sinks, **kwargs)
    return plain(queries, keys, values, scale, mask)


def takes(queries: mx.array, keys: mx.array, mask: Any, sinks: mx.array | None) -> bool:
    """Whether attention is done in plain ops: several queries under an array mask, no sinks,
    and scores within ``MAX_SCORES``."""
    if not isinstance(mask, mx.array) or sinks is not None or queries.shape[2] < 2:
        return False
    batch, heads, length, _ = queries.shape
    return batch * heads * length * keys.shape[2] <= MAX_SCORES


def plain(
    queries: mx.array, keys: mx.array, values: mx.array, scale: float, mask: mx.array
) -> mx.array:
    """Attention of ``queries`` (batch, heads, length, dim) over ``keys`` and ``values``
    (batch, kv heads, keys, dim), grouped-query heads included; ``mask``: boolean (True
    attends) or added to the scores, broadcast against (batch, heads, length, keys)."""
    batch, heads, length, dim = queries.shape
    kv_heads, num_keys = keys.shape[1], keys.shape[2]
    group = heads // kv_heads
    queries = (queries * scale).reshape(batch, kv_heads, group, length, dim)
    scores = queries @ keys[:, :, None].swapaxes(-1, -2)  # (batch, kv heads, group, length, keys)
    if mask.ndim == 4 and mask.shape[1] == heads and heads > 1:  # a mask per head
        mask = mask.reshape(mask.shape[0], kv_heads, group, length, num_keys)
    elif mask.ndim == 4:
        mask = mask[:, :, None]
    if mask.dtype == mx.bool_:
        scores = mx.where(mask, scores, mx.array(-float("inf"), scores.dtype))
    else:
        scores = scores + mask.astype(scores.dtype)
    weights = mx.softmax(scores.astype(mx.float32), axis=-1).astype(values.dtype)
    out = weights @ values[:, :, None]
    return out.reshape(batch, heads, length, values.shape[-1])


@contextmanager
def swapped(replacement: Callable[..., mx.array], enabled: bool = True) -> Iterator[None]:
    """While inside, MLX's ``mx.fast.scaled_dot_product_attention`` is ``replacement``
    (``enabled``: else unchanged); the models call it through that name."""
    if not enabled:
        yield
        return
    before = mx.fast.scaled_dot_product_attention
    mx.fast.scaled_dot_product_attention = replacement
    try:
        yield
    finally:
        mx.fast.scaled_dot_product_attention = before


def plain_masked_attention(enabled: bool = True) -> AbstractContextManager[None]:
    """While inside, MLX's attention is :func:`attention` (``enabled``: else unchanged)."""
    return swapped(attention, enabled)


def wanted(device: str) -> bool:
    """Whether a model on ``device`` prefills its batch with :func:`attention`: on CUDA."""
    return device == "gpu" and mx.cuda.is_available()
