"""The serial executor: one generation at a time, with sole use of the engine.

A session acquires the engine lease (kind ``serial``) itself, so that cancelling it while it
waits withdraws the request and ends any drain it caused; then it hands the lease and its
request here. The executor runs the generation one step at a time, sending each event to the
session's inbox (a serial run may wait for its one consumer; the idle timeout bounds that),
and always ends the run and releases the lease, however the run ends.
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass

import trio

from ..engine.outputs import RowEvent, RowFailed, RowOutput, RowProgress
from ..engine.params import PreparedRequest
from .arbiter import ArbiterMessage, Lease, ReleaseLease
from .lanes import Abandoned, LaneEvent, SessionInbox, is_final
from .port import EnginePort
from .throughput import ThroughputMeter

logger = logging.getLogger(__name__)

ENGINE_POLL_S = 0.05  # how often a run waiting for a restarting engine looks again


@dataclass(frozen=True, slots=True)
class SerialJob:
    request: PreparedRequest
    lease: Lease
    events: SessionInbox


@dataclass(frozen=True, slots=True)
class SerialStatistics:
    runs: int
    running: bool
    faults: int
    stuck_steps: int
    is_stuck: bool  # a step of the current engine passed the watchdog: the engine is wedged


class SerialExecutor:
    def __init__(
        self,
        engine: EnginePort,
        arbiter: trio.MemorySendChannel[ArbiterMessage],
        *,
        step_timeout_s: float,
    ) -> None:
        self.engine = engine
        self.step_timeout_s = step_timeout_s
        # The lease makes jobs one at a time, so one slot is all the inbox ever needs.
        self.inbox, self._recv = trio.open_memory_channel[SerialJob](1)
        self._arbiter = arbiter
        self._runs = 0
        self._running = False
        self._faults = 0
        self._stuck = 0
        self._stuck_generation: int | None = None  # the engine generation of the last one
        self.throughput = ThroughputMeter()
        self._prefilled = 0  # the current run's prompt tokens done

    def statistics(self) -> SerialStatistics:
        is_stuck = self._stuck_generation == self.engine.liveness().generation
        return SerialStatistics(self._runs, self._running, self._faults, self._stuck, is_stuck)

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        async with self._recv:
            async for job in self._recv:
                self._runs += 1
                self._running = True
                try:
                    await self._run_job(job)
                finally:
                    self._running = False
                    with trio.move_on_after(1.0, shield=True):
                        await self._arbiter.send(ReleaseLease(job.lease))

    async def _run_job(self, job: SerialJob) -> None:
        events = job.events
        started = False
        finished = False
        try:
            await self._wait_for_a_restarting_engine(events)
            if events.receiver_left:
                return
            self._prefilled = 0
            await self.engine.serial_start(job.request)
            started = True
            while not finished and not events.receiver_left:
                with trio.move_on_after(self.step_timeout_s) as watchdog:
                    step = await self.engine.serial_step()
                if watchdog.cancelled_caught:
                    self._stuck += 1
                    self._stuck_generation = self.engine.liveness().generation
                    logger.error("serial step exceeded the %.1f s watchdog", self.step_timeout_s)
                    await _send_quietly(events, _stuck_event(self.step_timeout_s))
                    return
                self._record(step)
                for event in step:
                    finished = finished or is_final(event)
                    await events.send(event)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            logger.debug("serial run's consumer left; stopping it")
        except Exception as exc:
            self._faults += 1
            logger.exception("serial run failed")
            await _send_quietly(events, RowFailed(0, f"engine error: {type(exc).__name__}: {exc}"))
        finally:
            # Always, even after a final event: ending a finished run is a no-op, and an engine
            # that did not clean up after a failure must not leak its run into the next one.
            if started:
                with trio.move_on_after(1.0, shield=True):
                    try:
                        await self.engine.serial_stop()
                    except Exception:  # the engine is gone (its process died, say)
                        logger.exception("ending the serial run failed too")
            events.close()

    def _record(self, step: list[RowEvent]) -> None:
        prefilled = decoded = 0
        for event in step:
            match event:
                case RowProgress(done=done):
                    prefilled += max(0, done - self._prefilled)
                    self._prefilled = done
                case RowOutput(delta=delta):
                    decoded += len(delta.token_ids)
        self.throughput.record(prefilled, decoded)

    async def _wait_for_a_restarting_engine(self, events: SessionInbox) -> None:
        """A run does not start on an engine that its supervisor is restarting: it waits (the
        session's deadline and its reader still apply), holding the lease no one could use."""
        while self.engine.liveness().condition == "restarting" and not events.receiver_left:
            await trio.sleep(ENGINE_POLL_S)


def _stuck_event(timeout_s: float) -> Abandoned:
    return Abandoned(f"an engine step took longer than the {timeout_s:g} s watchdog")


async def _send_quietly(inbox: SessionInbox, event: LaneEvent) -> None:
    with trio.move_on_after(1.0, shield=True):
        with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
            await inbox.send(event)
