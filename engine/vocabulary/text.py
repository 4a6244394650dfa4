"""Streaming text: incremental detokenization and stop strings across token boundaries.

mlx-lm's streaming detokenizers already hold back an incomplete UTF-8 sequence until the
token that completes it arrives. On top of that, a :class:`StopStringMatcher` (``stops.py``)
holds back any tail of the text that could be the start of a stop string, and cuts the text at
the first complete match, however the match is split across tokens.

Byte-level BPE tokenizers (GPT-2's scheme: SmolLM2's, Llama 3's) get :class:`ByteLevelText`
instead of mlx-lm's ``BPEStreamingDetokenizer``: each token's bytes come from a table built
once per tokenizer and an incremental UTF-8 decoder holds back partial code points, which
costs a lookup a token instead of decoding the pending text character by character. The text
is the same (mlx-lm's also drops one leading space); on a batch of 256 rows this is most of
the engine thread's own work per token.
"""

from __future__ import annotations

import codecs
import functools
from collections.abc import Sequence
from typing import TYPE_CHECKING

from .. import _blas  # noqa: F401  (loads OpenBLAS: before MLX below)

# isort: split
from mlx_lm.tokenizer_utils import BPEStreamingDetokenizer

from .stops import StopStringMatcher

if TYPE_CHECKING:
    from mlx_lm.tokenizer_utils import TokenizerWrapper


@functools.cache
def _unicode_to_byte() -> dict[str, int]:
    """GPT-2's byte-level alphabet: the character that stands for each byte in a token."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1)]
    printable += range(ord("®"), ord("ÿ") + 1)
    others = [b for b in range(256) if b not in printable]
    chars = {chr(b): b for b in printable}
    chars.update({chr(256 + n): b for n, b in enumerate(others)})
    return chars


@functools.lru_cache(maxsize=8)
def byte_level_table(tokenizer: TokenizerWrapper) -> tuple[bytes, ...] | None:
    """Each token id's bytes, if mlx-lm detokenizes this tokenizer as byte-level BPE."""
    detokenizer = tokenizer.detokenizer
    if not isinstance(detokenizer, BPEStreamingDetokenizer):
        return None
    alphabet = _unicode_to_byte()

    def token_bytes(token: str) -> bytes:
        # As in mlx-lm, a character outside the alphabet (an added token's) stands for
        # itself, and so does the one for byte 0 (mlx-lm tests the byte's truth).
        return b"".join(bytes((alphabet[c],)) if alphabet.get(c) else c.encode() for c in token)

    return tuple(token_bytes(t or "") for t in detokenizer.tokenmap)


class ByteLevelText:
    """Incremental detokenization by table (see the module docstring)."""

    def __init__(self, table: tuple[bytes, ...]) -> None:
        self._table = table
        self._utf8 = codecs.getincrementaldecoder("utf-8")("replace")
        self._started = False

    def extend(self, tokens: Sequence[int]) -> str:
        table, size = self._table, len(self._table)
        # Ids past the tokenizer's vocabulary (a padded embedding) read "!", as in mlx-lm.
        data = b"".join([table[t] if t < size else b"!" for t in tokens])
        return self._trimmed(self._utf8.decode(data))

    def finish(self) -> str:
        return self._trimmed(self._utf8.decode(b"", final=True))

    def _trimmed(self, text: str) -> str:
        if self._started or not text:
            return text
        self._started = True
        return text[1:] if text[0] == " " else text


class _MlxText:
    """mlx-lm's streaming detokenizer for the tokenizer, for any other kind of tokenizer."""

    def __init__(self, tokenizer: TokenizerWrapper) -> None:
        self._detokenizer = tokenizer.detokenizer

    def extend(self, tokens: Sequence[int]) -> str:
        for token in tokens:
            self._detokenizer.add_token(token)
        return self._detokenizer.last_segment

    def finish(self) -> str:
        self._detokenizer.finalize()
        return self._detokenizer.last_segment


class TextStream:
    """Token ids in, emit-ready text out, for one generation."""

    def __init__(self, tokenizer: TokenizerWrapper, stop: tuple[str, ...] = ()) -> None:
        table = byte_level_table(tokenizer)
        self._decoder = ByteLevelText(table) if table is not None else _MlxText(tokenizer)
        self._matcher = StopStringMatcher(stop)
        self.has_stops = bool(stop)

    def push(self, token: int) -> tuple[str, bool]:
        """Add a token; return (new text to emit, whether a stop string matched)."""
        return self._matcher.push(self._decoder.extend((token,)))

    def extend(self, tokens: Sequence[int]) -> str:
        """Add several tokens of a generation without stop strings; return the new text."""
        assert not self.has_stops, "a stop string needs push, token by token"
        return self._decoder.extend(tokens)

    def finish(self) -> tuple[str, bool]:
        """Flush what the detokenizer and the matcher hold; call once, at the end."""
        text, matched = self._matcher.push(self._decoder.finish())
        if matched:
            return text, True
        return text + self._matcher.flush(), False
