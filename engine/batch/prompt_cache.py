"""The prompt cache: reuse the KV of a shared token prefix, within a byte budget.

Built on mlx-lm's ``LRUPromptCache`` (a token trie with LRU eviction and a byte bound), which
already finds an exact match, the longest cached prefix, or a longer entry it can trim. This
wrapper counts hits, misses, reused tokens and evictions, never hands out a cache that leaves
nothing to prefill (the model needs one token to produce logits), and only accepts entries that
fit the budget. Both lanes use one instance; it lives on the engine thread.

Entries are partitioned by a request's ``cache_salt`` (vLLM's name): a request reuses only what
requests of its salt left, so one client cannot learn from ``cached_tokens`` whether another
sent a prompt (the HTTP server salts by the API key a request came with, so several keys keep
apart, and by the request's own ``cache_salt``). Requests without one share a partition.

Under a memory budget the cache lives in the KV pool beside the live requests: the engine core
gives it the room they leave (:meth:`PromptCache.bound_by`), and the cache keeps its entries'
real bytes within the smaller of that and its own budget, trimming as it takes an entry and
whenever the core asks (:meth:`PromptCache.fit`).
"""

from __future__ import annotations

import hashlib
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .. import _blas  # noqa: F401  (loads OpenBLAS: before MLX below)

# isort: split
import mlx.core as mx
from mlx_lm.models.cache import LRUPromptCache, can_trim_prompt_cache, trim_prompt_cache

from ..outputs import PromptCacheStatistics
from .caches import tokens_held

logger = logging.getLogger(__name__)

MAX_ENTRIES = 1 << 20  # the byte budget binds first
MIN_TOKENS = 16  # shorter prefixes are not worth an entry


def default_budget_bytes() -> int:
    """An eighth of physical memory, at most 8 GiB."""
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        total = 8 << 30
    return min(total // 8, 8 << 30)


@dataclass(frozen=True, slots=True)
class CacheHit:
    """KV caches holding ``num_tokens`` leading tokens of the prompt (a private copy)."""

    cache: list[Any]
    num_tokens: int


class PromptCache:
    def __init__(self, budget_bytes: int, *, key: str = "model") -> None:
        self.budget_bytes = budget_bytes
        self._key = key
        self._lru = LRUPromptCache(max_size=MAX_ENTRIES)  # we trim to the budget, and count
        self._room: Callable[[], int] | None = None
        self._hits = 0
        self._misses = 0
        self._hit_tokens = 0
        self._evictions = 0

    def bound_by(self, room: Callable[[], int]) -> None:
        """Keep the entries within ``room()`` bytes too (what the memory budget's KV pool has
        left beside the live requests), asked each time the cache trims."""
        self._room = room

    @property
    def limit_bytes(self) -> int:
        """The most the entries may hold now: the budget, or the room, if less."""
        if self._room is None:
            return self.budget_bytes
        return max(0, min(self.budget_bytes, self._room()))

    def fit(self) -> None:
        """Evict the least recently used entries until the rest fit :attr:`limit_bytes`."""
        self._trim(self.limit_bytes)

    def _trim(self, limit: int) -> None:
        before = len(self._lru)
        self._lru.trim_to(n_bytes=limit)
        self._evictions += before - len(self._lru)

    def _partition(self, salt: str | None) -> str:
        if salt is None:
            return self._key
        return f"{self._key}#{hashlib.sha256(salt.encode()).hexdigest()[:32]}"

    def take(self, tokens: list[int], salt: str | None = None) -> CacheHit | None:
        """The KV for the longest prefix of ``tokens`` cached under ``salt``, leaving at least
        one to prefill."""
        cache, rest = self._lru.fetch_nearest_cache(self._partition(salt), tokens)
        if cache is None:
            self._misses += 1
            return None
        cached = len(tokens) - len(rest)
        if cached >= len(tokens):  # an exact match: give the last token back to prefill
            if not can_trim_prompt_cache(cache):
                self._misses += 1
                return None
            trim_prompt_cache(cache, cached - len(tokens) + 1)
            cached = len(tokens) - 1
        if cached <= 0:
            self._misses += 1
            return None
        self._hits += 1
        self._hit_tokens += cached
        return CacheHit(cache, cached)

    def put(self, tokens: list[int], cache: list[Any], salt: str | None = None) -> None:
        """Keep ``cache``, which holds the KV (or recurrent state) of exactly ``tokens``,
        under ``salt``."""
        if len(tokens) < MIN_TOKENS or not cache:
            return
        held = tokens_held(cache)
        if held is not None and held != len(tokens):
            logger.debug("not caching: %d tokens but a KV offset of %d", len(tokens), held)
            return
        size = sum(c.nbytes for c in cache)
        limit = self.limit_bytes
        if size > limit:
            return
        # A batch row's cache is a lazy slice of the whole batch's KV; left lazy it would keep
        # that whole buffer alive, many times what the budget counts (design/024). Evaluate it.
        mx.eval([c.state for c in cache])
        self._lru.insert_cache(self._partition(salt), list(tokens), cache)
        self._trim(limit)

    def statistics(self) -> PromptCacheStatistics:
        return PromptCacheStatistics(
            hits=self._hits,
            misses=self._misses,
            hit_tokens=self._hit_tokens,
            entries=len(self._lru),
            bytes=self._lru.nbytes,
            budget_bytes=self.budget_bytes,
            evictions=self._evictions,
        )
