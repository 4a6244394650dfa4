"""The runtime: the actors' nursery, placement, submission, statistics and shutdown.

:func:`open_runtime_actors` starts the admission gate, the engine arbiter, the serial executor
and the batch group in one nursery; the runtime runs each session as a task in a nursery of its
own inside it (:meth:`Runtime.open_sessions`), so no task outlives the runtime. Leaving the
context closes admission, lets in-flight sessions finish within ``shutdown_grace_s``, cancels
the rest with reason ``shutdown``, gives them and the lanes ``shutdown_settle_s`` to end and go
idle, then cancels whatever is left and stops the actors.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import math
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import replace
from functools import partial
from typing import Any, TypeVar

import trio

from ..engine.errors import EngineUnavailableError, RuntimeClosedError, UnknownAdapterError
from ..engine.params import PreparedRequest
from . import gate
from .arbiter import EngineArbiter, LeaseKind, ReleaseLease, acquire
from .batch_group import BatchGroup
from .batch_messages import RowsComing
from .config import MediaStatistics, RuntimeConfig, RuntimeStatistics
from .event_queue import EventQueue
from .messages import (
    GenerationRequest,
    Lane,
)
from .outcomes import OutcomeTally
from .port import EnginePort
from .serial import SerialExecutor
from .session import Session, SessionLinks, rows_not_coming
from .unwrap import BodyError

logger = logging.getLogger(__name__)

T = TypeVar("T")


class Runtime:
    """Submit requests; read their events through the returned session."""

    def __init__(self, engine: EnginePort, config: RuntimeConfig) -> None:
        self.engine = engine
        self.config = config
        budget = engine.memory_budget
        self.gate = gate.AdmissionGate(
            max_live=config.live_limit,
            max_queued=config.max_queued,
            retry_after_s=config.retry_after_s,
            kv_pool_bytes=budget.kv_pool if budget is not None else None,
        )
        inbox_size = config.live_limit + config.max_queued + 64
        self.arbiter = EngineArbiter(inbox_size=inbox_size)
        self.batch_group = BatchGroup(
            engine,
            self.arbiter.inbox,
            max_batch=config.batch_rows,
            step_timeout_s=config.step_timeout_s,
            inbox_size=inbox_size,
            admission_window_s=config.admission_window,
            arrival_gap_s=config.arrival_gap,
            steps_per_call=config.steps_per_call,
        )
        self.serial = SerialExecutor(
            engine, self.arbiter.inbox, step_timeout_s=config.step_timeout_s
        )
        self._links = SessionLinks(
            arbiter=self.arbiter.inbox,
            batch=self.batch_group.inbox,
            serial=self.serial.inbox,
        )
        self._ids = itertools.count(1)
        self._sessions: dict[str, Session] = {}
        self._sessions_nursery: trio.Nursery | None = None
        self._no_sessions = trio.Event()
        self._no_sessions.set()
        self._closed = False
        self.outcomes = OutcomeTally()
        self._media = MediaStatistics()

    # -- submission -------------------------------------------------------------------------

    def place(self, request: GenerationRequest, reason: str | None) -> Lane:
        """The lane for a request: serial if batching is off, asked for, or impossible."""
        if self.config.batch_rows == 1 or request.reproducible or reason is not None:
            return "serial"
        return "batch"

    async def submit(self, request: GenerationRequest) -> tuple[Session, EventQueue]:
        """Check, admit and start a request; return its session and its event queue.

        Raises ``InvalidRequestError`` (nothing admitted), ``OverloadedError``,
        ``EngineUnavailableError`` or ``RuntimeClosedError`` (nothing queued). If cancelled,
        nothing is left admitted.
        """
        [started] = await self.submit_all([request])
        return started

    async def submit_all(
        self, requests: list[GenerationRequest]
    ) -> list[tuple[Session, EventQueue]]:
        """Admit several requests together or not at all (one HTTP request's choices).

        Every request is checked before any is admitted (a request whose KV could never fit
        the memory budget raises ``MemoryBudgetExceededError``), and none starts before every
        one holds a permit or a place in the queue. Raises as :meth:`submit` does; then, and if
        cancelled, the permits and queue places it took are given back and no session was
        started.
        """
        if self._closed:
            raise RuntimeClosedError("the runtime is shutting down and admits no new requests")
        live = self.engine.liveness()
        if not live.is_up:
            raise EngineUnavailableError(
                f"the engine is {live.condition} ({live.last_cause})",
                retry_after_s=self.config.retry_after_s if live.condition == "restarting" else None,
            )
        # Until placed, every request may be on its way to the batch; a session on the batch
        # lane takes its announcement over, the others' are withdrawn here.
        with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
            await self.batch_group.inbox.send(RowsComing(len(requests)))
        started: list[tuple[Session, EventQueue]] = []
        try:
            prepared = [await self._prepare(r) for r in requests]
            projected = [self._projected_kv_bytes(p) for p in prepared]
            admissions = await self._admit_all(projected)
            for request, ready, admission in zip(requests, prepared, admissions, strict=True):
                started.append(self._start(request, ready, admission))
            return started
        finally:
            on_the_batch = sum(session.lane == "batch" for session, _ in started)
            await rows_not_coming(self.batch_group.inbox, len(requests) - on_the_batch)

    async def _prepare(self, request: GenerationRequest) -> PreparedRequest:
        """Tokenize and check; a request without params takes the model's defaults."""
        params = request.params
        if params is None:
            params = self.engine.sampling_defaults.params()
        if request.adapter is not None:
            served = [a.name for a in self.engine.adapters]
            if request.adapter not in served:
                raise UnknownAdapterError(request.adapter, served)
        prepared = await self.engine.prepare(request.prompt, params)
        return replace(prepared, cache_salt=request.cache_salt, adapter=request.adapter)

    def _projected_kv_bytes(self, prepared: PreparedRequest) -> int:
        """The KV bytes the request may come to hold, under the engine's memory budget (0
        without one); raises ``MemoryBudgetExceededError`` if they exceed the whole KV pool."""
        budget = self.engine.memory_budget
        if budget is None:
            return 0
        return budget.check_fits(len(prepared.prompt_tokens), prepared.params.max_tokens)

    async def _admit_all(self, projected: list[int]) -> list[gate.Admission]:
        """An admission from the gate (a permit, or a place in its queue) for each of the
        ``projected`` KV byte counts; if one is refused, or if cancelled, the others are
        released."""
        admissions: list[gate.Admission] = []
        try:
            for kv_bytes in projected:
                admissions.append(await self.gate.admit(kv_bytes))
        except BaseException:
            for admission in admissions:
                await admission.release()
            raise
        return admissions

    def _start(
        self,
        request: GenerationRequest,
        prepared: PreparedRequest,
        admission: gate.Admission,
    ) -> tuple[Session, EventQueue]:
        lane = self.place(request, self.engine.unbatchable_reason(prepared))
        if (images := prepared.images) is not None:
            media = self._media
            self._media = MediaStatistics(
                media.requests + 1,
                media.images + images.num_images,
                media.pixels + images.num_pixels,
            )
        session_id = request.request_id or f"req-{next(self._ids)}"
        events = EventQueue(
            session_id,
            max_events=self.config.event_buffer,
            max_tokens=self.config.event_buffer_tokens,
        )
        deadline = (
            trio.current_time() + request.timeout_s if request.timeout_s is not None else math.inf
        )
        session = Session(
            session_id,
            prepared,
            lane=lane,
            links=self._links,
            consumer=events,
            idle_timeout_s=self.config.idle_timeout_s,
            deadline=deadline,
            row_announced=lane == "batch",
        )
        assert self._sessions_nursery is not None, "the runtime is not running"
        self._sessions[session.id] = session
        self._no_sessions = trio.Event() if self._no_sessions.is_set() else self._no_sessions
        self._sessions_nursery.start_soon(self._run_session, session, admission)
        return session, events

    @trio.lowlevel.enable_ki_protection  # Ctrl-C goes to the caller's code, not a session
    async def _run_session(self, session: Session, admission: gate.Admission) -> None:
        try:
            await session.run(admission)
        finally:
            del self._sessions[session.id]
            if not self._sessions:  # first: a shutdown waits for it, whatever happens below
                self._no_sessions.set()
            assert session.outcome is not None, "a session ends with its outcome"
            self.outcomes.record(session.id, session.lane, session.outcome)

    def session(self, session_id: str) -> Session | None:
        """A live session by id (for cancellation by id)."""
        return self._sessions.get(session_id)

    # -- exclusive work ---------------------------------------------------------------------

    async def run_exclusive(self, fn: Callable[[], Awaitable[T]]) -> T:
        """Run ``fn`` with sole use of the engine, draining the batch first."""
        return await self._with_lease("exclusive", fn)

    async def run_when_idle(self, fn: Callable[[], Awaitable[T]]) -> T:
        """Run ``fn`` with sole use of the engine once it is idle, without causing a drain."""
        return await self._with_lease("idle", fn)

    async def _with_lease(self, kind: LeaseKind, fn: Callable[[], Awaitable[T]]) -> T:
        lease = await acquire(self.arbiter.inbox, kind)
        try:
            return await fn()
        finally:
            with trio.move_on_after(1.0, shield=True):
                await self.arbiter.inbox.send(ReleaseLease(lease))

    # -- statistics and shutdown ------------------------------------------------------------

    @property
    def is_healthy(self) -> bool:
        """The engine is up, its steps do not keep failing, and none of its steps passed the
        watchdog (a stuck step of an engine since restarted does not count)."""
        batch = self.batch_group.statistics()
        return (
            self.engine.liveness().is_up
            and batch.consecutive_faults < self.config.unhealthy_after_faults
            and not (batch.is_stuck or self.serial.statistics().is_stuck)
        )

    def statistics(self) -> RuntimeStatistics:
        gate_stats = self.gate.statistics()
        arbiter = self.arbiter.statistics()
        batch = self.batch_group.statistics()
        serial = self.serial.statistics()
        holder = "exclusive" if arbiter.holder == "idle" else arbiter.holder
        mode = "draining" if arbiter.draining else (holder or "idle")
        batch_rate = self.batch_group.throughput.snapshot()
        serial_rate = self.serial.throughput.snapshot()
        return RuntimeStatistics(
            lane_mode=mode,
            live_sessions=gate_stats.live,
            queued_sessions=gate_stats.queued,
            active_rows=batch.active_rows,
            parked_rows=batch.parked_rows,
            pending_rows=batch.pending_rows,
            rows_submitted={"batch": batch.rows_submitted, "serial": serial.runs},
            drains=arbiter.drains,
            completed=self.outcomes.completed,
            cancelled=self.outcomes.cancelled,
            failed=self.outcomes.failed,
            refused=gate_stats.refused,
            engine_faults=batch.faults + serial.faults,
            stuck_steps=batch.stuck_steps + serial.stuck_steps,
            batch_steps=batch.steps,
            kv_bytes=self.engine.kv_bytes,
            prompt_cache=self.engine.prompt_cache_statistics(),
            is_healthy=self.is_healthy,
            is_closed=self._closed,
            engine=self.engine.liveness(),
            prefilled_tokens=batch_rate.prefilled_tokens + serial_rate.prefilled_tokens,
            decoded_tokens=batch_rate.decoded_tokens + serial_rate.decoded_tokens,
            prefill_tokens_per_s=batch_rate.prefill_tokens_per_s + serial_rate.prefill_tokens_per_s,
            decode_tokens_per_s=batch_rate.decode_tokens_per_s + serial_rate.decode_tokens_per_s,
            memory_budget=self.engine.memory_budget,
            projected_kv_bytes=gate_stats.projected_kv_bytes,
            memory=self.engine.memory_usage(),
            batch_limit=batch.batch_limit,
            out_of_memory=batch.out_of_memory,
            batch_mode="off" if self.config.batch_rows == 1 else self.engine.batch_mode,
            media=self._media,
        )

    async def shutdown(self, grace_s: float | None = None) -> None:
        """Close admission, let sessions finish within the grace period (the config's if None),
        cancel the rest, and give them and the lanes ``shutdown_settle_s`` to end and go idle.

        Returns within the grace plus ``shutdown_settle_s``, a session still ending then or not
        (it was cancelled; its own cleanup is bounded). If cancelled, admission stays closed and
        the sessions cancelled so far still end."""
        grace = self.config.shutdown_grace_s if grace_s is None else grace_s
        with trio.move_on_after(grace + self.config.shutdown_settle_s) as bound:
            self._closed = True
            await self.gate.close()
            with trio.move_on_after(grace):
                await self._no_sessions.wait()
            for session in list(self._sessions.values()):
                session.cancel("shutdown")
            await self._no_sessions.wait()
            # The lanes drop the departed sessions' rows at their next step, then go idle.
            with trio.move_on_after(self.config.step_timeout_s):
                await self.run_when_idle(_nothing)
        if bound.cancelled_caught:
            _log_unsettled(len(self._sessions))

    @asynccontextmanager
    async def open_sessions(self) -> AsyncIterator[None]:
        """Run the sessions, in a nursery of the runtime's own, around the block; on leaving
        it, shut down, shielded from the caller's cancellation but no longer than
        ``shutdown_timeout_s``, then cancel any session still running (its cleanup is bounded)."""
        async with trio.open_nursery() as sessions:
            self._sessions_nursery = sessions
            try:
                yield
            finally:
                with trio.move_on_after(self.config.shutdown_timeout_s, shield=True) as bound:
                    await self.shutdown()
                if bound.cancelled_caught:
                    _log_unsettled(len(self._sessions))
                self._sessions_nursery = None
                sessions.cancel_scope.cancel()


def _log_unsettled(num_sessions: int) -> None:
    logger.warning(
        "shutdown passed its bound with %d session(s) still ending; cancelling what is left",
        num_sessions,
    )


async def _nothing() -> None:
    return None


@asynccontextmanager
async def open_runtime_actors(
    engine: EnginePort, config: RuntimeConfig | None = None
) -> AsyncIterator[Runtime]:
    """Start the runtime's actors; shut down gracefully on exit.

    The actors run shielded from the caller's cancellation: a cancel scope around the block
    that expires (a timeout, Ctrl-C) cancels the caller's code and the sessions, whose
    cleanup still has a gate and lanes to give back to; then the shutdown (bounded by
    ``shutdown_timeout_s``) ends them, and the block exits as Trio's cancellation asks."""
    runtime = Runtime(engine, config or RuntimeConfig())
    runs = (runtime.gate.run, runtime.arbiter.run, runtime.serial.run, runtime.batch_group.run)
    # Made here, not in the tasks: one cancelled before its task enters it still ends it.
    scopes = [trio.CancelScope(shield=True) for _ in runs]

    @trio.lowlevel.enable_ki_protection  # Ctrl-C goes to the caller's code, not an actor
    async def shielded(
        scope: trio.CancelScope, run: Callable[..., Awaitable[None]], *, task_status: Any
    ) -> None:
        with scope:
            await run(task_status=task_status)

    body = BodyError()
    try:
        async with trio.open_nursery() as actors:
            try:
                # Shielded: under a caller's scope already cancelled, start() would not move
                # a started actor into the nursery and would wait for it to end (never).
                with trio.CancelScope(shield=True):
                    for scope, run in zip(scopes, runs, strict=True):
                        await actors.start(partial(shielded, scope, run))
                async with runtime.open_sessions():
                    with body.kept():
                        yield runtime
            finally:
                for scope in scopes:
                    scope.cancel()
    except BaseExceptionGroup as group:
        body.raise_unless_only_it(group)
    else:
        return
    raise body.exception()  # Ctrl-C comes out as KeyboardInterrupt, not in two groups
