"""A batch's decode attention in one kernel on CUDA, under the batch's array mask (issue 39).

mlx-lm's ``BatchKVCache`` left-pads its rows, so every decode step attends under an array mask
``(rows, 1, 1, keys)``. MLX 0.32's CUDA attention takes one query only without an array mask
(its vector kernel), and cuDNN only several queries: a decode step under a mask falls back to
plain ops, a product for the scores, the mask, a softmax and a product for the values, each
its own kernel, in every layer of every step.

:func:`attention` is that step's attention as one kernel through ``mx.fast.cuda_kernel``: a
block per row and KV head, its query heads together (grouped-query attention reads each key
once), warps striding over the keys with an online softmax in float32, then combined. It reads
the cache's keys and values where they are (a slice of the cache's buffer, by strides: no
copy), and keeps a key the mask excludes out of the softmax. It runs only for what it was
written for (see :func:`takes`) and leaves everything else to MLX.

:func:`kernel_attention` swaps it in while the generation batch steps (the engine thread is the
only caller), where :func:`wanted`: ``MLX_TRIO_DECODE_ATTENTION`` (``on``/``off``), else
:data:`DEFAULT_ON` on a CUDA GPU. :func:`sound` checks it against float32 attention first,
once a process for each group size and head size it meets; where its answers are off it is
not used (logged).
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from functools import cache
from typing import Any

from .. import _blas  # noqa: F401  (loads OpenBLAS: before MLX below)

# isort: split
import mlx.core as mx

from ..model import kernel_check
from ..model.switches import env_switch
from . import decode_attention_sources as sources
from .masked_attention import swapped

ENV = "MLX_TRIO_DECODE_ATTENTION"
DEFAULT_ON = True  # on a CUDA GPU: a batch step at 128 rows 0.58x the time (design/030, section 10)

WARPS = 4  # warps a block, each over every WARPS-th run of keys (4 x 4: the best plan measured)
UNROLL = 4  # keys a group of lanes loads before it uses the first
MIN_BLOCKS = 128  # rows x KV heads below which MLX's own path is left (too few blocks)
MAX_GROUP = 8  # query heads a KV head: each lane keeps 8 floats a head (8: 128 registers, no spill)
HEAD_SIZES = (64, 128)
DTYPES = (mx.bfloat16,)  # what sound() checks (the kernel itself reads float16 too)

_fused = mx.fast.scaled_dot_product_attention


@cache
def _kernel() -> Callable[..., list[mx.array]]:
    return mx.fast.cuda_kernel(
        name="trio_decode_attention",
        input_names=["q", "k", "v", "mask", "scale"],
        output_names=["out"],
        source=sources.SOURCE,
        header=sources.HEADER,
        ensure_row_contiguous=False,
    )


def written_for(heads: int, kv_heads: int, size: int) -> bool:
    """Whether the kernel was written for ``heads`` query heads over ``kv_heads`` of ``size``:
    a head size of 64 or 128, groups of at most 8 query heads a KV head."""
    return size in HEAD_SIZES and heads % kv_heads == 0 and heads // kv_heads <= MAX_GROUP


def takes(queries: mx.array, keys: Any, mask: Any, sinks: Any) -> bool:
    """Whether :func:`attention` runs the kernel: one query a row under a boolean mask of
    ``(rows or 1, 1, 1, keys)``, no sinks, a head size of 64 or 128 shared by keys and values
    (not a quantized cache's tuples), groups of at most 8 query heads a KV head, and enough
    rows x KV heads to fill the GPU."""
    if sinks is not None or not isinstance(mask, mx.array) or not isinstance(keys, mx.array):
        return False
    if queries.ndim != 4 or keys.ndim != 4 or mask.ndim != 4 or mask.dtype != mx.bool_:
        return False
    rows, heads, length, size = queries.shape
    kv_heads, num_keys = keys.shape[1], keys.shape[2]
    return (
        length == 1
        and written_for(heads, kv_heads, size)
        and keys.shape[-1] == size
        and queries.dtype in DTYPES
        and keys.dtype == queries.dtype
        and rows * kv_heads >= MIN_BLOCKS
        and mask.shape[0] in (1, rows)
        and mask.shape[1:3] == (1, 1)
        and mask.shape[3] == num_keys
        and num_keys >= 1
    )


def run(
    queries: mx.array,
    keys: mx.array,
    values: mx.array,
    scale: float,
    mask: mx.array,
    *,
    warps: int = WARPS,
    unroll: int = UNROLL,
) -> mx.array:
    """The kernel's attention (no checks: :func:`takes`); ``warps`` and ``unroll`` for a
    benchmark's other plans."""
    rows, heads, _, size = queries.shape
    kv_heads = keys.shape[1]
    (out,) = _kernel()(
        inputs=[queries, keys, values, mask, _scale(scale)],
        template=[
            ("T", queries.dtype),
            ("D", size),
            ("G", heads // kv_heads),
            ("WARPS", warps),
            ("U", unroll),
        ],
        grid=(kv_heads * warps * 32, rows, 1),
        threadgroup=(warps * 32, 1, 1),
        output_shapes=[(rows, heads, 1, size)],
        output_dtypes=[queries.dtype],
    )
    return out


@cache
def _scale(scale: float) -> mx.array:
    """``scale`` as the kernel's one-element input, made once a value (every layer of every
    step passes the same one)."""
    return mx.array([scale], mx.float32)


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
    """``mx.fast.scaled_dot_product_attention``, through the kernel where :func:`takes` and
    the kernel is :func:`sound` for the group and head size (CUDA only:
    :func:`kernel_attention` swaps this in where :func:`wanted`)."""
    if (
        kwargs
        or not takes(queries, keys, mask, sinks)
        or values.shape != keys.shape
        or not sound(queries.shape[1] // keys.shape[1], queries.shape[-1])
    ):
        return _fused(queries, keys, values, scale=scale, mask=mask, sinks=sinks, **kwargs)
    return run(queries, keys, values, scale, mask)


def reference(
    queries: mx.array, keys: mx.array, values: mx.array, scale: float, mask: mx.array
) -> mx.array:
    """The same attention in float32 plain ops (grouped heads repeated)."""
    group = queries.shape[1] // keys.shape[1]
    k = mx.repeat(keys.astype(mx.float32), group, axis=1)
    v = mx.repeat(values.astype(mx.float32), group, axis=1)
    scores = (queries.astype(mx.float32) * scale) @ k.swapaxes(-1, -2)
    scores = mx.where(mask, scores, -float("inf"))
    return mx.softmax(scores, axis=-1) @ v


def off_by(
    queries: mx.array,
    keys: mx.array,
    values: mx.array,
    scale: float,
    mask: mx.array,
    **plan: int,
) -> tuple[float, float]:
    """The kernel's (run with ``plan``) and MLX's largest difference from :func:`reference`."""
    want = reference(queries, keys, values, scale, mask)

    def worst(got: mx.array) -> float:
        return mx.abs(got.astype(mx.float32) - want).max().item()

    theirs = _fused(queries, keys, values, scale=scale, mask=mask)
    return worst(run(queries, keys, values, scale, mask, **plan)), worst(theirs)


def sample(rows: int, heads: int, kv_heads: int, size: int, num_keys: int) -> tuple[mx.array, ...]:
    """A decode step's inputs as a batch's cache holds them: keys and values a slice of a
    longer buffer (strided), each row left-padded by a different amount."""
    key = mx.random.key(7)
    parts = mx.random.split(key, 3)
    queries = mx.random.normal((rows, heads, 1, size), key=parts[0]).astype(mx.bfloat16)
    buffer = (rows, kv_heads, num_keys + 64, size)
    keys = mx.random.normal(buffer, key=parts[1]).astype(mx.bfloat16)[..., :num_keys, :]
    values = mx.random.normal(buffer, key=parts[2]).astype(mx.bfloat16)[..., :num_keys, :]
    padding = mx.array([(r * 37) % num_keys for r in range(rows)])
    mask = padding[:, None, None, None] <= mx.arange(num_keys)
    return queries, keys, values, mask


@cache
def sound(group: int = 4, size: int = 128) -> bool:
    """Whether the kernel gives MLX's answers on this GPU for ``group`` query heads a KV head
    of ``size``: 64 rows of 8 KV heads, 300 keys strided in a longer buffer, rows left-padded
    by different amounts. Checked once a process for each group and size: 4 of 128 and the
    model's own by :func:`wanted`, as the batch is built; any other the first time a model's
    attention meets it. A kernel that is off, or that this MLX cannot build or run, is not
    used there (logged): it costs speed, never a request."""
    queries, keys, values, mask = sample(64, 8 * group, 8, size, 300)
    return kernel_check.passes(
        f"the batch's decode attention kernel ({group} query heads a KV head of {size})",
        lambda: off_by(queries, keys, values, size**-0.5, mask),
    )


def wanted(device: str, *, given: bool | None = None, model: Any = None) -> bool:
    """Whether a model on ``device`` decodes its batch through the kernel: ``given`` if not
    None, else ``MLX_TRIO_DECODE_ATTENTION`` (``on``/``off``) if set, else :data:`DEFAULT_ON`
    on a CUDA GPU; and only where the GPU gives :func:`sound` answers. Where it is wanted,
    ``model``'s own group and head size (:func:`shape_of`) are checked now, as the batch is
    built (the server's warm-up), not in its first decode step."""
    setting = given if given is not None else env_switch(ENV)
    if setting is None:
        setting = DEFAULT_ON and device == "gpu"
    if not (setting and device == "gpu" and mx.cuda.is_available() and sound()):
        return False
    if model is not None and (shape := shape_of(model)) is not None:
        sound(*shape)  # cached: a failure is logged, and attention() leaves that shape to MLX
    return True


def shape_of(model: Any) -> tuple[int, int] | None:
    """``model``'s query heads a KV head and head size, from its mlx-lm arguments, where the
    kernel was written for them (None: not, or not said there)."""
    args = getattr(model, "args", None)
    heads = getattr(args, "num_attention_heads", None)
    if not isinstance(heads, int) or heads <= 0:
        return None
    kv_heads = getattr(args, "num_key_value_heads", None) or heads
    size = getattr(args, "head_dim", None) or (getattr(args, "hidden_size", None) or 0) // heads
    return (heads // kv_heads, size) if written_for(heads, kv_heads, size) else None


def kernel_attention(enabled: bool = True) -> AbstractContextManager[None]:
    """While inside, MLX's attention is :func:`attention` (``enabled``: else unchanged)."""
    return swapped(attention, enabled)
