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

import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol, TypeVar

import trio

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
from ...engine.generate import RequestPreparer
from ...engine.outputs import PromptCacheStatistics, RowEvent
from ...engine.params import PreparedRequest, SamplingParams
from ...engine.prompt import Prompt
from ...engine.sampling_defaults import SamplingDefaults
from ...engine.warmup import WarmupReport

R = TypeVar("R")
T = TypeVar("T")


class Transport(Protocol):
    """Carries calls to one engine core, one at a time, in order."""

    @property
    def state(self) -> EngineState:
        """The core's state as of the last reply, one whose caller was cancelled included."""
        ...

    async def call(self, call: Call[R]) -> Reply[R]:
        """Run ``call`` on the core; its reply (an error the core raised is in it). Raises if
        the core cannot be reached. If cancelled, the call still runs to completion there
        (MLX work cannot be interrupted) and its reply is dropped."""
        ...

    async def aclose(self) -> None:
        """Stop the transport; later calls raise. If cancelled, it may not be stopped yet."""
        ...


class CorePort:
    """An ``EnginePort`` over an :class:`EngineCore` that ``transport`` reaches."""

    def __init__(
        self,
        transport: Transport,
        started: EngineStarted,
        preparer: RequestPreparer | None,
        *,
        max_batch: int,
        prefill_chunk: int,
    ) -> None:
        """``started``: what is known of the engine from the start; ``preparer``: the
        tokenizer side of ``prepare`` (None: ``prepare`` raises, for a caller that tokenizes
        itself)."""
        self._transport = transport
        self._started = started
        self._preparer = preparer
        self.max_batch = max_batch
        self.prefill_chunk = prefill_chunk

    # -- what the port answers without a call ---------------------------------------------

    @property
    def model_id(self) -> str:
        return self._started.model_id

    @property
    def sampling_defaults(self) -> SamplingDefaults:
        return self._started.sampling_defaults

    @property
    def warmup(self) -> WarmupReport | None:
        """The warm-up's report, if the engine was warmed up."""
        return self._started.warmup

    @property
    def kv_bytes(self) -> int:
        return self._transport.state.kv_bytes

    @property
    def memory_budget(self) -> MemoryBudget | None:
        return self._started.memory

    def memory_usage(self) -> MemoryUsage | None:
        return self._transport.state.memory

    @property
    def num_rows(self) -> int:
        """Rows in the batch plus the serial run, as of the last engine call."""
        return self._transport.state.num_rows

    @property
    def batch_steps_run(self) -> int:
        """Batch steps run (a call may stop short of those asked; steps ahead count)."""
        return self._transport.state.batch_steps_run

    def prompt_cache_statistics(self) -> PromptCacheStatistics | None:
        return self._transport.state.prompt_cache

    async def prepare(self, prompt: Prompt, params: SamplingParams) -> PreparedRequest:
        """Tokenize and check in a worker thread; if cancelled, nothing is left."""
        return await trio.to_thread.run_sync(self._the_preparer().prepare, prompt, params)

    def token_text(self, token_id: int) -> str:
        return self._the_preparer().token_text(token_id)

    def _the_preparer(self) -> RequestPreparer:
        if self._preparer is None:
            raise RuntimeError("this engine port was started without a tokenizer")
        return self._preparer

    def unbatchable_reason(self, request: PreparedRequest) -> str | None:
        return None

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

    async def batch_step(self, steps: int = 1) -> list[RowEvent]:
        return await self._call(BatchStep(steps))

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
        return (await self._transport.call(call)).unwrap()
