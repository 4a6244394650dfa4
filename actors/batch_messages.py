"""The batch group's messages (what sessions and its own delivery tasks send it), its record
of a member row, and its statistics: plain data, apart from the actor (``batch_group``)."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from ..engine.params import PreparedRequest
from .arbiter import DrainCalledOff, DrainRequested, Lease
from .lanes import LaneEvent, SessionInbox


@dataclass(frozen=True, slots=True)
class RowsComing:
    """``count`` requests may soon add a row (being submitted, or started on the batch lane and
    not yet there): an empty batch waits, up to its admission window, for them. Each ends its
    announcement with an announced :class:`AddRow` or with :class:`RowsNotComing`."""

    count: int


@dataclass(frozen=True, slots=True)
class RowsNotComing:
    """``count`` announced rows will not come (placed on the serial lane, refused, ended)."""

    count: int


@dataclass(frozen=True, slots=True)
class AddRow:
    """A session's row; ``is_announced``: it ends one :class:`RowsComing` announcement."""

    request: PreparedRequest
    events: SessionInbox
    is_announced: bool = False


@dataclass(frozen=True, slots=True)
class BacklogDelivered:
    member: int


@dataclass(frozen=True, slots=True)
class ReaderGone:
    member: int


BatchMessage = (
    RowsComing
    | RowsNotComing
    | AddRow
    | Lease
    | DrainRequested
    | DrainCalledOff
    | BacklogDelivered
    | ReaderGone
)


@dataclass(slots=True)
class Member:
    """A session's row, as the group tracks it."""

    events: SessionInbox
    row: int
    parked: bool = False
    backlog: deque[LaneEvent] = field(default_factory=deque)
    prefilled: int = 0  # prompt tokens done, as its last progress event said
    decoding: bool = False  # it has had a token: its prompt is read

    @property
    def is_delivering(self) -> bool:
        return bool(self.backlog)


@dataclass(frozen=True, slots=True)
class BatchStatistics:
    active_rows: int
    parked_rows: int
    pending_rows: int
    rows_submitted: int
    steps: int
    faults: int
    stuck_steps: int
    consecutive_faults: int  # since the last step that did not fault, on the current engine
    is_stuck: bool  # a step of the current engine passed the watchdog: the engine is wedged
    parks: int
    holds_lease: bool
    draining: bool
    batch_limit: int  # rows admitted at most now: max_batch, less after running out of memory
    out_of_memory: int  # engine calls that failed to allocate memory
    rows_coming: int = 0  # rows announced (RowsComing) and neither added nor withdrawn yet
