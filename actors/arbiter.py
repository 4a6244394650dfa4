"""Who owns the engine: one lease, passed by message between the two lanes.

The serial lane and the batch group never use the engine at the same time: each asks the
arbiter for the lease and gives it back. The drain rule keeps continuous traffic from starving
the serial lane: while a serial (or exclusive) waiter is queued and the batch holds the lease,
the arbiter tells the batch group to drain (admit no new rows, finish running ones, hand the
lease back). If every serial waiter leaves, the drain is called off at once. ``idle`` waiters
get the lease only when nobody holds or wants it, and never cause a drain.
"""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass
from typing import Literal, assert_never

import trio

from .channels import offer, receiver_left, take_buffered

logger = logging.getLogger(__name__)

LeaseKind = Literal["batch", "serial", "exclusive", "idle"]


@dataclass(frozen=True, slots=True)
class Lease:
    number: int
    kind: LeaseKind


@dataclass(frozen=True, slots=True)
class Acquire:
    """Ask for the lease; it arrives on ``grant``. The batch group passes its inbox, a
    ``Grant`` channel, which also gets drain notices while it holds the lease; everyone else a
    channel of leases."""

    kind: LeaseKind
    grant: trio.MemorySendChannel[Lease] | trio.MemorySendChannel[Grant]


@dataclass(frozen=True, slots=True)
class ReleaseLease:
    lease: Lease


@dataclass(frozen=True, slots=True)
class Withdrawn:
    """A waiter left; re-check the queue (it may end a drain)."""


@dataclass(frozen=True, slots=True)
class DrainRequested:
    """Sent to the batch group: stop admitting, finish running rows, release the lease."""


@dataclass(frozen=True, slots=True)
class DrainCalledOff:
    """Sent to the batch group: the serial waiters left; admit again."""


ArbiterMessage = Acquire | ReleaseLease | Withdrawn
# What the arbiter sends on a grant channel.
Grant = Lease | DrainRequested | DrainCalledOff


@dataclass(frozen=True, slots=True)
class ArbiterStatistics:
    holder: LeaseKind | None
    serial_waiting: int
    batch_waiting: bool
    idle_waiting: int
    draining: bool
    drains: int


class EngineArbiter:
    def __init__(self, *, inbox_size: int = 256) -> None:
        self.inbox, self._recv = trio.open_memory_channel[ArbiterMessage](inbox_size)
        self._holder: Lease | None = None
        self._holder_channel: (
            trio.MemorySendChannel[Lease] | trio.MemorySendChannel[Grant] | None
        ) = None
        self._serial: deque[Acquire] = deque()  # serial and exclusive, FIFO
        self._batch: Acquire | None = None
        self._idle: deque[Acquire] = deque()
        self._next = 0
        self._draining = False
        self._drains = 0

    def statistics(self) -> ArbiterStatistics:
        return ArbiterStatistics(
            holder=self._holder.kind if self._holder else None,
            serial_waiting=sum(1 for w in self._serial if not _gone(w)),
            batch_waiting=self._batch is not None,
            idle_waiting=len(self._idle),
            draining=self._draining,
            drains=self._drains,
        )

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        async with self._recv:
            async for message in self._recv:
                match message:
                    case Acquire(kind="batch"):
                        self._batch = message
                    case Acquire(kind="serial" | "exclusive"):
                        self._serial.append(message)
                    case Acquire(kind="idle"):
                        self._idle.append(message)
                    case Acquire():
                        raise AssertionError(f"unknown lease kind {message.kind}")
                    case ReleaseLease(lease):
                        assert self._holder == lease, f"released {lease}, held {self._holder}"
                        self._holder = None
                        self._holder_channel = None
                    case Withdrawn():
                        pass
                    case _:
                        assert_never(message)
                self._dispatch()

    def _dispatch(self) -> None:
        self._serial = deque(w for w in self._serial if not _gone(w))
        self._idle = deque(w for w in self._idle if not _gone(w))
        while self._holder is None:
            if self._serial:
                waiter = self._serial.popleft()
            elif self._batch is not None:
                waiter, self._batch = self._batch, None
            elif self._idle:
                waiter = self._idle.popleft()
            else:
                break
            self._grant(waiter)
        holder = self._holder.kind if self._holder else None
        if holder == "batch" and self._serial and not self._draining:
            self._draining = True
            self._drains += 1
            logger.debug("drain requested for %d serial waiter(s)", len(self._serial))
            self._notify_batch(DrainRequested())
        elif self._draining and (holder != "batch" or not self._serial):
            self._draining = False
            if holder == "batch":
                logger.debug("drain called off: the serial waiters left")
                self._notify_batch(DrainCalledOff())

    def _grant(self, waiter: Acquire) -> None:
        lease = Lease(self._next, waiter.kind)
        self._next += 1
        if not offer(waiter.grant, lease):
            return
        self._holder = lease
        self._holder_channel = waiter.grant

    def _notify_batch(self, message: DrainRequested | DrainCalledOff) -> None:
        """Tell the batch group, through the channel its lease was granted on."""
        assert self._holder_channel is not None
        self._holder_channel.send_nowait(message)


def _gone(waiter: Acquire) -> bool:
    return receiver_left(waiter.grant)


async def acquire(arbiter: trio.MemorySendChannel[ArbiterMessage], kind: LeaseKind) -> Lease:
    """Wait for the engine lease.

    If cancelled while waiting, the request is withdrawn (a drain it caused ends) and no lease
    is held; a lease granted in that same instant is handed straight back. The reply channel
    closes without a checkpoint: an ``async with`` would be one, and a cancellation there
    would drop a lease already received.
    """
    send, recv = trio.open_memory_channel[Lease](1)
    with recv:
        await arbiter.send(Acquire(kind, send))
        try:
            return await recv.receive()
        except BaseException:
            with trio.move_on_after(1.0, shield=True):
                lease = take_buffered(recv, Lease)
                recv.close()
                await arbiter.send(Withdrawn() if lease is None else ReleaseLease(lease))
            raise
