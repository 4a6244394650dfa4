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

import copy
import hashlib
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .. import _blas  # noqa: F401  (loads OpenBLAS: before MLX below)

# isort: split
import mlx.core as mx
from mlx_lm.models.cache import KVCache, LRUPromptCache, can_trim_prompt_cache, trim_prompt_cache

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
        cache, rest = self._fetch(self._partition(salt), tokens)
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

    def _fetch(self, partition: str, tokens: list[int]) -> tuple[list[Any] | None, list[int]]:
        """What ``LRUPromptCache.fetch_nearest_cache`` finds, found in time linear in the
        prompt, and copied only as far as it is reused where every cache is a plain
        ``KVCache``.

        mlx-lm's search for a longer entry builds each path's list token by token (quadratic in
        its length) over every entry past the common prefix, and then deep-copies the whole
        entry it picked: a burst of unique 2,000-token prompts that shared only their chat
        template's first tokens took 190 ms a request in ``take`` (64 entries; design/027).
        Here any longer entry will do (the copy is a slice, whatever its length): a slice
        shares the entry's memory, and MLX arrays are values (a write into a shared buffer
        copies it), so the entry never changes. Other caches are deep-copied and trimmed, as
        mlx-lm does; one that cannot be trimmed is reused only from an entry it ends with.
        Reads mlx-lm 0.32's trie (a dict per token, the entry under ``"__value__"``), as its
        own cache does."""
        node = self._lru._trie._trie.get(partition)
        if node is None:
            return None, tokens
        walked, shorter = 0, 0
        for token in tokens:
            if token not in node:
                break
            node = node[token]
            walked += 1
            if "__value__" in node:
                shorter = walked
        if shorter == len(tokens):
            return self._copy(partition, tokens, len(tokens)), []
        if walked > shorter:  # a longer entry shares more: reach any entry below
            path = list(tokens[:walked])
            while "__value__" not in node:
                token = next(iter(node))
                path.append(token)
                node = node[token]
            reused = min(len(tokens) - 1, walked)
            if (cache := self._copy(partition, path, reused)) is not None:
                return cache, tokens[reused:]
        if shorter:
            return self._copy(partition, tokens[:shorter], shorter), tokens[shorter:]
        return None, tokens

    def _copy(self, partition: str, held: list[int], reused: int) -> list[Any] | None:
        """The entry holding ``held``, cut to its first ``reused`` tokens (None: it cannot
        be cut)."""
        entry = self._lru._trie.get(partition, held).prompt_cache
        if all(type(c) is KVCache for c in entry):
            return [_kv_prefix(c, reused) for c in entry]
        if reused < len(held) and not can_trim_prompt_cache(entry):
            return None
        cache = copy.deepcopy(entry)
        trim_prompt_cache(cache, len(held) - reused)
        return cache

    def put(self, tokens: list[int], cache: list[Any], salt: str | None = None) -> None:
        """Keep ``cache``, which holds the KV (or recurrent state) of exactly ``tokens``,
        under ``salt``."""
        self.put_many([(tokens, cache, salt)])

    def put_many(self, entries: list[tuple[list[int], list[Any], str | None]]) -> None:
        """:meth:`put` for several ``(tokens, cache, salt)``, evaluated together."""
        limit = self.limit_bytes
        kept = [entry for entry in entries if self._fits(*entry[:2], limit)]
        if not kept:
            return
        # A batch row's cache is a lazy slice of the whole batch's KV; left lazy it would keep
        # that whole buffer alive, many times what the budget counts (design/024). Evaluate it.
        mx.eval([c.state for _, cache, _ in kept for c in cache])
        for tokens, cache, salt in kept:
            self._lru.insert_cache(self._partition(salt), list(tokens), cache)
        self._trim(limit)

    @staticmethod
    def _fits(tokens: list[int], cache: list[Any], limit: int) -> bool:
        """Whether ``cache`` is worth an entry for ``tokens`` and within ``limit`` bytes."""
        if len(tokens) < MIN_TOKENS or not cache:
            return False
        held = tokens_held(cache)
        if held is not None and held != len(tokens):
            logger.debug("not caching: %d tokens but a KV offset of %d", len(tokens), held)
            return False
        return sum(c.nbytes for c in cache) <= limit

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


def _kv_prefix(cache: KVCache, tokens: int) -> KVCache:
    """A ``KVCache`` holding the first ``tokens`` of ``cache``, sharing its arrays until
    written."""
    prefix = KVCache()
    prefix.keys = cache.keys[..., :tokens, :]
    prefix.values = cache.values[..., :tokens, :]
    prefix.offset = tokens
    return prefix
