"""The batch group: continuous batching, one engine step at a time.

An actor with one inbox. Sessions send :class:`AddRow` with their own :class:`SessionInbox`;
the group asks the arbiter for the engine lease when it has work, admits rows up to
``max_batch`` (none while draining), steps the engine, and fans each row's events out to its
session with ``send_nowait``, so one slow reader never slows the batch: when a session's inbox
is full the row is parked (its KV leaves the batch) and a small delivery task waits for the
reader, then asks the group to resume it. A session that left (closed its inbox) loses its row
before the next step. A step that raises fails the rows of that step and the batch is rebuilt;
a step that passes the watchdog abandons them. The lease goes back when no row is left.

An engine call may run several steps, each row getting its tokens of all of them in one event
(``batch_policy.CallPacer``: the event loop's work per call holds the GIL the engine needs);
an engine in a process of its own on a GPU instead runs ahead of calls of a step or two (every
batch size), each handing out what was sampled since the last.
Rows join, leave and park between calls; while a row waits to join, calls are single steps. A
row's first token ends its call; the other rows then keep that short call's tokens for the next
call (``BatchEngine.step``), so their tokens still come in events of a whole call's steps.

A step that fails to allocate memory fails its rows like any failed step, and the group then
admits fewer rows for a while (``batch_policy.BatchLimit``; design/015-memory-budget.md).
"""

from __future__ import annotations

import itertools
import logging
import math
from collections import deque
from collections.abc import Awaitable, Callable
from typing import assert_never

import trio

from ..engine.budget import is_out_of_memory
from ..engine.errors import EngineUnavailableError
from ..engine.outputs import RowFailed, RowOutput, RowProgress
from .arbiter import (
    Acquire,
    ArbiterMessage,
    DrainCalledOff,
    DrainRequested,
    Lease,
    ReleaseLease,
)
from .batch_messages import (
    AddRow,
    BacklogDelivered,
    BatchMessage,
    BatchStatistics,
    Member,
    ReaderGone,
    RowsComing,
    RowsNotComing,
)
from .batch_policy import BatchLimit, CallPacer, FaultRecord
from .channels import offer
from .lanes import Abandoned, LaneEvent, LaneFailed, is_final
from .port import EnginePort
from .throughput import ThroughputMeter

logger = logging.getLogger(__name__)

# How often rows waiting to join look again whether a restarting engine is back.
ENGINE_POLL_S = 0.05


class BatchGroup:
    def __init__(
        self,
        engine: EnginePort,
        arbiter: trio.MemorySendChannel[ArbiterMessage],
        *,
        max_batch: int,
        step_timeout_s: float,
        inbox_size: int,
        admission_window_s: float = 0.0,
        arrival_gap_s: float = 0.0,
        steps_per_call: int | None = None,
    ) -> None:
        """``admission_window_s``: how long an empty batch waits, at most, for a burst of rows
        to arrive (:meth:`_wait_for_arrivals`); ``arrival_gap_s``: how long it waits for the
        next row of a burst once every row announced to it is here."""
        self.engine = engine
        self._rows_coming = 0  # announced, and neither added nor withdrawn yet
        self.max_batch = max_batch
        self.limit = BatchLimit(max_batch)
        self.admission_window_s = admission_window_s
        self.arrival_gap_s = arrival_gap_s
        self.pacer = CallPacer(steps_per_call)
        self.step_timeout_s = step_timeout_s
        self.inbox, self._recv = trio.open_memory_channel[BatchMessage](inbox_size)
        self._arbiter = arbiter
        self._pending: deque[AddRow] = deque()
        self._members: dict[int, Member] = {}
        self._keys = itertools.count()
        self._lease: Lease | None = None
        self._asked = False
        self._draining = False
        self._nursery: trio.Nursery | None = None
        self._rows_submitted = 0
        self._steps = 0
        self.record = FaultRecord()
        self._parks = 0
        self.throughput = ThroughputMeter()
        # The engine generation the rows in the batch were added to: a restarted engine knows
        # none of them.
        self._rows_generation = 0

    def statistics(self) -> BatchStatistics:
        parked = sum(1 for m in self._members.values() if m.parked)
        generation = self.engine.liveness().generation
        return BatchStatistics(
            active_rows=len(self._members) - parked,
            parked_rows=parked,
            pending_rows=len(self._pending),
            rows_submitted=self._rows_submitted,
            steps=self._steps,
            faults=self.record.faults,
            stuck_steps=self.record.stuck,
            consecutive_faults=self.record.consecutive(generation),
            is_stuck=self.record.is_stuck(generation),
            parks=self._parks,
            holds_lease=self._lease is not None,
            draining=self._draining,
            batch_limit=self.limit.rows,
            out_of_memory=self.limit.out_of_memory,
            rows_coming=self._rows_coming,
        )

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        async with trio.open_nursery() as nursery, self._recv:
            self._nursery = nursery
            task_status.started()
            while True:
                await self._guarded(self._advance())
                if not self._can_step():
                    await self._guarded(self._wait_for_message())
                await self._guarded(self._take_waiting_messages())

    async def _wait_for_message(self) -> None:
        """Handle the next message; while rows wait for a restarting engine, look again at it
        every ``ENGINE_POLL_S`` meanwhile."""
        waits_for_engine = bool(self._pending) and not self.engine.liveness().is_up
        with trio.move_on_after(ENGINE_POLL_S if waits_for_engine else math.inf):
            await self._handle(await self._recv.receive())

    async def _take_waiting_messages(self) -> None:
        while True:
            try:
                message = self._recv.receive_nowait()
            except trio.WouldBlock:
                return
            await self._handle(message)

    async def _guarded(self, work: Awaitable[None]) -> None:
        """Run ``work``; if an engine call in it raises, fail every row and rebuild the batch."""
        try:
            await work
        except Exception as exc:
            await self._engine_failed("an engine call", exc)

    async def _engine_failed(self, what: str, exc: Exception) -> None:
        """Count the fault, log it, fail every row with it and rebuild the batch."""
        self.record.failed(self.engine.liveness().generation)
        logger.error("%s failed; failing %d row(s)", what, len(self._members), exc_info=exc)
        if is_out_of_memory(exc):
            self.limit.lower(len(self._members))
        message = f"engine error: {type(exc).__name__}: {exc}"
        await self._fail_all(lambda row: RowFailed(row, message))

    # -- messages ---------------------------------------------------------------------------

    async def _handle(self, message: BatchMessage) -> None:
        match message:
            case RowsComing(count):
                self._rows_coming += count
            case RowsNotComing(count):
                self._rows_coming -= count
            case AddRow():
                self._pending.append(message)
                if message.is_announced:
                    self._rows_coming -= 1
            case Lease():
                # A fresh lease starts undrained: a DrainRequested that crossed our ReleaseLease in
                # flight is stale, and the arbiter asks again if a serial waiter is queued.
                self._lease = message
                self._asked = False
                self._draining = False
            case DrainRequested():
                self._draining = True
            case DrainCalledOff():
                self._draining = False
            case BacklogDelivered(key):
                member = self._members.get(key)
                if member is not None and member.parked and not member.backlog:
                    member.parked = False
                    await self.engine.batch_resume(member.row)
            case ReaderGone(key):
                member = self._members.pop(key, None)
                if member is not None:
                    await self.engine.batch_remove([member.row])
            case _:
                assert_never(message)

    # -- the loop ---------------------------------------------------------------------------

    def _num_active(self) -> int:
        return sum(1 for m in self._members.values() if not m.parked)

    def _can_admit(self) -> bool:
        return (
            bool(self._pending)
            and not self._draining
            and len(self._members) < self.limit.rows
            and self.engine.liveness().is_up
        )

    async def _leave_a_dead_engine(self) -> None:
        """Rows of an engine that died, or that is gone for good, end here: the rows in the
        batch fail ``engine_fault`` (a restarted engine knows none of them), and rows waiting
        to join fail too once the supervisor has given up (while it restarts, they wait)."""
        live = self.engine.liveness()
        if self._members and (not live.is_up or live.generation != self._rows_generation):
            await self._engine_failed(
                "the engine", EngineUnavailableError(f"the engine died: {live.last_cause}")
            )
        if self._pending and live.condition == "down":
            message = f"engine error: the engine is down for good: {live.last_cause}"
            while self._pending:
                offer(self._pending.popleft().events, LaneFailed(message))

    def _can_step(self) -> bool:
        return self._lease is not None and (self._num_active() > 0 or self._can_admit())

    async def _advance(self) -> None:
        """Admit, step once, give the lease back when empty, ask for it when there is work."""
        await self._leave_a_dead_engine()
        if self._lease is not None:
            if not self._members and self._pending and self.admission_window_s > 0:
                await self._wait_for_arrivals()
            await self._admit()
            await self._drop_departed()
            if self._num_active() > 0:
                await self._step()
            else:
                self.pacer.forget()
            if not self._members and (self._draining or not self._pending):
                self.pacer.forget()  # the batch ended in the step above
                lease, self._lease = self._lease, None
                self._draining = False
                await self._arbiter.send(ReleaseLease(lease))
        if self._lease is None and (self._pending or self._members) and not self._asked:
            self._asked = True
            await self._arbiter.send(Acquire("batch", self.inbox))

    async def _wait_for_arrivals(self) -> None:
        """Before an empty batch's first step: wait, up to the admission window, while a
        burst arrives, so that it joins in one call instead of in waves, each a join of its
        own (design/030, section 6). The rows announced to it (:class:`RowsComing`) are
        waited for until they come or are withdrawn; then, where ``arrival_gap_s`` is set, the
        next announcement, as long as one comes within that gap of the last (an HTTP server
        admits a burst's requests one after another, a millisecond or two apart). A lone
        request waits that gap at most (design/008, change 14). With no member yet, handling
        a message awaits nothing: only the receives meet the window's end."""
        with trio.move_on_after(self.admission_window_s):
            while not self._draining and len(self._pending) < self.limit.rows:
                if self._rows_coming > 0:
                    await self._handle(await self._recv.receive())
                    continue
                if self.arrival_gap_s <= 0:
                    break
                with trio.move_on_after(self.arrival_gap_s) as gap:
                    await self._handle(await self._recv.receive())
                if gap.cancelled_caught:
                    break
        await self._take_waiting_messages()

    async def _admit(self) -> None:
        """Add the waiting rows that fit, in one engine call."""
        adds: list[AddRow] = []
        while self._can_admit() and len(self._members) + len(adds) < self.limit.rows:
            add = self._pending.popleft()
            if not add.events.receiver_left:
                adds.append(add)
        if not adds:
            return
        if not self._members:
            self._rows_generation = self.engine.liveness().generation
        try:
            rows = await self.engine.batch_add([add.request for add in adds])
        except Exception as exc:  # the call itself failed: these rows fail, the batch resets
            for add in adds:
                offer(add.events, LaneFailed(f"engine error: {type(exc).__name__}: {exc}"))
            raise
        for add, row in zip(adds, rows, strict=True):
            if isinstance(row, Exception):  # the batch is unchanged: only this row fails
                self.record.faults += 1
                logger.error("the engine could not add a row", exc_info=row)
                offer(add.events, LaneFailed(f"engine error: {type(row).__name__}: {row}"))
                continue
            self._members[next(self._keys)] = Member(add.events, row)
            self._rows_submitted += 1

    async def _drop_departed(self) -> None:
        departed = [k for k, m in self._members.items() if not m.parked and m.events.receiver_left]
        if departed:
            rows = [self._members.pop(k).row for k in departed]
            await self.engine.batch_remove(rows)

    def call_plan(self) -> tuple[int, int]:
        """The next engine call's steps, and the steps the engine may run ahead of the next
        one (``CallPacer.plan``): one step while rows wait to join, a row reads its prompt or
        a drain waits.

        A row reading its prompt: since the token budget, rows join at once and the engine
        prefills them over many steps, each of them long (a chunk of a prompt); calls of 16
        such steps held the decoding rows' tokens for 16-21 s on CPU (design/017)."""
        single = self._can_admit() or self._draining or self._reading_prompts()
        apart = self.engine.steps_apart
        return self.pacer.plan(single=single, rows=self._num_active(), apart=apart)

    def _reading_prompts(self) -> bool:
        """Whether a row in the batch has not had its first token yet."""
        return any(not m.decoding and not m.parked for m in self._members.values())

    async def _step(self) -> None:
        self._steps += 1
        self.pacer.call_starts(self.engine.loop_cpu_s())
        steps, ahead = self.call_plan()
        started = trio.current_time()
        try:
            with trio.move_on_after(self.step_timeout_s * steps) as watchdog:
                events = await self.engine.batch_step(steps, ahead)
        except Exception as exc:
            # Handled here, not by _guarded, so that _advance goes on to give the lease back.
            await self._engine_failed("batch step", exc)
            return
        if watchdog.cancelled_caught:
            self.record.got_stuck(self.engine.liveness().generation)
            logger.error("batch step exceeded the %.1f s watchdog", self.step_timeout_s)
            message = f"an engine step took longer than the {self.step_timeout_s:g} s watchdog"
            await self._fail_all(lambda _row: Abandoned(message))
            return
        self.record.succeeded()
        self.limit.call_succeeded()
        self.pacer.call_ended(trio.current_time() - started, steps, ahead)
        by_row = {m.row: k for k, m in self._members.items()}
        prefilled = decoded = 0
        for event in events:
            key = by_row.get(event.row)
            # A row may have two events (progress, then tokens); the first may have ended it.
            if key is None or key not in self._members:
                continue
            match event:
                case RowProgress(done=done):
                    member = self._members[key]
                    prefilled += max(0, done - member.prefilled)
                    member.prefilled = done
                case RowOutput(delta=delta):
                    decoded += len(delta.token_ids)
                    self._members[key].decoding = True
            await self._dispatch(key, event)
        self.throughput.record(prefilled, decoded)

    async def _fail_all(self, make_event: Callable[[int], LaneEvent]) -> None:
        """End every member's row with ``make_event(row)``, then rebuild the batch. An engine
        that cannot even do that (its process died) fails the next call again, and so every
        row still gets its one outcome."""
        members, self._members = self._members, {}
        for key, member in members.items():
            self._deliver(key, member, make_event(member.row))
        try:
            await self.engine.batch_reset()
        except Exception:
            logger.exception("rebuilding the batch failed too")

    # -- fan-out ----------------------------------------------------------------------------

    async def _dispatch(self, key: int, event: LaneEvent) -> None:
        member = self._members[key]
        final = is_final(event)
        if final:
            del self._members[key]
        if member.is_delivering:
            member.backlog.append(event)
            return
        try:
            member.events.send_nowait(event)
        except trio.WouldBlock:
            if isinstance(event, RowProgress):
                return  # advisory: a later progress event supersedes it
            if not final and await self.engine.batch_park(member.row):
                member.parked = True
                self._parks += 1
            self._deliver(key, member, event)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            if not final:
                del self._members[key]
                await self.engine.batch_remove([member.row])

    def _deliver(self, key: int, member: Member, event: LaneEvent) -> None:
        """Queue ``event`` behind the member's backlog; start its delivery task if idle."""
        member.backlog.append(event)
        if len(member.backlog) == 1:
            assert self._nursery is not None
            self._nursery.start_soon(self._deliver_backlog, key, member)

    async def _deliver_backlog(self, key: int, member: Member) -> None:
        try:
            while member.backlog:
                await member.events.send(member.backlog[0])
                member.backlog.popleft()
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            member.backlog.clear()
            await self.inbox.send(ReaderGone(key))
            return
        await self.inbox.send(BacklogDelivered(key))
