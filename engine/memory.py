"""The memory budget on MLX: the device's memory, the model's bytes, MLX's limits.

:func:`measure_model` reads what a loaded model costs: its weights, and the KV bytes a token
adds to a row (from a cache the model itself makes, so a model whose layers cache differently
is measured as it is). :func:`plan_budget` spends a :class:`MemoryLimit` on the weights, a
headroom for the activations of the largest step the engine runs (:func:`headroom_bytes`) and
the KV pool; :func:`apply_budget` sets MLX's memory limit to it and bounds MLX's buffer cache,
which otherwise keeps every freed buffer up to 95% of a GPU's memory (what held 46.8 GB on an
H200 after a benchmark). design/015-memory-budget.md has the accounting and its measurements.
"""

from __future__ import annotations

import ctypes
import logging
import math
import os
import sys
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from . import _blas  # noqa: F401  (loads OpenBLAS: before MLX below)

# isort: split
import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten
from mlx_lm.models.cache import make_prompt_cache

from .budget import MemoryBudget, MemoryLimit, MemoryUsage, format_bytes
from .errors import InvalidRequestError

logger = logging.getLogger(__name__)

KV_STEP = 256  # mlx-lm's KV caches grow by this many tokens at a time
# Attention over a prefill chunk is counted over this many chunks of context: a prefill over a
# longer context allocates more where MLX has no fused attention kernel (the CPU).
CONTEXT_CHUNKS = 2
_FALLBACK_DEVICE_BYTES = 8 << 30


@dataclass(frozen=True, slots=True)
class ModelMemory:
    """What a loaded model costs: ``weights``; the KV a token adds to a row
    (``kv_bytes_per_token``) and what a row's caches hold whatever its length
    (``kv_bytes_per_row``); the KV caches' allocation step (``kv_step`` tokens); and the sizes
    its activations scale with (None where the model's arguments do not say)."""

    weights: int
    kv_bytes_per_token: int
    kv_bytes_per_row: int
    kv_step: int
    activation_bytes: int  # bytes of one activation element: 4 for float32, else 2
    hidden: int | None
    intermediate: int | None
    heads: int | None
    vocab: int | None


def measure_model(
    model: nn.Module,
    *,
    vocab_size: int | None = None,
    make: Callable[[nn.Module], list[Any]] = make_prompt_cache,
) -> ModelMemory:
    """Measure ``model``: its parameters' bytes, and its KV from a cache it makes, fed one
    token (lazily: only shapes are read, nothing is computed). A layer that caches keys and
    values per token (a window too) counts its buffer's bytes over its slots; any other (a
    recurrent state) counts toward every row whatever its length. ``make``: the caches of the
    engine's KV scheme (``quantized_kv.KVScheme``)."""
    weights = sum(v.nbytes for _, v in tree_flatten(model.parameters()))
    caches = make(model)
    model(mx.array([[0]]), cache=caches)
    per_token = 0.0
    per_row = 0
    for cache in caches:
        slots = _slots(getattr(cache, "keys", None))
        size = _cache_bytes(cache)
        if slots:
            per_token += size / slots
        else:
            per_row += size
    step = max((getattr(c, "step", 1) for c in caches), default=1)
    del caches
    args = getattr(model, "args", None)
    sizes: Counter[mx.Dtype] = Counter()
    for _, v in tree_flatten(model.parameters()):
        if mx.issubdtype(v.dtype, mx.floating):
            sizes[v.dtype] += v.size
    main = sizes.most_common(1)[0][0] if sizes else mx.float32
    return ModelMemory(
        weights=weights,
        kv_bytes_per_token=math.ceil(per_token),
        kv_bytes_per_row=per_row,
        kv_step=max(1, int(step)),
        activation_bytes=4 if main == mx.float32 else 2,
        hidden=_int_arg(args, "hidden_size"),
        intermediate=_int_arg(args, "intermediate_size"),
        heads=_int_arg(args, "num_attention_heads"),
        vocab=_int_arg(args, "vocab_size") or vocab_size,
    )


def headroom_bytes(
    model: ModelMemory,
    *,
    max_batch: int,
    prefill_batch: int,
    prefill_chunk: int,
    serial_prefill_chunk: int,
) -> int:
    """The activations of the largest step the engine runs, estimated from the model's sizes:
    a batch's prefill group (``prefill_batch`` rows of ``prefill_chunk`` tokens) or the serial
    lane's (one row of ``serial_prefill_chunk``): each token's hidden states, attention
    projections and MLP, about ``6 x hidden + 3 x intermediate`` elements a layer, and the
    attention scores and their softmax in float32 over ``CONTEXT_CHUNKS`` chunks of context;
    or a decode step of ``max_batch`` rows: the same per token, plus the logits,
    log-probabilities and the sampler's copies, four float32 vectors of the vocabulary each.
    A model whose arguments do not give these sizes gets a quarter of its weights, at least
    256 MiB. The estimates were checked against the default model on CPU (design/015, 024)."""
    if model.hidden is None or model.intermediate is None or model.vocab is None:
        return max(256 << 20, model.weights // 4)
    per_token = (6 * model.hidden + 3 * model.intermediate) * model.activation_bytes
    heads = model.heads or 1

    def prefill(rows: int, chunk: int) -> int:
        scores = 2 * rows * heads * chunk * (CONTEXT_CHUNKS * chunk) * 4
        return rows * chunk * per_token + scores

    decode = max_batch * (per_token + 4 * model.vocab * 4)
    return max(prefill(prefill_batch, prefill_chunk), prefill(1, serial_prefill_chunk), decode)


def plan_budget(
    model: ModelMemory,
    limit: MemoryLimit,
    *,
    on_gpu: bool,
    max_batch: int,
    prefill_batch: int,
    prefill_chunk: int,
    serial_prefill_chunk: int,
) -> MemoryBudget:
    """Spend ``limit`` on the weights, the headroom (:func:`headroom_bytes`) and the KV pool;
    raises :class:`InvalidRequestError` (``memory_limit``) if nothing is left for the pool."""
    device = device_memory_bytes(on_gpu)
    total = limit.resolve(device)
    headroom = headroom_bytes(
        model,
        max_batch=max_batch,
        prefill_batch=prefill_batch,
        prefill_chunk=prefill_chunk,
        serial_prefill_chunk=serial_prefill_chunk,
    )
    pool = total - model.weights - headroom
    # At least a request of a KV step must fit, or nothing could ever be admitted.
    least = model.kv_bytes_per_row + 2 * model.kv_step * model.kv_bytes_per_token
    if pool < least:
        given = (
            format_bytes(total) if limit.bytes is not None else f"{limit}: {format_bytes(total)}"
        )
        raise InvalidRequestError(
            f"the memory limit ({given}) leaves no room for the KV cache "
            f"after the weights ({format_bytes(model.weights)}) and the activations' headroom "
            f"({format_bytes(headroom)}); it needs at least "
            f"{format_bytes(model.weights + headroom + least)}",
            param="memory_limit",
        )
    return MemoryBudget(
        limit=total,
        device=device,
        weights=model.weights,
        headroom=headroom,
        kv_pool=pool,
        kv_bytes_per_token=model.kv_bytes_per_token,
        kv_bytes_per_row=model.kv_bytes_per_row,
        kv_step=model.kv_step,
        cache_limit=headroom,
    )


def apply_budget(budget: MemoryBudget) -> None:
    """Set MLX's memory limit to the budget (past it, MLX frees its buffer cache before it
    allocates) and its buffer cache's limit to the headroom: enough to reuse a step's
    activations from one step to the next, not the freed KV of every request since start."""
    mx.set_memory_limit(budget.limit)
    mx.set_cache_limit(budget.cache_limit)
    logger.info(
        "memory budget %s: weights %s, activations' headroom %s, KV pool %s (%s a token); "
        "MLX's buffer cache at most %s",
        format_bytes(budget.limit),
        format_bytes(budget.weights),
        format_bytes(budget.headroom),
        format_bytes(budget.kv_pool),
        format_bytes(budget.kv_bytes_per_token),
        format_bytes(budget.cache_limit),
    )


def memory_usage() -> MemoryUsage:
    """MLX's counts now (process-wide)."""
    return MemoryUsage(mx.get_active_memory(), mx.get_cache_memory(), mx.get_peak_memory())


def device_memory_bytes(on_gpu: bool) -> int:
    """The memory a fractional limit is a share of: a GPU's total memory (CUDA), or the working
    set Metal recommends; on CPU the physical memory, or the cgroup's limit if lower."""
    if on_gpu:
        info = mx.device_info(mx.gpu)
        for key in ("total_memory", "max_recommended_working_set_size", "memory_size"):
            value = info.get(key)
            if isinstance(value, int) and value > 0:
                return value
        logger.warning("MLX does not say how much memory the GPU has; assuming 8 GiB")
        return _FALLBACK_DEVICE_BYTES
    try:
        physical = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        physical = _FALLBACK_DEVICE_BYTES
    limits = [v for v in map(_read_int, _CGROUP_LIMITS) if v is not None and 0 < v < physical]
    return min([physical, *limits])


def trim_allocator() -> None:
    """Give the C allocator's free pages back to the system (glibc's ``malloc_trim``; nothing
    elsewhere). MLX's CPU arrays come from ``malloc``: as KV buffers and activations of many
    sizes come and go, glibc's heap keeps the freed pages between live blocks: a trim gave back
    over a third of resident memory on the default model on CPU (design/015, 024)."""
    if _libc is not None:
        _libc.malloc_trim(0)


_CGROUP_LIMITS = (
    Path("/sys/fs/cgroup/memory.max"),  # v2
    Path("/sys/fs/cgroup/memory/memory.limit_in_bytes"),  # v1
)


def _read_int(path: Path) -> int | None:
    try:
        return int(path.read_text().strip())
    except (OSError, ValueError):
        return None  # absent, or "max"


def _load_libc() -> ctypes.CDLL | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.malloc_trim  # noqa: B018  (glibc has it; musl does not)
    except (OSError, AttributeError):
        return None
    return libc


_libc = _load_libc()


def _slots(keys: object) -> int:
    """Token slots of a layer's key buffer ``(rows, heads, slots, dim)``, plain or quantized
    (a tuple of arrays); 0 for anything else."""
    if isinstance(keys, list | tuple) and keys:
        keys = keys[0]
    if isinstance(keys, mx.array) and keys.ndim == 4:
        return keys.shape[2]
    return 0


def _cache_bytes(cache: object) -> int:
    try:
        return int(cache.nbytes)  # type: ignore[attr-defined]
    except (AttributeError, NotImplementedError):
        state = getattr(cache, "state", ())
        return sum(v.nbytes for _, v in tree_flatten(state) if isinstance(v, mx.array))


def _int_arg(args: object, name: str) -> int | None:
    value = getattr(args, name, None)
    return value if isinstance(value, int) and value > 0 else None
