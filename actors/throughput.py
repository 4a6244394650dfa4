"""Tokens prefilled and decoded, in total and per second over the last few seconds.

Both lanes record what each engine call gave (prompt tokens prefilled, tokens decoded); the
runtime reports the totals and the recent rates (``/v1/stats``, ``/metrics``). A rate is taken
over the last ``WINDOW_S`` seconds of wall time, so it falls to zero when the engine idles.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import trio

WINDOW_S = 10.0


@dataclass(frozen=True, slots=True)
class Throughput:
    prefilled_tokens: int
    decoded_tokens: int
    prefill_tokens_per_s: float
    decode_tokens_per_s: float


class ThroughputMeter:
    def __init__(self, window_s: float = WINDOW_S) -> None:
        self.window_s = window_s
        self.prefilled = 0
        self.decoded = 0
        # (time, prefilled, decoded) after each call, the oldest kept one older than the window
        self._samples: deque[tuple[float, int, int]] = deque()
        self._started = trio.current_time()

    def record(self, prefilled: int, decoded: int) -> None:
        if not prefilled and not decoded:
            return
        self.prefilled += prefilled
        self.decoded += decoded
        now = trio.current_time()
        self._samples.append((now, self.prefilled, self.decoded))
        while len(self._samples) > 1 and self._samples[1][0] <= now - self.window_s:
            self._samples.popleft()

    def snapshot(self) -> Throughput:
        now = trio.current_time()
        since = now - self.window_s
        prefilled, decoded = self._totals_at(since)
        span = max(1e-9, now - max(since, self._started))
        return Throughput(
            self.prefilled,
            self.decoded,
            (self.prefilled - prefilled) / span,
            (self.decoded - decoded) / span,
        )

    def _totals_at(self, when: float) -> tuple[int, int]:
        """The totals as they were at ``when`` (the last sample at or before it)."""
        totals = (0, 0)
        for at, prefilled, decoded in self._samples:
            if at > when:
                break
            totals = (prefilled, decoded)
        return totals
