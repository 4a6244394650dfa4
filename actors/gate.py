"""The admission gate: a bounded number of live sessions, a KV byte budget, a bounded queue.

An actor: the only reader of its inbox, so its counts need no lock. A request is admitted at
once while fewer than ``max_live`` sessions hold a permit and, under a memory budget, the
projected KV bytes of the permits held plus its own fit ``kv_pool_bytes``; queued while fewer
than ``max_queued`` wait, and refused otherwise, immediately, with a retry-after hint. A
permit's bytes are released with it. A waiter that leaves (its reply channel closed) is
skipped, and stops counting against the queue bound; it says so (:class:`Withdraw`), so that
the waiters behind it are looked at again.

Requesters do not write these messages themselves: :meth:`AdmissionGate.admit` returns an
:class:`Admission` (a permit, or a place in the queue that becomes one) or raises the refusal,
and :meth:`Admission.release` is the one place a permit goes back or a waiter leaves, as the
arbiter's ``acquire`` is for the engine lease.

The queue is first in, first out: while its head does not fit, nothing behind it is admitted,
even a request small enough to. That is head-of-line blocking by choice: a large request is
admitted as soon as the bytes it needs are free, instead of being starved by a stream of small
ones that keep taking them (the runtime refuses, before admission, a request that could never
fit the pool, so the head always fits once enough permits come back).
"""

from __future__ import annotations

import contextlib
import logging
from collections import deque
from dataclasses import dataclass
from typing import assert_never

import trio

from ..engine.errors import OverloadedError, RuntimeClosedError
from .channels import offer, receiver_left, take_buffered
from .config import DEFAULT_RETRY_AFTER_S

logger = logging.getLogger(__name__)

# How long giving a permit back may take when cancelled (the gate's inbox has room: at once).
RELEASE_GRACE_S = 1.0


@dataclass(frozen=True, slots=True)
class Permit:
    """One live-session slot and the KV bytes it may come to hold; given back by
    :meth:`Admission.release`."""

    number: int
    kv_bytes: int = 0


@dataclass(frozen=True, slots=True)
class Queued:
    position: int


@dataclass(frozen=True, slots=True)
class Refused:
    error: OverloadedError | RuntimeClosedError


Reply = Permit | Queued | Refused


@dataclass(frozen=True, slots=True)
class Admit:
    """Ask for a permit; ``kv_bytes``: the request's projected KV bytes (at most the pool)."""

    reply: trio.MemorySendChannel[Reply]
    kv_bytes: int = 0


@dataclass(frozen=True, slots=True)
class ReturnPermit:
    permit: Permit


@dataclass(frozen=True, slots=True)
class Withdraw:
    """A waiter left the queue (it closed its reply channel): the ones behind it may fit now."""


@dataclass(frozen=True, slots=True)
class Close:
    """Refuse everything from now on, queued waiters included."""


GateMessage = Admit | ReturnPermit | Withdraw | Close


@dataclass(frozen=True, slots=True)
class GateStatistics:
    live: int
    queued: int
    refused: int
    closed: bool
    projected_kv_bytes: int = 0  # the permits' projected KV bytes


@dataclass(frozen=True, slots=True)
class _Waiter:
    reply: trio.MemorySendChannel[Reply]
    kv_bytes: int


class AdmissionGate:
    def __init__(
        self,
        *,
        max_live: int,
        max_queued: int,
        retry_after_s: float = DEFAULT_RETRY_AFTER_S,
        kv_pool_bytes: int | None = None,
    ) -> None:
        """``kv_pool_bytes``: the KV bytes the permits' projections may add up to (None: not
        counted)."""
        assert max_live >= 1 and max_queued >= 0
        self.max_live = max_live
        self.max_queued = max_queued
        self.retry_after_s = retry_after_s
        self.kv_pool_bytes = kv_pool_bytes
        self.inbox, self._recv = trio.open_memory_channel[GateMessage](max_live + max_queued + 64)
        self._live: dict[int, int] = {}  # permit number -> its projected KV bytes
        self._projected = 0
        self._waiters: deque[_Waiter] = deque()
        self._next_permit = 0
        self._refused = 0
        self._closed = False

    async def admit(self, kv_bytes: int = 0) -> Admission:
        """Ask for a permit for a request of ``kv_bytes`` projected KV bytes (at most the pool).

        Returns an :class:`Admission` holding the permit, or a place in the queue once the
        gate is full; raises ``OverloadedError`` (the queue is full too) or
        ``RuntimeClosedError`` (the gate closed). If cancelled, nothing is left held: a place
        taken, or a permit granted in that same instant, is given back.
        """
        send, recv = trio.open_memory_channel[Reply](2)  # Queued, then Permit or Refused
        try:
            await self.inbox.send(Admit(send, kv_bytes))
            first = await recv.receive()
        except BaseException:
            await Admission(self.inbox, recv).release()
            raise
        if isinstance(first, Refused):
            recv.close()
            raise first.error
        return Admission(self.inbox, recv, first)

    async def close(self) -> None:
        """Refuse everything from now on, the queued waiters included (they get no permit)."""
        with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
            await self.inbox.send(Close())

    def statistics(self) -> GateStatistics:
        self._prune()
        return GateStatistics(
            len(self._live), len(self._waiters), self._refused, self._closed, self._projected
        )

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        async with self._recv:
            async for message in self._recv:
                match message:
                    case Admit(reply, kv_bytes):
                        self._admit(_Waiter(reply, kv_bytes))
                    case ReturnPermit(permit):
                        self._projected -= self._live.pop(permit.number, 0)
                        self._grant_waiters()
                    case Withdraw():
                        self._prune()
                        self._grant_waiters()
                    case Close():
                        self._closed = True
                        while self._waiters:
                            offer(self._waiters.popleft().reply, Refused(_closed_error()))
                    case _:
                        assert_never(message)

    def _fits(self, waiter: _Waiter) -> bool:
        """Whether ``waiter`` may have a permit now: a live slot, and room for its bytes."""
        pool = self.kv_pool_bytes
        room = pool is None or self._projected + waiter.kv_bytes <= pool
        return len(self._live) < self.max_live and room

    def _admit(self, waiter: _Waiter) -> None:
        self._prune()
        pool = self.kv_pool_bytes
        assert pool is None or waiter.kv_bytes <= pool, "the runtime admits what can fit"
        if self._closed:
            offer(waiter.reply, Refused(_closed_error()))
        elif not self._waiters and self._fits(waiter):
            self._give_permit(waiter)
        elif len(self._waiters) < self.max_queued:
            self._waiters.append(waiter)
            offer(waiter.reply, Queued(len(self._waiters)))
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
            offer(waiter.reply, Refused(error))

    def _give_permit(self, waiter: _Waiter) -> bool:
        permit = Permit(self._next_permit, waiter.kv_bytes)
        self._next_permit += 1
        if offer(waiter.reply, permit):
            self._live[permit.number] = permit.kv_bytes
            self._projected += permit.kv_bytes
            return True
        return False

    def _grant_waiters(self) -> None:
        """Grant the queue's head while it fits (first in, first out)."""
        self._prune()
        while self._waiters and self._fits(self._waiters[0]):
            self._give_permit(self._waiters.popleft())

    def _prune(self) -> None:
        """Forget waiters that left the queue."""
        if any(receiver_left(w.reply) for w in self._waiters):
            self._waiters = deque(w for w in self._waiters if not receiver_left(w.reply))


class Admission:
    """A request's place at the gate: its permit, or its place in the queue until the permit
    comes (:meth:`wait`). :meth:`release` gives back whichever it holds, once."""

    def __init__(
        self,
        gate: trio.MemorySendChannel[GateMessage],
        replies: trio.MemoryReceiveChannel[Reply],
        first: Permit | Queued | None = None,
    ) -> None:
        self._gate = gate
        self._replies = replies
        self._permit = first if isinstance(first, Permit) else None
        self._released = False

    @property
    def permit(self) -> Permit | None:
        """The permit, once granted (None while queued)."""
        return self._permit

    async def wait(self) -> Permit | None:
        """The permit, once the gate grants it; None if the gate closed meanwhile (it refuses
        its queue) or the admission was released. If cancelled, the place in the queue is kept
        until :meth:`release`."""
        if self._permit is not None or self._released:
            return self._permit
        async for reply in self._replies:
            match reply:
                case Permit():
                    self._permit = reply
                    return reply
                case Queued():
                    continue
                case Refused():
                    return None
                case _:
                    assert_never(reply)
        return None

    async def release(self) -> None:
        """Give the permit back (one granted, or one granted in the instant its holder left),
        or leave the queue, so that the waiters behind may fit; later calls do nothing.

        Runs shielded, for at most ``RELEASE_GRACE_S``: a cancelled holder still gives back. The
        reply channel closes without a checkpoint, so that no permit can arrive unseen after
        it was looked for; a gate that is gone (its runtime torn down) has nothing to take back.
        """
        if self._released:
            return
        self._released = True
        permit = self._permit or take_buffered(self._replies, Permit)
        self._replies.close()
        message = Withdraw() if permit is None else ReturnPermit(permit)
        with (
            trio.move_on_after(RELEASE_GRACE_S, shield=True),
            contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError),
        ):
            await self._gate.send(message)


def _closed_error() -> RuntimeClosedError:
    return RuntimeClosedError("the server is shutting down and admits no new requests")
