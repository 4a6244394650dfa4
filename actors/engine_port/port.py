"""The runtime's port to the real engine, written once over a transport seam.

:class:`CorePort` is the ``EnginePort`` the runtime drives: each engine call becomes one frozen
call (``engine/calls.py``) that a :class:`Transport` carries to the :class:`EngineCore` and
whose :class:`Reply` it brings back, with the core's state after it (KV bytes, rows, steps run,
the prompt cache's counters): the transport keeps the latest, which the port answers without a
call. ``prepare`` runs in a Trio worker thread on the tokenizer alone, so it never waits behind
a batch step.

Two transports: the engine thread (``thread.py``) and the engine process (``process.py``),
as httpx's transports stand behind one client.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any, Protocol, TypeVar

import trio

from ...engine.batch.caches import BatchMode
from ...engine.budget import MemoryBudget, MemoryUsage
from ...engine.calls import (
    BatchAdd,
    BatchPark,
    BatchRemove,
    BatchReset,
    BatchResume,
    BatchStep,
    Call,
    EngineStarted,
    EngineState,
    Reply,
    RunFunction,
    SerialStart,
    SerialStep,
    SerialStop,
)
from ...engine.errors import EngineError, EngineUnavailableError
from ...engine.outputs import AdapterInfo, PromptCacheStatistics, RowEvent
from ...engine.params import PreparedRequest, SamplingParams
from ...engine.preparer import RequestPreparer
from ...engine.vocabulary.prompt import Prompt
from ...engine.vocabulary.reply import ReplySyntax
from ...engine.vocabulary.sampling_defaults import SamplingDefaults
from ...engine.warmup import WarmupReport
from ..config import DEFAULT_RETRY_AFTER_S
from ..port import ALWAYS_UP, EngineLiveness

R = TypeVar("R")
T = TypeVar("T")


class Transport(Protocol):
    """Carries calls to one engine core, one at a time, in order."""

    @property
    def state(self) -> EngineState:
        """The core's state as of the last reply, one whose caller was cancelled included."""
        ...

    @property
    def clock(self) -> CallClock:
        """When the call the core is on began (its supervisor's watch for a wedged engine)."""
        ...

    @property
    def pid(self) -> int | None:
        """The engine process's id; None on a thread."""
        ...

    def death(self) -> str | None:
        """Why the core can no longer answer (its process or thread ended), or None while it
        can. Cheap: a supervisor polls it."""
        ...

    def kill(self) -> None:
        """End a wedged core now, without waiting for it: the process is killed, the thread
        abandoned. Calls waiting on it, and every later one, raise."""
        ...

    async def call(self, call: Call[R]) -> Reply[R]:
        """Run ``call`` on the core; its reply (an error the core raised is in it). Raises if
        the core cannot be reached. If cancelled, the call still runs to completion there
        (MLX work cannot be interrupted) and its reply is dropped."""
        ...

    async def aclose(self) -> None:
        """Stop the transport; later calls raise. If cancelled, it may not be stopped yet."""
        ...


class CallClock:
    """The calls sent to a core and not yet answered, and when the oldest began: a call
    that runs far past its allowance (``BatchStep(steps)``: ``steps`` step timeouts; any other
    call: one) means the engine is wedged. It counts calls whose caller was cancelled too,
    since the core still runs them. Thread-safe: the engine thread answers calls."""

    def __init__(self, now: Callable[[], float] = time.monotonic) -> None:
        """``now``: the clock (a test's fake transport passes Trio's)."""
        self._now = now
        self._lock = threading.Lock()
        self._allowances: deque[int] = deque()  # in step timeouts, oldest first
        self._oldest_since = 0.0  # when the oldest call began

    def sent(self, call: Call[Any]) -> None:
        steps = call.steps if isinstance(call, BatchStep) else 1
        with self._lock:
            if not self._allowances:
                self._oldest_since = self._now()
            self._allowances.append(max(1, steps))

    def answered(self) -> None:
        with self._lock:
            if self._allowances:
                self._allowances.popleft()
            self._oldest_since = self._now()  # the next call begins now

    def idle_s(self) -> float:
        """Seconds since the last call was answered, with none pending (0: one is)."""
        with self._lock:
            return 0.0 if self._allowances else self._now() - self._oldest_since

    def clear(self) -> None:
        """No call will be answered (the core is gone)."""
        with self._lock:
            self._allowances.clear()

    def overdue_s(self, step_timeout_s: float) -> float:
        """How far the oldest unanswered call is past its allowance (<= 0: it is not)."""
        with self._lock:
            if not self._allowances:
                return -step_timeout_s
            allowance = self._allowances[0] * step_timeout_s
            return self._now() - self._oldest_since - allowance


class CorePort:
    """An ``EnginePort`` over an :class:`EngineCore` that ``transport`` reaches.

    A supervisor (``supervisor.py``) may take the transport away when its core dies
    (:meth:`detach`: calls then raise ``EngineUnavailableError``) and give the port a new one
    (:meth:`attach`: the next generation).
    """

    def __init__(
        self,
        transport: Transport,
        started: EngineStarted,
        preparer: RequestPreparer | None,
        *,
        retry_after_s: float = DEFAULT_RETRY_AFTER_S,
    ) -> None:
        """``started``: what is known of the engine from the start; ``preparer``: the
        tokenizer side of ``prepare`` (None: ``prepare`` raises, for a caller that tokenizes
        itself). ``retry_after_s``: what a call refused while the engine restarts says to
        wait."""
        self._transport: Transport | None = transport
        self._liveness = ALWAYS_UP
        self.is_supervised = False  # set by a supervisor: a dead core is then replaced
        self._started = started
        self._preparer = preparer
        self._retry_after_s = retry_after_s

    # -- supervision ----------------------------------------------------------------------

    def liveness(self) -> EngineLiveness:
        return self._liveness

    def attach(
        self, transport: Transport, started: EngineStarted, liveness: EngineLiveness
    ) -> None:
        """Call ``transport`` from now on (a new engine, up)."""
        self._transport = transport
        self._started = started
        self._liveness = replace(liveness, pid=transport.pid)

    def detach(self, liveness: EngineLiveness) -> None:
        """Stop calling the transport (its engine died): calls raise until :meth:`attach`."""
        self._transport = None
        self._liveness = replace(liveness, pid=None)

    def _state(self) -> EngineState:
        return _NO_ENGINE if self._transport is None else self._transport.state

    # -- what the port answers without a call ---------------------------------------------

    @property
    def model_id(self) -> str:
        return self._started.model_id

    @property
    def sampling_defaults(self) -> SamplingDefaults:
        return self._started.sampling_defaults

    @property
    def adapters(self) -> tuple[AdapterInfo, ...]:
        return self._started.adapters

    @property
    def kv_scheme(self) -> str:
        """How rows keep their keys and values (quantized or in the model's dtype)."""
        return self._started.kv_scheme

    @property
    def weights(self) -> str:
        return self._started.weights

    @property
    def steps_apart(self) -> bool:
        return self._started.device == "gpu" and self._liveness.pid is not None

    @property
    def warmup(self) -> WarmupReport | None:
        """The warm-up's report, if the engine was warmed up."""
        return self._started.warmup

    @property
    def kv_bytes(self) -> int:
        return self._state().kv_bytes

    @property
    def memory_budget(self) -> MemoryBudget | None:
        return self._started.memory

    def memory_usage(self) -> MemoryUsage | None:
        return self._state().memory

    @property
    def num_rows(self) -> int:
        """Rows in the batch plus the serial run, as of the last engine call."""
        return self._state().num_rows

    @property
    def batch_steps_run(self) -> int:
        """Batch steps run (a call may stop short of those asked; steps ahead count)."""
        return self._state().batch_steps_run

    def prompt_cache_statistics(self) -> PromptCacheStatistics | None:
        return self._state().prompt_cache

    async def prepare(self, prompt: Prompt, params: SamplingParams) -> PreparedRequest:
        """Tokenize and check in a worker thread; if cancelled, nothing is left."""
        return await trio.to_thread.run_sync(self._the_preparer().prepare, prompt, params)

    async def tokenize(self, prompt: Prompt) -> list[int]:
        return await trio.to_thread.run_sync(self._the_preparer().tokenize, prompt)

    def detokenize(self, token_ids: Sequence[int]) -> str:
        return self._the_preparer().detokenize(token_ids)

    @property
    def context_length(self) -> int:
        return self._the_preparer().context_length

    def token_text(self, token_id: int) -> str:
        return self._the_preparer().token_text(token_id)

    def reply_syntax(self) -> ReplySyntax:
        return self._the_preparer().reply_syntax

    @property
    def takes_images(self) -> bool:
        return self._preparer is not None and self._preparer.processor is not None

    def _the_preparer(self) -> RequestPreparer:
        if self._preparer is None:
            raise EngineError("this engine port was started without a tokenizer")
        return self._preparer

    @property
    def batch_mode(self) -> BatchMode:
        return "serial" if self._started.unbatchable is not None else "batch"

    def unbatchable_reason(self, request: PreparedRequest) -> str | None:
        if request.images is not None:  # prefilled from its embeddings (design/031)
            return "images"
        return self._started.unbatchable

    def loop_cpu_s(self) -> float:
        # On the engine thread the loop's CPU holds the GIL the engine needs; in the engine
        # process it no longer does, but its time between calls still delays the next call:
        # the batch group weighs it the same way.
        return time.thread_time()

    # -- calls: if the caller is cancelled, the call still completes and its reply is dropped

    async def serial_start(self, request: PreparedRequest) -> None:
        await self._call(SerialStart(request))

    async def serial_step(self) -> list[RowEvent]:
        return await self._call(SerialStep())

    async def serial_stop(self) -> None:
        await self._call(SerialStop())

    async def batch_add(self, requests: Sequence[PreparedRequest]) -> list[int | Exception]:
        return await self._call(BatchAdd(tuple(requests)))

    async def batch_step(self, steps: int = 1, ahead: int = 0) -> list[RowEvent]:
        return await self._call(BatchStep(steps, ahead))

    async def batch_remove(self, rows: list[int]) -> None:
        await self._call(BatchRemove(tuple(rows)))

    async def batch_park(self, row: int) -> bool:
        return await self._call(BatchPark(row))

    async def batch_resume(self, row: int) -> None:
        await self._call(BatchResume(row))

    async def batch_reset(self) -> None:
        await self._call(BatchReset())

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        """Run ``fn(*args)`` where the core runs, between calls (on the engine process, ``fn``
        and ``args`` must pickle; the benchmarks settle MLX this way)."""
        return await self._call(RunFunction(fn, args))

    async def _call(self, call: Call[R]) -> R:
        if (transport := self._transport) is None:
            live = self._liveness
            raise EngineUnavailableError(
                f"the engine is {live.condition} ({live.last_cause})",
                retry_after_s=self._retry_after_s if live.condition == "restarting" else None,
            )
        try:
            reply = await transport.call(call)
        except Exception:
            # The core is gone: say so now, not at the supervisor's next look, so that no lane
            # sends it another call meanwhile (rows waiting to join then wait for the next).
            if self._transport is transport and (death := transport.death()) is not None:
                live = self._liveness
                condition = "restarting" if self.is_supervised else "down"
                self.detach(EngineLiveness(condition, live.generation, live.restarts, death))
            raise
        return reply.unwrap()


_NO_ENGINE = EngineState()
