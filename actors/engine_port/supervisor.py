"""The engine's supervisor: the runtime outlives its engine.

An engine dies (its process is killed, runs out of memory, crashes in a kernel) or wedges (a
call that never returns). The supervisor is an actor that owns the engine's life: it starts
an engine (a transport and the core behind it: ``open_process_transport`` or
``open_thread_transport``), hands its transport to the runtime's one :class:`CorePort`, and
watches it, polling every ``poll_s``:

- **death**: the transport says its core is gone (the process exited, the thread ended);
- **wedge**: the oldest unanswered call ran ``wedge_grace_s`` past its allowance (one step
  timeout a step: the lanes' watchdog fires first and abandons its rows; this is the engine's
  turn). A wedged engine process is killed; a wedged thread is abandoned (it cannot be killed).

Then it takes the transport away from the port (:meth:`CorePort.detach`: every call raises
``EngineUnavailableError`` at once, so no lane, and no shutdown, ever waits on a dead engine;
the lanes fail their rows ``engine_fault``; ``/health`` turns 503 with the port's liveness),
waits a backoff (``first_backoff_s``, doubling up to ``max_backoff_s``), and starts a new
engine, its warm-up included, then attaches it as the next *generation*: the lanes check the
generation, so rows added to the dead engine are never called on the new one. More than
``max_restarts`` restarts within ``window_s`` is a crash loop: the supervisor gives up, says so
in the log, and leaves the port ``down`` (every call and every new request refused).

The first start is not retried: if the model cannot load at all, the caller gets that error.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
from collections import deque
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from dataclasses import dataclass

import trio

from ...engine.calls import EngineStarted, RunFunction
from ..port import EngineLiveness
from ..unwrap import BodyError
from .port import CorePort, Transport

logger = logging.getLogger(__name__)

EngineStarter = Callable[[], AbstractAsyncContextManager[tuple[Transport, EngineStarted]]]
PortMaker = Callable[[Transport, EngineStarted], CorePort]


@dataclass(frozen=True, slots=True)
class RestartPolicy:
    """How the supervisor watches and restarts. ``max_restarts`` 0: never restart (an engine
    that dies stays down)."""

    max_restarts: int = 5
    window_s: float = 600.0
    first_backoff_s: float = 0.5
    max_backoff_s: float = 15.0
    step_timeout_s: float = 60.0  # the lanes' watchdog: a call's allowance is steps x this
    wedge_grace_s: float = 1.0
    poll_s: float = 0.05
    # An engine process idle this long is asked to answer a no-op within probe_timeout_s: one
    # stopped (SIGSTOP) or wedged while idle is found without a request waiting on it.
    probe_after_s: float = 2.0
    probe_timeout_s: float = 5.0


class EngineSupervisor:
    """Runs engines one after another for one port; see the module docstring."""

    def __init__(self, start: EngineStarter, make_port: PortMaker, policy: RestartPolicy) -> None:
        self._start = start
        self._make_port = make_port
        self.policy = policy
        self.port: CorePort | None = None
        self._recent: deque[float] = deque()  # when each restart in the window began

    async def run(self, *, task_status: trio.TaskStatus[CorePort] = trio.TASK_STATUS_IGNORED):
        """Start the first engine (its error is raised: nothing to supervise yet), report its
        port, then keep an engine running until cancelled or the restarts run out."""
        live = EngineLiveness()
        while True:
            cause: str | None = None
            try:
                async with self._start() as (transport, started):
                    if self.port is None:
                        self.port = self._make_port(transport, started)
                        self.port.is_supervised = True
                        self.port.attach(transport, started, live)
                        task_status.started(self.port)
                    else:
                        live = EngineLiveness(
                            "up", live.generation + 1, live.restarts, live.last_cause
                        )
                        self.port.attach(transport, started, live)
                        logger.warning(
                            "the engine is up again (generation %d, restart %d)",
                            live.generation,
                            live.restarts,
                        )
                    cause, wedged = await self._watch(transport)
                    live = EngineLiveness("restarting", live.generation, live.restarts, cause)
                    self.port.detach(live)
                    logger.error("the engine is down: %s", cause)
                    if wedged:
                        transport.kill()
            except Exception as exc:
                if self.port is None:
                    raise
                if cause is None:  # the start failed, not the engine we watched
                    cause = f"the engine did not start: {type(exc).__name__}: {exc}"
                    logger.error("%s", cause)
                live = EngineLiveness("restarting", live.generation, live.restarts, cause)
                self.port.detach(live)
            if not self._may_restart():
                live = EngineLiveness("down", live.generation, live.restarts, cause)
                self.port.detach(live)
                logger.critical(
                    "the engine went down %d times within %.0f s; the supervisor gives up and "
                    "the server stays unavailable (last cause: %s)",
                    len(self._recent) + 1,
                    self.policy.window_s,
                    cause,
                )
                return
            live = EngineLiveness("restarting", live.generation, live.restarts + 1, cause)
            self.port.detach(live)
            backoff = self._backoff_s()
            logger.warning("restarting the engine in %.1f s (restart %d)", backoff, live.restarts)
            await trio.sleep(backoff)

    async def _watch(self, transport: Transport) -> tuple[str, bool]:
        """Until the engine dies or wedges: why, and whether it wedged (so must be killed).
        An engine process that sits idle is probed (``RestartPolicy.probe_after_s``)."""
        policy = self.policy
        probe_sent: list[float] = []  # when the probe in flight was sent

        async def probe() -> None:
            probe_sent.append(trio.current_time())
            with contextlib.suppress(Exception):  # a dead engine: the loop sees its death
                await transport.call(RunFunction(os.getpid, ()))
            probe_sent.clear()

        async with trio.open_nursery() as probes:
            while True:
                await trio.sleep(policy.poll_s)
                if (death := transport.death()) is not None:
                    probes.cancel_scope.cancel()
                    return death, False
                overdue = transport.clock.overdue_s(policy.step_timeout_s)
                if overdue > policy.wedge_grace_s:
                    probes.cancel_scope.cancel()
                    return f"an engine call ran {overdue:.1f} s past its allowance (wedged)", True
                if transport.pid is None:  # a thread: it cannot stop while idle
                    continue
                if probe_sent and trio.current_time() - probe_sent[0] > policy.probe_timeout_s:
                    probes.cancel_scope.cancel()
                    why = f"the idle engine did not answer within {policy.probe_timeout_s:g} s"
                    return f"{why} (stopped or wedged)", True
                if not probe_sent and transport.clock.idle_s() > policy.probe_after_s:
                    probes.start_soon(probe)
        raise AssertionError("unreachable")

    def _may_restart(self) -> bool:
        now = trio.current_time()
        while self._recent and now - self._recent[0] > self.policy.window_s:
            self._recent.popleft()
        if len(self._recent) >= self.policy.max_restarts:
            return False
        self._recent.append(now)
        return True

    def _backoff_s(self) -> float:
        doublings = len(self._recent) - 1
        return min(self.policy.max_backoff_s, self.policy.first_backoff_s * 2**doublings)


@asynccontextmanager
async def open_supervised_engine(
    start: EngineStarter, make_port: PortMaker, policy: RestartPolicy
) -> AsyncIterator[CorePort]:
    """Start an engine under a supervisor and yield the port the runtime drives; on exit the
    supervisor stops and the engine it runs then is ended.

    Once its first engine is up, the supervisor is shielded from the caller's cancellation
    until the block exits: a cancel scope around the block that expires (a timeout, Ctrl-C)
    must not take the engine away from the runtime inside it while that shuts down (its lanes
    would fail on a closed engine, and the supervisor would report it down). The first start,
    the model's load, stays cancellable."""
    supervisor = EngineSupervisor(start, make_port, policy)
    scope = trio.CancelScope()  # the supervisor's; shielded once its engine is up
    failure: Exception | None = None
    body = BodyError()

    @trio.lowlevel.enable_ki_protection  # Ctrl-C goes to the caller's code
    async def supervise(*, task_status: trio.TaskStatus[CorePort]) -> None:
        with scope:
            await supervisor.run(task_status=_ShieldOnStart(task_status, scope))

    try:
        async with trio.open_nursery() as nursery:
            try:
                port: CorePort = await nursery.start(supervise)
            except Exception as exc:  # raised below as it is, not in the nursery's group
                failure = exc
            else:
                try:
                    with body.kept():
                        yield port
                finally:
                    scope.cancel()
    except BaseExceptionGroup as group:
        body.raise_unless_only_it(group)
    else:
        if failure is not None:
            raise failure
        return
    raise body.exception()


class _ShieldOnStart:
    """The supervisor's task status: once it reports its port, its scope is shielded."""

    def __init__(self, task_status: trio.TaskStatus[CorePort], scope: trio.CancelScope) -> None:
        self._task_status = task_status
        self._scope = scope

    def started(self, port: CorePort) -> None:
        self._task_status.started(port)
        # Not if the caller was cancelled meanwhile: start() then left this task where it was,
        # and waits for it to end.
        if trio.current_effective_deadline() != -math.inf:
            self._scope.shield = True
