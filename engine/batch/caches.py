"""What a model's caches can do, and so what the engine may do with its rows.

mlx-lm gives each model the caches its layers need (``make_prompt_cache``): keys and values per
token (``KVCache``, ``RotatingKVCache`` for a sliding window, ``QuantizedKVCache``,
``ChunkedKVCache``), a recurrent state of fixed size (``ArraysCache``, which ``MambaCache`` is:
Qwen3.5's and Qwen3-Next's linear attention, Mamba), or a ``CacheList`` of several. The engine
needs two things of them, and asks the model's own caches rather than its name:

- **batch**: every cache merges into mlx-lm's batch (it has ``merge``, as ``mlx_lm.server``
  checks). A model whose caches do not runs on the serial lane alone.
- **rewind**: every cache can be trimmed back a token (``is_trimmable``). A recurrent state
  cannot: the token it read is folded into it. Parking a row and handing a lone row to
  ``generate_step`` take the row's last token back out of its cache (both lanes compute one
  token ahead), so a model that cannot rewind keeps every row in mlx-lm's batch; and its
  prompt-cache entries are reused only from their exact end (a longer entry cannot be cut back),
  so the engine stores one where a repeat of the request will start from: its prompt but the
  last token (a checkpoint, the seed's ``snapshotAt``), beside the one at the row's end. A
  sliding window's cache rewinds only until its window is full: its model gets checkpoints too
  (:attr:`CacheAbilities.checkpoints`).

design/022-caches.md has the table of cache types and what each supports.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from .. import _blas  # noqa: F401  (loads OpenBLAS: before MLX below)

# isort: split
from mlx_lm.models.cache import (
    CacheList,
    RotatingKVCache,
    can_trim_prompt_cache,
    make_prompt_cache,
)

BatchMode = Literal["batch", "serial"]


@dataclass(frozen=True, slots=True)
class CacheAbilities:
    """What every cache of a model can do (see the module docstring)."""

    kinds: tuple[str, ...]  # the cache classes, in layer order, each once
    batch: bool
    rewind: bool
    # An entry may be reusable from its exact end only: a cache cannot rewind, or stops
    # rewinding once its window is full (RotatingKVCache).
    checkpoints: bool

    @classmethod
    def of(cls, model: Any, make: Callable[[Any], list[Any]] = make_prompt_cache) -> CacheAbilities:
        """Ask a fresh set of ``model``'s caches, as ``make`` makes them (empty: nothing is
        computed)."""
        caches = make(model)
        kinds = tuple(dict.fromkeys(_kind(c) for c in caches))
        return cls(
            kinds=kinds,
            batch=bool(caches) and all(hasattr(c, "merge") for c in caches),
            rewind=bool(caches) and can_trim_prompt_cache(caches),
            checkpoints=not can_trim_prompt_cache(caches) or _has_window(caches),
        )

    @property
    def batch_mode(self) -> BatchMode:
        return "batch" if self.batch else "serial"

    @property
    def unbatchable_reason(self) -> str | None:
        """Why this model's requests cannot batch (None: they can)."""
        if self.batch:
            return None
        return f"the model's caches ({', '.join(self.kinds)}) cannot be merged into a batch"

    def describe(self) -> str:
        """One phrase for the startup line."""
        rewind = "rewindable" if self.rewind else "not rewindable: no parking, no solo row"
        return f"caches {'/'.join(self.kinds)} ({rewind}); batch mode {self.batch_mode}"


def _kind(cache: Any) -> str:
    if isinstance(cache, CacheList):
        return f"CacheList[{'/'.join(dict.fromkeys(_kind(c) for c in cache.caches))}]"
    return type(cache).__name__


def _has_window(caches: Sequence[Any]) -> bool:
    return any(
        _has_window(c.caches) if isinstance(c, CacheList) else isinstance(c, RotatingKVCache)
        for c in caches
    )


def tokens_held(caches: Sequence[Any]) -> int | None:
    """How many tokens ``caches`` have read, where a cache counts them (a KV cache's
    ``offset``); None where none does (every layer a recurrent state)."""
    for cache in caches:
        if isinstance(cache, CacheList):
            if (held := tokens_held(cache.caches)) is not None:
                return held
            continue
        offset = getattr(cache, "offset", None)
        if isinstance(offset, int):
            return offset
    return None
