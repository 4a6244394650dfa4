"""The runtime's tally of how its sessions ended, and the one log line each ends with."""

from __future__ import annotations

import logging
from collections import Counter

from .messages import (
    CANCEL_REASONS,
    Cancelled,
    CancelReason,
    Completed,
    Failed,
    FailureCode,
    Outcome,
    describe,
)

logger = logging.getLogger("mlx_trio.actors.runtime")


class OutcomeTally:
    def __init__(self) -> None:
        self.completed = 0
        self._cancelled: Counter[CancelReason] = Counter()
        self._failed: Counter[FailureCode] = Counter()

    @property
    def cancelled(self) -> dict[CancelReason, int]:
        return {r: self._cancelled[r] for r in CANCEL_REASONS}

    @property
    def failed(self) -> dict[FailureCode, int]:
        return dict(self._failed)

    def record(self, session_id: str, lane: str, outcome: Outcome) -> None:
        """Count ``outcome`` and log the session's line: its outcome, tokens and timings."""
        match outcome:
            case Completed():
                self.completed += 1
            case Cancelled(reason=reason):
                self._cancelled[reason] += 1
            case Failed(code=code):
                self._failed[code] += 1
        usage = outcome.usage if isinstance(outcome, Completed | Cancelled) else None
        timings = ""
        if isinstance(outcome, Completed):
            t = outcome.timings
            timings = f" queued={t.queued_s:.3f}s prefill={seconds(t.prefill_s)}"
            timings += f" decode={t.decode_s:.3f}s"
        # DEBUG: the HTTP server logs each request once, its choices' outcomes included.
        logger.debug(
            "session %s lane=%s %s completion_tokens=%s%s",
            session_id,
            lane,
            describe(outcome),
            usage.completion_tokens if usage else "-",
            timings,
        )


def seconds(value: float | None) -> str:
    """A duration for a log line: ``0.123s``, or ``-`` if there is none."""
    return "-" if value is None else f"{value:.3f}s"
