"""What a lane (serial executor or batch group) sends to a session, besides engine row events."""

from __future__ import annotations

from dataclasses import dataclass

from mlx_trio.engine.outputs import RowEvent, RowFailed, RowOutput


@dataclass(frozen=True, slots=True)
class Abandoned:
    """The lane gave up on the row without an engine error: a step passed the watchdog.

    The session ends cancelled with reason ``engine_fault``.
    """

    message: str


@dataclass(frozen=True, slots=True)
class LaneFailed:
    """The lane could not run the row (the engine refused to add it). Ends ``failed``."""

    message: str


LaneEvent = RowEvent | Abandoned | LaneFailed


def is_final(event: LaneEvent) -> bool:
    """Whether this is a row's last event (the row has left the engine)."""
    if isinstance(event, RowOutput):
        return event.stats is not None
    return isinstance(event, RowFailed | Abandoned | LaneFailed)
