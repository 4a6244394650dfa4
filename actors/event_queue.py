"""A session's events on their way to its one reader: a queue bounded in events and in tokens.

The session puts events in as into a memory channel (``send_nowait`` raises ``trio.WouldBlock``
when an event does not fit, ``send`` waits for room, both raise ``trio.BrokenResourceError``
once the reader has closed its end). Two bounds keep a reader that stalls from having output
pile up for it: ``max_events`` events, and ``max_tokens`` tokens in the text deltas among them
(events alone would let ``max_events`` times ``steps_per_call`` tokens wait). A text delta must
fit in ``max_tokens`` by itself: the session splits a bigger one.

The queue has one reader, the task that reads it first (``receive`` or ``async for``): a read
from any other task raises :class:`SecondReaderError`, so that two readers never split a
request's events between them unawares. That task may stop iterating and read on later. The
events carry ``seq`` 0, 1, 2, ... in the order they go in.
"""

from __future__ import annotations

from collections import deque

import trio

from ..engine.errors import SecondReaderError
from .messages import Event, TextDelta


class EventQueue:
    """One session's events, between it and its reader (see the module docstring)."""

    __slots__ = (
        "_events",
        "_is_closed",
        "_num_tokens",
        "_reader",
        "_reader_left",
        "_reader_waits",
        "_sender_waits",
        "max_events",
        "max_tokens",
        "num_sent",
        "num_sent_tokens",
        "request_id",
    )

    def __init__(self, request_id: str, *, max_events: int, max_tokens: int) -> None:
        self.request_id = request_id
        self.max_events = max_events
        self.max_tokens = max_tokens
        self.num_sent = 0  # events put in: the next one's seq
        self.num_sent_tokens = 0  # tokens in the text deltas put in
        self._events: deque[Event] = deque()
        self._num_tokens = 0  # tokens in the text deltas queued now
        self._is_closed = False  # the session puts no more
        self._reader_left = False
        self._reader: trio.lowlevel.Task | None = None
        self._reader_waits = trio.lowlevel.ParkingLot()
        self._sender_waits = trio.lowlevel.ParkingLot()

    # -- the session's side -----------------------------------------------------------------

    def send_nowait(self, event: Event) -> None:
        if self._reader_left:
            raise trio.BrokenResourceError
        if self._is_closed:
            raise trio.ClosedResourceError
        if not self._has_room(event):
            raise trio.WouldBlock
        assert event.seq == self.num_sent, "events go in in the order of their seq"
        tokens = _tokens(event)
        self._events.append(event)
        self._num_tokens += tokens
        self.num_sent += 1
        self.num_sent_tokens += tokens
        self._reader_waits.unpark_all()

    async def send(self, event: Event) -> None:
        """Put ``event`` in once there is room. If cancelled, it was not put in."""
        assert _tokens(event) <= self.max_tokens, "a text delta bigger than the queue"
        await trio.lowlevel.checkpoint_if_cancelled()
        while not (self._has_room(event) or self._reader_left or self._is_closed):
            await self._sender_waits.park()
        self.send_nowait(event)
        await trio.lowlevel.cancel_shielded_checkpoint()

    def close(self) -> None:
        """The session puts no more: the reader gets what is queued, then the end."""
        self._is_closed = True
        self._reader_waits.unpark_all()

    def _has_room(self, event: Event) -> bool:
        return (
            len(self._events) < self.max_events
            and self._num_tokens + _tokens(event) <= self.max_tokens
        )

    # -- the reader's side ------------------------------------------------------------------

    def __aiter__(self) -> EventQueue:
        return self

    async def __anext__(self) -> Event:
        try:
            return await self.receive()
        except trio.EndOfChannel:
            raise StopAsyncIteration from None

    async def receive(self) -> Event:
        """The next event; raises ``trio.EndOfChannel`` after the last one,
        ``trio.ClosedResourceError`` once the reader has closed its end, and
        ``SecondReaderError`` in a task other than the reader's. If cancelled, no event was
        taken."""
        self._claim()
        await trio.lowlevel.checkpoint_if_cancelled()
        while not self._events:
            if self._reader_left:
                raise trio.ClosedResourceError
            if self._is_closed:
                raise trio.EndOfChannel
            await self._reader_waits.park()
        event = self._events.popleft()
        self._num_tokens -= _tokens(event)
        self._sender_waits.unpark_all()
        await trio.lowlevel.cancel_shielded_checkpoint()
        return event

    async def aclose(self) -> None:
        """Stop reading: the events queued are dropped and the session's next send raises
        ``trio.BrokenResourceError`` (which cancels it ``consumer_closed``). Any task may close
        it. Cancelled, it is closed all the same."""
        self._reader_left = True
        self._events.clear()
        self._num_tokens = 0
        self._sender_waits.unpark_all()
        self._reader_waits.unpark_all()
        await trio.lowlevel.checkpoint()

    def _claim(self) -> None:
        """Make the calling task the reader, unless another task is."""
        task = trio.lowlevel.current_task()
        if self._reader is None:
            self._reader = task
        elif self._reader is not task:
            raise SecondReaderError(
                f"request {self.request_id}'s events have one reader, the task that read first"
            )


def _tokens(event: Event) -> int:
    return len(event.token_ids) if isinstance(event, TextDelta) else 0
