"""Prompt lookup (n-gram) drafting: the tokens that followed the latest earlier occurrence of
the row's last n tokens, in its prompt and output so far. No second model: an edit of a given
text repeats most of it, and a match costs a dictionary lookup.

:class:`NgramIndex` keeps, for each n from 2 to ``max_n``, the latest position at which each
n-gram ended, excluding the row's last token (its own occurrence, which has no continuation
yet); adding a token indexes the one before it. Pure Python, no MLX.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

MIN_NGRAM = 2  # a single token's last occurrence predicts too little to be worth a forward


@dataclass(slots=True)
class DraftCounts:
    """Tokens a row drafted and how many of them the model accepted (kept as they grow)."""

    drafted: int = 0
    accepted: int = 0


class NgramIndex:
    """The n-grams of a growing token sequence, for :meth:`draft`."""

    def __init__(self, tokens: Iterable[int], *, max_n: int) -> None:
        assert max_n >= MIN_NGRAM
        self._max_n = max_n
        self._tokens: list[int] = []
        self._ends: dict[int, dict[tuple[int, ...], int]] = {
            n: {} for n in range(MIN_NGRAM, max_n + 1)
        }
        self.extend(tokens)

    def __len__(self) -> int:
        return len(self._tokens)

    def extend(self, tokens: Iterable[int]) -> None:
        for token in tokens:
            self._index_last()
            self._tokens.append(token)

    def _index_last(self) -> None:
        """Index the n-grams that end at the current last token (about to have a successor)."""
        end = len(self._tokens) - 1
        for n, ends in self._ends.items():
            if end + 1 >= n:
                ends[tuple(self._tokens[end + 1 - n : end + 1])] = end

    def accepted(self, kept: list[int], num_accepted: int) -> None:
        """The model kept ``kept`` (the draft's first ``num_accepted`` tokens, then its own)."""
        self.extend(kept)

    def draft(self, k: int) -> list[int]:
        """Up to ``k`` tokens that followed the latest earlier match of the longest suffix
        (``max_n`` tokens down to 2) that occurred before; none without a match."""
        tokens = self._tokens
        if k <= 0:
            return []
        for n in range(min(self._max_n, len(tokens)), MIN_NGRAM - 1, -1):
            end = self._ends[n].get(tuple(tokens[-n:]))
            if end is not None:
                return tokens[end + 1 : end + 1 + k]
        return []
