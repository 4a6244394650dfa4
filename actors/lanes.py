"""What a lane (serial executor or batch group) sends a session, and the inbox it sends it to."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import trio

from ..engine.outputs import RowEvent, RowFailed, RowOutput


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


class SessionInbox:
    """A session's inbox for its lane's events: a memory channel, with a shortcut.

    The lane sends as on a memory channel (``send_nowait`` raises ``trio.WouldBlock`` when the
    buffer is full, ``send`` waits). While the session has handled everything sent through
    the channel, ``shortcut(event)`` may take an event in the sender's task instead: the
    session hands it straight on to its consumer when that needs no waiting, and returns
    whether it did. A streaming row's tokens then wake one task, its consumer, instead of two
    (the session, then the consumer); the event loop's work per row and engine call is what
    competes with a GPU engine thread for the GIL (design/008). Anything the shortcut declines
    (a final event, a full consumer, a cancelled session) goes through the channel, and so do
    the events after it until the session has caught up, so order is kept.
    """

    __slots__ = ("_recv", "_send", "_shortcut", "_unhandled", "receiver_left")

    def __init__(self, shortcut: Callable[[LaneEvent], bool], buffer: int) -> None:
        self._send, self._recv = trio.open_memory_channel[LaneEvent](buffer)
        self._shortcut = shortcut
        self._unhandled = 0  # sent through the channel, not yet handled by the session
        self.receiver_left = False  # the session has stopped reading: the row can go

    # -- the lane's side --------------------------------------------------------------------

    def send_nowait(self, event: LaneEvent) -> None:
        if self._shortcut_took(event):
            return
        self._send.send_nowait(event)
        self._unhandled += 1

    async def send(self, event: LaneEvent) -> None:
        if self._shortcut_took(event):
            await trio.lowlevel.checkpoint()
            return
        self._unhandled += 1
        try:
            await self._send.send(event)
        except BaseException:
            self._unhandled -= 1
            raise

    def _shortcut_took(self, event: LaneEvent) -> bool:
        """Whether the session took ``event`` in this task: only once it has caught up."""
        return self._unhandled == 0 and not self.receiver_left and self._shortcut(event)

    def close(self) -> None:
        """No more events: the session's ``receive`` returns None once it has read the rest."""
        self._send.close()

    # -- the session's side -----------------------------------------------------------------

    async def receive(self) -> LaneEvent | None:
        """The next event sent through the channel; None once the lane closed its end."""
        try:
            return await self._recv.receive()
        except trio.EndOfChannel:
            return None

    def handled(self) -> None:
        """The session is done with the event it received last."""
        self._unhandled -= 1

    def close_receiver(self) -> None:
        """The session leaves: sending raises ``trio.BrokenResourceError`` from now on."""
        self.receiver_left = True
        self._recv.close()
