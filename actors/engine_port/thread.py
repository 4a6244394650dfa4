"""The engine thread: one long-lived thread that owns all MLX state and runs every MLX call;
and the engine port's transport over it (``ThreadedEngine``).

mlx-lm's generation stream is thread-local, and ``trio.to_thread.run_sync`` may pick any cached
thread, so every call that touches MLX goes through one :class:`EngineThread`. MLX releases the
GIL while it evaluates, so the Trio event loop keeps running during a step (design/002).

The two threads share the GIL. Python's default switch interval (5 ms) lets the event loop keep
the GIL for up to 5 ms each time the engine thread comes back from an MLX call that released it,
and a step makes many such calls: a GPU step of 256 rows took three times as long as mlx-lm's
own while the event loop was busy. While an engine thread runs, the interval is
``SWITCH_INTERVAL_S`` (design/008).

While no job waits, the thread can do ``idle`` work, a piece at a time, looking for a job after
each piece: the batch engine steps ahead of its next call there, so that it does not sit idle
while the event loop hands out the last call's tokens (design/008).

:class:`ThreadTransport` answers the port's calls with an :class:`EngineCore` on the thread;
:class:`ThreadedEngine` is the port over it, and loads its engine there.
"""

from __future__ import annotations

import logging
import queue
import sys
import threading
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any, TypeVar, cast

import outcome
import trio

from ...engine.calls import Call, EngineCall, EngineStarted, EngineState, Reply, answer
from ...engine.core import EngineCore, clear_thread_streams
from ...engine.errors import EngineUnavailableError
from ...engine.generate import Engine
from ...engine.options import CoreRecipe, boot_core
from .port import CallClock, CorePort

logger = logging.getLogger(__name__)

T = TypeVar("T")
R = TypeVar("R")

SWITCH_INTERVAL_S = 0.0005


@dataclass(frozen=True, slots=True)
class _Job:
    fn: Callable[[], Any]
    deliver: Callable[[outcome.Outcome], None]


class EngineThread:
    """A single worker thread with a FIFO of jobs. Use as a context manager.

    Jobs run one at a time, in submission order. A job cannot be interrupted once it runs.
    """

    def __init__(
        self, name: str = "mlx-trio-engine", *, switch_interval_s: float | None = SWITCH_INTERVAL_S
    ) -> None:
        """``switch_interval_s``: the GIL switch interval while the thread runs (None: leave
        Python's setting alone)."""
        # Work for the thread while no job waits (see add_idle_work), one list for every
        # engine that shares the thread.
        self._idle_work: list[Callable[[], bool]] = []
        self._jobs: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._closed = False
        self._switch_interval_s = switch_interval_s
        self._previous_interval_s: float | None = None

    def __enter__(self) -> EngineThread:
        if self._switch_interval_s is not None:
            self._previous_interval_s = sys.getswitchinterval()
            sys.setswitchinterval(min(self._switch_interval_s, self._previous_interval_s))
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def ident(self) -> int | None:
        return self._thread.ident

    def is_alive(self) -> bool:
        return self._thread.is_alive()

    def abandon(self) -> None:
        """Stop taking jobs and leave the thread to end on its own, without waiting for it: a
        wedged MLX call cannot be interrupted (the thread is a daemon)."""
        if self._closed:
            return
        self._closed = True
        self._jobs.put(None)
        logger.error("abandoned the engine thread %s", self._thread.name)
        if self._previous_interval_s is not None:
            sys.setswitchinterval(self._previous_interval_s)

    def close(self) -> None:
        """Finish queued jobs, then stop the thread and wait for it."""
        if self._closed:
            return
        self._closed = True
        self._jobs.put(None)
        if self._thread.is_alive():
            self._thread.join()
        if self._previous_interval_s is not None:
            sys.setswitchinterval(self._previous_interval_s)

    def add_idle_work(self, work: Callable[[], bool]) -> None:
        """Run ``work`` on the thread while no job waits, a piece a call; it returns whether it
        did any. Each engine on the thread adds its own; while no job waits, each piece goes to
        the first that has work, and once none has, the thread waits for the next job."""
        self._idle_work.append(work)

    def _loop(self) -> None:
        try:
            while (job := self._next_job()) is not None:
                job.deliver(outcome.capture(job.fn))
        finally:
            clear_thread_streams()

    def _next_job(self) -> _Job | None:
        """The next job (None: close); until one waits, pieces of the idle work run."""
        while self._idle_work:
            try:
                return self._jobs.get_nowait()
            except queue.Empty:
                pass
            try:
                if not any(work() for work in self._idle_work):
                    break
            except Exception:
                logger.exception("the engine thread's idle work failed; it waits for a job")
                break
        return self._jobs.get()

    def _submit(self, fn: Callable[[], Any], deliver: Callable[[outcome.Outcome], None]) -> None:
        if self._closed:
            raise EngineUnavailableError("the engine thread is closed")
        self._jobs.put(_Job(fn, deliver))

    def call(self, fn: Callable[..., T], *args: Any) -> T:
        """Run ``fn(*args)`` on the engine thread and block until it returns (not from Trio)."""
        done = threading.Event()
        box: list[outcome.Outcome] = []

        def deliver(result: outcome.Outcome) -> None:
            box.append(result)
            done.set()

        self._submit(lambda: fn(*args), deliver)
        done.wait()
        return box[0].unwrap()

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        """Run ``fn(*args)`` on the engine thread; await its result without blocking Trio.

        If the awaiting task is cancelled, the job still runs to completion on the engine
        thread (MLX work cannot be interrupted) and its result or exception is dropped; callers
        whose state depends on the job finishing shield this call.
        """
        token = trio.lowlevel.current_trio_token()
        done = trio.Event()
        box: list[outcome.Outcome] = []

        def wake(result: outcome.Outcome) -> None:
            box.append(result)
            done.set()

        def deliver(result: outcome.Outcome) -> None:
            try:
                token.run_sync_soon(wake, result)
            except trio.RunFinishedError:
                logger.debug("engine job finished after its Trio run ended")

        self._submit(lambda: fn(*args), deliver)
        await done.wait()
        return box[0].unwrap()


class ThreadTransport:
    """The port's calls, answered on an :class:`EngineThread` by ``core``; between calls the
    thread steps the core's batch ahead of its next call."""

    def __init__(self, thread: EngineThread, core: EngineCore) -> None:
        self.thread = thread
        self.core = core
        self.state = EngineState()
        self.clock = CallClock()
        self._killed = False
        thread.add_idle_work(core.step_ahead)

    async def call(self, call: Call[R]) -> Reply[R]:
        """Answer ``call`` on the engine thread; if cancelled, it still completes there and its
        reply is dropped (its state is kept)."""
        self.clock.sent(call)
        return await self.thread.run(self._answer, cast(EngineCall, call))

    def _answer(self, call: EngineCall) -> Reply[Any]:
        try:
            reply = answer(self.core, call)
        finally:
            self.clock.answered()
        self.state = reply.state  # from the engine thread: one reference, read whole
        return reply

    pid = None  # the engine runs in this process

    def death(self) -> str | None:
        if self._killed:
            return "the engine thread was abandoned"
        return None if self.thread.is_alive() else "the engine thread ended"

    def kill(self) -> None:
        """A thread cannot be killed: abandon it (its wedged call may never return)."""
        self._killed = True
        self.clock.clear()
        self.thread.abandon()

    async def aclose(self) -> None:
        """Nothing to stop: the thread is its owner's, and may serve other engines."""


class ThreadedEngine(CorePort):
    """The ``EnginePort`` over an :class:`EngineCore` on an :class:`EngineThread`: each call
    runs on the thread. :meth:`load` boots one there; :meth:`over` puts a port over an engine
    already loaded (benchmarks and tests share one engine between several ports)."""

    def __init__(self, thread: EngineThread, core: EngineCore, started: EngineStarted) -> None:
        self.engine = core.engine
        self.thread = thread
        super().__init__(ThreadTransport(thread, core), started, core.engine.preparer)

    @classmethod
    def over(cls, engine: Engine, thread: EngineThread, *, max_batch: int) -> ThreadedEngine:
        """A port with a core of its own over ``engine``, which ``thread`` loaded; not warmed
        up."""
        core = EngineCore(engine, max_batch=max_batch)
        return cls(thread, core, EngineStarted.of(core))

    @classmethod
    async def load(cls, thread: EngineThread, recipe: CoreRecipe) -> ThreadedEngine:
        """Boot ``recipe``'s core on ``thread`` (``boot_core``: load, plan the memory budget,
        warm up). If cancelled, the boot still completes on the thread, unused."""
        core, started = await thread.run(boot_core, recipe)
        return cls(thread, core, started)


@asynccontextmanager
async def open_thread_transport(
    recipe: CoreRecipe,
) -> AsyncIterator[tuple[ThreadTransport, EngineStarted]]:
    """An engine thread of its own with ``recipe``'s core booted on it, and the transport to
    that core; a supervisor starts one of these for each engine it runs. On exit the thread is
    stopped, or left behind if its transport was killed (wedged)."""
    with EngineThread() as thread:
        try:
            core, started = await thread.run(boot_core, recipe)
            yield ThreadTransport(thread, core), started
        finally:
            # Closed off the event loop (it waits for the thread's last job); a killed
            # transport abandoned its thread already, and closing it then does nothing.
            with trio.CancelScope(shield=True):
                await trio.to_thread.run_sync(thread.close)
