"""Streaming text: incremental detokenization and stop strings across token boundaries.

mlx-lm's streaming detokenizers already hold back an incomplete UTF-8 sequence until the
token that completes it arrives. On top of that, :class:`StopStringMatcher` holds back any
tail of the text that could be the start of a stop string, and cuts the text at the first
complete match, however the match is split across tokens.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from mlx_lm.tokenizer_utils import TokenizerWrapper


class StopStringMatcher:
    """Finds the first stop string in a stream of text pieces."""

    def __init__(self, stops: tuple[str, ...]) -> None:
        assert all(stops), "stop strings must be non-empty"
        self._stops = stops
        self._held = ""

    def push(self, piece: str) -> tuple[str, bool]:
        """Feed text; return (text safe to emit, whether a stop string matched).

        After a match the returned text ends right before it and the matcher must not be fed
        again.
        """
        if not self._stops:
            return piece, False
        text = self._held + piece
        found = [i for i in (text.find(s) for s in self._stops) if i >= 0]
        if found:
            self._held = ""
            return text[: min(found)], True
        keep = max((_overlap(text, s) for s in self._stops), default=0)
        self._held = text[len(text) - keep :]
        return text[: len(text) - keep], False

    def flush(self) -> str:
        """The text held back as a possible stop-string start (at the end of a generation)."""
        held, self._held = self._held, ""
        return held


def _overlap(text: str, stop: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``stop``."""
    for k in range(min(len(stop) - 1, len(text)), 0, -1):
        if text.endswith(stop[:k]):
            return k
    return 0


class TextStream:
    """Token ids in, emit-ready text out, for one generation."""

    def __init__(self, tokenizer: TokenizerWrapper, stop: tuple[str, ...] = ()) -> None:
        self._detokenizer = tokenizer.detokenizer
        self._matcher = StopStringMatcher(stop)

    def push(self, token: int) -> tuple[str, bool]:
        """Add a token; return (new text to emit, whether a stop string matched)."""
        self._detokenizer.add_token(token)
        return self._matcher.push(self._detokenizer.last_segment)

    def finish(self) -> tuple[str, bool]:
        """Flush what the detokenizer and the matcher hold; call once, at the end."""
        self._detokenizer.finalize()
        text, matched = self._matcher.push(self._detokenizer.last_segment)
        if matched:
            return text, True
        return text + self._matcher.flush(), False
