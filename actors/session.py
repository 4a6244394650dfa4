"""One session per request: its cancel scope, its lifecycle, and what it publishes.

created -> queued -> preparing -> running -> settling -> terminal. The session waits for its
admission permit, gets its lane (the serial lease, or a row in the batch group), forwards the
lane's events to its consumer as :class:`TextDelta` / :class:`Progress` (numbered by ``seq``,
through an :class:`EventQueue` bounded in events and tokens), and publishes exactly one
outcome. Every cancel records one reason: ``requested`` (``cancel()``), ``consumer_closed``
(the consumer closed its end), ``consumer_idle`` (an event waited ``idle_timeout_s`` for the
consumer), ``deadline`` (``timeout_s`` over queue, prefill and decode), ``shutdown`` and
``engine_fault`` (its step hung). Leaving releases the permit and closes its inbox, which
takes the row out of the batch at the next step.
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass

import trio

from ..engine.outputs import Delta, GenerationStats, RowFailed, RowOutput, RowProgress
from ..engine.params import PreparedRequest
from . import gate
from .arbiter import ArbiterMessage, acquire
from .batch_messages import AddRow, BatchMessage, RowsNotComing
from .event_queue import EventQueue
from .lanes import Abandoned, LaneEvent, LaneFailed, SessionInbox
from .messages import (
    Cancelled,
    CancelReason,
    Completed,
    Event,
    Failed,
    FailureCode,
    Lane,
    Outcome,
    Progress,
    SessionState,
    TextDelta,
    Timings,
    Usage,
)
from .serial import SerialJob

logger = logging.getLogger(__name__)

LANE_BUFFER = 16
CLEANUP_GRACE_S = 1.0


@dataclass(frozen=True, slots=True)
class SessionLinks:
    """The actors a session talks to (the gate through its :class:`gate.Admission`)."""

    arbiter: trio.MemorySendChannel[ArbiterMessage]
    batch: trio.MemorySendChannel[BatchMessage]
    serial: trio.MemorySendChannel[SerialJob]


class Session:
    def __init__(
        self,
        session_id: str,
        request: PreparedRequest,
        *,
        lane: Lane,
        links: SessionLinks,
        consumer: EventQueue,
        idle_timeout_s: float,
        deadline: float,
        row_announced: bool = False,
    ) -> None:
        """``row_announced``: the batch group was told this session's row is coming
        (:class:`RowsComing`); the session ends that with its :class:`AddRow`, or, if it never
        sends one, with :class:`RowsNotComing`."""
        self.id = session_id
        self.request = request
        self.lane = lane
        self.state: SessionState = "created"
        self.outcome: Outcome | None = None
        self.cancel_reason: CancelReason | None = None
        self.done = trio.Event()
        self._links = links
        self._consumer = consumer
        self._idle_timeout_s = idle_timeout_s
        self._scope = trio.CancelScope(deadline=deadline)
        self._created_at = trio.current_time()
        self._running_at: float | None = None
        self._row_announced = row_announced  # and its AddRow not sent yet
        self._first_token_at: float | None = None
        self._last_token_at: float | None = None
        self._num_generated = 0

    def cancel(self, reason: CancelReason = "requested") -> None:
        """Cancel with ``reason``; the first reason given wins. No effect once terminal."""
        if self.state == "terminal":
            return
        if self.cancel_reason is None:
            self.cancel_reason = reason
        self._scope.cancel()

    async def run(self, admission: gate.Admission) -> None:
        """Run the session to its outcome, then release its admission (the permit, or its
        place in the queue). Never raises for anything a request can cause."""
        outcome: Outcome | None = None
        try:
            with self._scope:
                self.state = "queued"
                if await admission.wait() is None:  # the gate closed while we were queued
                    self.cancel("shutdown")
                    await trio.lowlevel.checkpoint()
                self.state = "preparing"
                outcome = await self._generate()
        except Exception as exc:
            logger.exception("session %s failed", self.id)
            outcome = self._failed("internal_error", f"{type(exc).__name__}: {exc}")
        finally:
            self.state = "settling"
            if self._row_announced:  # its row will not come: the batch need not wait for it
                await rows_not_coming(self._links.batch, 1)
            await admission.release()  # shielded, bounded
            if outcome is None:
                outcome = Cancelled(
                    self._cancel_reason(),
                    self._usage(),
                    committed_tokens=self._consumer.num_sent_tokens,
                    seq=self._consumer.num_sent,
                )
            await self._publish_outcome(outcome)

    def _cancel_reason(self) -> CancelReason:
        if self.cancel_reason is not None:
            return self.cancel_reason
        if trio.current_time() >= self._scope.deadline:
            return "deadline"
        return "shutdown"

    async def _generate(self) -> Outcome:
        inbox = SessionInbox(self._shortcut, LANE_BUFFER)
        try:
            if self.lane == "serial":
                lease = await acquire(self._links.arbiter, "serial")
                self._links.serial.send_nowait(SerialJob(self.request, lease, inbox))
            else:
                await self._links.batch.send(AddRow(self.request, inbox, self._row_announced))
                self._row_announced = False  # the AddRow ended the announcement
            self.state = "running"
            self._running_at = trio.current_time()
            return await self._forward(inbox)
        finally:  # without a checkpoint, which could turn an outcome into Cancelled
            inbox.close_receiver()

    async def _forward(self, inbox: SessionInbox) -> Outcome:
        """Handle the events the shortcut left to this task, until the row's final one."""
        while (event := await inbox.receive()) is not None:
            match event:
                case RowProgress(done=done, total=total):
                    await self._publish(Progress(done, total, seq=self._consumer.num_sent))
                case RowOutput(delta=delta, stats=stats):
                    self._count(delta, stats)
                    if delta.text or delta.token_ids:
                        await self._publish_text(delta)
                    if stats is not None:
                        assert delta.finish_reason is not None
                        return Completed(
                            finish_reason=delta.finish_reason,
                            usage=self._usage(stats),
                            timings=self._timings(),
                            lane=self.lane,
                            committed_tokens=self._consumer.num_sent_tokens,
                            seq=self._consumer.num_sent,
                        )
                case RowFailed(message=message) | LaneFailed(message=message):
                    return self._failed("engine_fault", message)
                case Abandoned(message=message):
                    logger.error("session %s abandoned: %s", self.id, message)
                    self.cancel("engine_fault")
                    await trio.lowlevel.checkpoint()
            inbox.handled()
        raise AssertionError("the lane closed without a final event")

    def _shortcut(self, event: LaneEvent) -> bool:
        """Hand a progress or token event to the consumer from the lane's task, if that needs
        no waiting (see :class:`SessionInbox`); False leaves it to :meth:`_forward`. Runs once
        per row and engine call, so it checks only what that path would."""
        if self.state != "running" or self._scope.cancel_called:
            return False
        match event:
            case RowProgress(done=done, total=total):
                return self._offer(Progress(done, total, seq=self._consumer.num_sent))
            case RowOutput(delta=delta, stats=None):
                seq = self._consumer.num_sent
                text = TextDelta(delta.text, delta.token_ids, delta.logprobs, seq=seq)
                if (delta.text or delta.token_ids) and not self._offer(text):
                    return False
                self._count(delta, None)
                return True
        return False

    def _count(self, delta: Delta, stats: GenerationStats | None) -> None:
        now = trio.current_time()
        if self._first_token_at is None:
            self._first_token_at = now
        self._last_token_at = now
        self._num_generated = (
            stats.generated_tokens if stats else self._num_generated + len(delta.token_ids)
        )

    def _failed(self, code: FailureCode, message: str) -> Failed:
        return Failed(
            code,
            message,
            committed_tokens=self._consumer.num_sent_tokens,
            seq=self._consumer.num_sent,
        )

    def _offer(self, event: Event) -> bool:
        """Give ``event`` to the consumer if its buffer has room (False: full, or it left)."""
        try:
            self._consumer.send_nowait(event)
        except (trio.WouldBlock, trio.BrokenResourceError, trio.ClosedResourceError):
            return False
        return True

    async def _publish_text(self, delta: Delta) -> None:
        """Publish a delta's text and tokens: as one :class:`TextDelta` if its tokens fit in the
        consumer's token bound, else as several that do (the text with the first)."""
        step = self._consumer.max_tokens
        ids, logprobs = delta.token_ids, delta.logprobs
        if len(ids) <= step:
            await self._publish(TextDelta(delta.text, ids, logprobs, seq=self._consumer.num_sent))
            return
        for start in range(0, len(ids), step):
            await self._publish(
                TextDelta(
                    delta.text if start == 0 else "",
                    ids[start : start + step],
                    None if logprobs is None else logprobs[start : start + step],
                    seq=self._consumer.num_sent,
                )
            )

    async def _publish(self, event: Event) -> None:
        """Hand ``event`` to the consumer, or cancel the session if it left or went idle.

        The common case, room in the consumer's buffer, costs no cancel scope and no
        checkpoint (the next receive from the lane is one): it runs once per row and token.
        """
        try:
            try:
                self._consumer.send_nowait(event)
                return
            except trio.WouldBlock:
                pass
            with trio.move_on_after(self._idle_timeout_s) as idle:
                await self._consumer.send(event)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            self.cancel("consumer_closed")
        else:
            if idle.cancelled_caught:
                self.cancel("consumer_idle")
        await trio.lowlevel.checkpoint()

    async def _publish_outcome(self, outcome: Outcome) -> None:
        """Give the consumer its outcome if it takes it within ``CLEANUP_GRACE_S``, then close
        its channel either way, so that a reader never waits for an event that cannot come (the
        outcome stays in :attr:`outcome`)."""
        self.outcome = outcome
        with trio.move_on_after(CLEANUP_GRACE_S, shield=True):
            try:
                if self.cancel_reason not in ("consumer_closed", "consumer_idle"):
                    await self._consumer.send(outcome)
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                pass
        self._consumer.close()
        self.state = "terminal"
        self.done.set()

    def _usage(self, stats: GenerationStats | None = None) -> Usage:
        images = self.request.images
        return Usage(
            prompt_tokens=len(self.request.prompt_tokens),
            completion_tokens=self._num_generated,
            cached_tokens=stats.cached_tokens if stats else 0,
            drafted_tokens=stats.drafted_tokens if stats else 0,
            accepted_tokens=stats.accepted_tokens if stats else 0,
            images=0 if images is None else images.num_images,
            image_pixels=0 if images is None else images.num_pixels,
        )

    def _timings(self) -> Timings:
        first = self._first_token_at
        last = self._last_token_at or first
        started = self._running_at or self._created_at
        return Timings(
            queued_s=started - self._created_at,
            ttft_s=None if first is None else first - self._created_at,
            decode_s=0.0 if first is None or last is None else last - first,
            prefill_s=None if first is None else first - started,
        )


async def rows_not_coming(batch: trio.MemorySendChannel[BatchMessage], count: int) -> None:
    """Tell the batch group ``count`` announced rows will not come; shielded, for at most
    ``CLEANUP_GRACE_S`` (a batch group that is gone waits for none)."""
    if count == 0:
        return
    with (
        trio.move_on_after(CLEANUP_GRACE_S, shield=True),
        contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError),
    ):
        await batch.send(RowsNotComing(count))
