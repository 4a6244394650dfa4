"""Small helpers over Trio memory channels that every actor uses.

A request carries its own reply channel; the receiver closing it means the requester left.
"""

from __future__ import annotations

from typing import Any, Protocol, TypeVar

import trio

T = TypeVar("T")
T_contra = TypeVar("T_contra", contravariant=True)


class SendsNowait(Protocol[T_contra]):
    """A memory send channel, or anything that sends like one (a session's inbox)."""

    def send_nowait(self, value: T_contra, /) -> None: ...


def receiver_left(channel: trio.MemorySendChannel[Any]) -> bool:
    """Whether every receive end of ``channel`` is closed: whoever was to read it has gone."""
    return channel.statistics().open_receive_channels == 0


def offer(channel: SendsNowait[T], value: T) -> bool:
    """Send without waiting; False if the receiver left (a full channel is a caller's bug)."""
    try:
        channel.send_nowait(value)
    except (trio.BrokenResourceError, trio.ClosedResourceError):
        return False
    return True


def take_buffered(channel: trio.MemoryReceiveChannel[T], kind: type) -> Any | None:
    """The first buffered value of type ``kind``, if any: a reply (a permit, a lease) that was
    granted in the same instant its requester was cancelled, so that it can be given back."""
    while True:
        try:
            value = channel.receive_nowait()
        except (trio.WouldBlock, trio.EndOfChannel, trio.ClosedResourceError):
            return None
        if isinstance(value, kind):
            return value
