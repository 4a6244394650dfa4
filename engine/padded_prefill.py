"""Prefill chunks padded so that their shapes repeat (a GPU builds kernels per shape).

On CUDA, MLX builds per shape what a prefill forward runs: cuDNN's attention graph for each
(query length, key length), the matrix products' plans for each row count. A prompt of a length
not seen before pays for that build inside its first token: design/027 measured it for long
prompts, design/030 for short ones (a lone stream's first token).

So a chunk is padded on the right to a multiple of ``PAD_GRANULE`` tokens (at most to the chunk
limit) by repeating its last token, and the padding is trimmed off the caches after the forward.
The causal mask keeps the real tokens from reading the padding, so the caches and the logits of
the real tokens are what the unpadded forward gives. Only plain ``KVCache``\\ s trim exactly:
a recurrent state, a rotating window or quantized keys would keep something of the padding, and
such caches are fed unpadded.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any

from . import _blas  # noqa: F401  (loads OpenBLAS: before MLX below)

# isort: split
import mlx.core as mx
from mlx_lm.models.cache import KVCache

# A chunk is padded to a multiple of this many tokens: at most 15 last-chunk shapes per
# 2,048-token chunk, and at most 127 padded tokens (6% of a 2,048-token prompt; on a short
# prompt the forward reads the weights once either way).
PAD_GRANULE = 128
# Whether a padded prefill first cuts its caches back to a multiple of PAD_GRANULE (a bench's
# switch: bench/lone_stream.py).
ALIGN = True


def can_pad(caches: Sequence[Any]) -> bool:
    """Whether ``caches`` trim back exactly what a padded chunk added (plain ``KVCache``)."""
    return bool(caches) and all(type(c) is KVCache for c in caches)


def feed_padded(model: Any, tokens: Sequence[int], caches: list[Any], *, max_chunk: int) -> None:
    """Feed ``tokens`` (one chunk, at most ``max_chunk``) to ``model`` over ``caches``, padded
    to a multiple of ``PAD_GRANULE`` (at most to ``max_chunk``) and trimmed back; lazily (the
    caller evaluates). The caller checks :func:`can_pad`."""
    pad = min(-len(tokens) % PAD_GRANULE, max_chunk - len(tokens))
    piece = list(tokens) + [tokens[-1]] * max(pad, 0)
    model(mx.array(piece)[None], cache=caches)
    if pad > 0:
        for cache in caches:
            cache.trim(pad)


ProgressCallback = Callable[[int, int], None]


def offset_progress(on_progress: ProgressCallback | None, done: int) -> ProgressCallback | None:
    """``generate_step``'s progress past ``done`` tokens prefilled before it."""
    if on_progress is None or done == 0:
        return on_progress
    return lambda processed, total: on_progress(processed + done, total + done)


def prefill_then(
    model: Any,
    history: Sequence[int],
    prompt: Sequence[int],
    caches: list[Any],
    *,
    max_chunk: int,
    stream: Any,
    steps: Callable[[Sequence[int], int], Iterator[tuple[int, mx.array]]],
) -> Iterator[tuple[int, mx.array]]:
    """Prefill ``prompt`` but its last token over ``caches`` (which hold ``history``) in padded
    chunks (on ``stream``), then go on with ``steps(last_token, prefilled)``: a row's steps
    from there. Where ``ALIGN``, the caches are first cut back to a multiple of
    ``PAD_GRANULE`` and the tokens cut off prefilled again with the prompt, so that the keys'
    length repeats too (a prompt cache's hit is a common prefix: any length), and so is their
    buffer's (a hit's is a slice of its entry's, of any length, which a cache's growth then
    extends by whole steps: a buffer of a new length each time). Lazy, as
    ``generate_step``'s own prefill is: nothing runs before the first token is asked for, and
    closing it closes the steps."""
    cut = len(history) % PAD_GRANULE if ALIGN else 0
    if ALIGN:
        _cut_back(caches, len(history) - cut)
    head = [*history[len(history) - cut :], *prompt[:-1]]
    with mx.stream(stream):
        for start in range(0, len(head), max_chunk):
            feed_padded(model, head[start : start + max_chunk], caches, max_chunk=max_chunk)
            mx.eval([c.state for c in caches])
    yield from steps(prompt[-1:], len(prompt) - 1)


def _cut_back(caches: list[Any], keep: int) -> None:
    """Make each ``KVCache`` hold its first ``keep`` tokens in buffers of exactly that length
    (none for 0), whatever buffer they held them in."""
    for cache in caches:
        if keep == 0:
            cache.keys = cache.values = None
        else:
            cache.keys = cache.keys[..., :keep, :]
            cache.values = cache.values[..., :keep, :]
        cache.offset = keep
