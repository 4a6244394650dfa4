"""Stop strings across token boundaries, in plain Python (no MLX): the engine's text stream and
the scripted engine share it."""

from __future__ import annotations


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
