"""The admission gate: a bounded number of live sessions and a bounded queue.

An actor: the only reader of its inbox, so its counts need no lock. A request is admitted at
once while fewer than ``max_live`` sessions hold a permit, queued while fewer than
``max_queued`` wait, and refused otherwise, immediately, with a retry-after hint. A waiter that
leaves (its reply channel closed) is skipped, and stops counting against the queue bound.
"""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass
from typing import assert_never

import trio

from ..engine.errors import OverloadedError, RuntimeClosedError
from .channels import offer, receiver_left

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Permit:
    """One live-session slot; give it back with :class:`ReturnPermit`."""

    number: int


@dataclass(frozen=True, slots=True)
class Queued:
    position: int


@dataclass(frozen=True, slots=True)
class Refused:
    error: OverloadedError | RuntimeClosedError


Reply = Permit | Queued | Refused


@dataclass(frozen=True, slots=True)
class Admit:
    reply: trio.MemorySendChannel[Reply]


@dataclass(frozen=True, slots=True)
class ReturnPermit:
    permit: Permit


@dataclass(frozen=True, slots=True)
class Close:
    """Refuse everything from now on, queued waiters included."""


GateMessage = Admit | ReturnPermit | Close


@dataclass(frozen=True, slots=True)
class GateStatistics:
    live: int
    queued: int
    refused: int
    closed: bool


class AdmissionGate:
    def __init__(self, *, max_live: int, max_queued: int, retry_after_s: float = 1.0) -> None:
        assert max_live >= 1 and max_queued >= 0
        self.max_live = max_live
        self.max_queued = max_queued
        self.retry_after_s = retry_after_s
        self.inbox, self._recv = trio.open_memory_channel[GateMessage](max_live + max_queued + 64)
        self._live: set[int] = set()
        self._waiters: deque[trio.MemorySendChannel[Reply]] = deque()
        self._next_permit = 0
        self._refused = 0
        self._closed = False

    def statistics(self) -> GateStatistics:
        self._prune()
        return GateStatistics(len(self._live), len(self._waiters), self._refused, self._closed)

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        async with self._recv:
            async for message in self._recv:
                match message:
                    case Admit(reply):
                        self._admit(reply)
                    case ReturnPermit(permit):
                        self._live.discard(permit.number)
                        self._grant_waiters()
                    case Close():
                        self._closed = True
                        while self._waiters:
                            offer(self._waiters.popleft(), Refused(_closed_error()))
                    case _:
                        assert_never(message)

    def _admit(self, reply: trio.MemorySendChannel[Reply]) -> None:
        self._prune()
        if self._closed:
            offer(reply, Refused(_closed_error()))
        elif len(self._live) < self.max_live and not self._waiters:
            self._give_permit(reply)
        elif len(self._waiters) < self.max_queued:
            self._waiters.append(reply)
            offer(reply, Queued(len(self._waiters)))
        else:
            self._refused += 1
            message = (
                f"the server is at capacity ({self.max_live} live, {self.max_queued} queued); "
                f"retry after {self.retry_after_s:g} s"
            )
            error = OverloadedError(
                message,
                retry_after_s=self.retry_after_s,
                live=len(self._live),
                queued=len(self._waiters),
            )
            offer(reply, Refused(error))

    def _give_permit(self, reply: trio.MemorySendChannel[Reply]) -> bool:
        permit = Permit(self._next_permit)
        self._next_permit += 1
        if offer(reply, permit):
            self._live.add(permit.number)
            return True
        return False

    def _grant_waiters(self) -> None:
        while self._waiters and len(self._live) < self.max_live:
            self._give_permit(self._waiters.popleft())

    def _prune(self) -> None:
        """Forget waiters that left the queue."""
        if any(receiver_left(w) for w in self._waiters):
            self._waiters = deque(w for w in self._waiters if not receiver_left(w))


def _closed_error() -> RuntimeClosedError:
    return RuntimeClosedError("the server is shutting down and admits no new requests")
