"""The real engine behind the runtime's ``EnginePort``: every MLX call on the engine thread.

Tokenization (``prepare``) runs in a Trio worker thread instead, so it never waits behind a
batch step; it touches only the tokenizer, not MLX.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator, Sequence
from typing import TypeVar

import trio

from mlx_trio.engine.batch import DEFAULT_PREFILL_CHUNK, BatchEngine
from mlx_trio.engine.generate import Engine
from mlx_trio.engine.outputs import (
    Delta,
    PromptCacheStatistics,
    RowEvent,
    RowOutput,
    RowProgress,
)
from mlx_trio.engine.params import PreparedRequest, SamplingParams
from mlx_trio.engine.prompt import Prompt
from mlx_trio.engine.thread import EngineThread
from mlx_trio.engine.warmup import warm_up

logger = logging.getLogger(__name__)

SERIAL_ROW = 0

T = TypeVar("T")


class ThreadedEngine:
    """An ``EnginePort`` over an :class:`Engine` owned by an :class:`EngineThread`."""

    def __init__(
        self,
        engine: Engine,
        thread: EngineThread,
        *,
        max_batch: int,
        prefill_chunk: int = DEFAULT_PREFILL_CHUNK,
    ) -> None:
        self.engine = engine
        self.thread = thread
        self.max_batch = max_batch
        self.prefill_chunk = prefill_chunk
        self._batch: BatchEngine | None = None
        self._serial: Iterator[Delta] | None = None
        self._serial_generation = None
        self._serial_progress: list[RowProgress] = []
        self._kv_bytes = 0
        self.batch_steps_run = 0  # batch steps run (a call may stop short of those asked)
        self._steps_counted = 0  # the current batch's steps_run, as of its last call
        # Between calls the engine thread steps the batch ahead of its next call.
        thread.add_idle_work(self._step_ahead)

    @classmethod
    async def load(
        cls,
        thread: EngineThread,
        spec: str | None,
        *,
        device: str,
        max_batch: int,
        prompt_cache_bytes: int | None = None,
    ) -> ThreadedEngine:
        """Load on the engine thread; ``prompt_cache_bytes`` None picks a default, 0 is off."""
        engine = await thread.run(
            lambda: Engine.load(spec, device=device, prompt_cache_bytes=prompt_cache_bytes)
        )
        port = cls(engine, thread, max_batch=max_batch)
        await thread.run(port._new_batch)
        # Compile the kernels of every shape the runtime will use before anyone calls it
        # healthy (GPU; returns at once on CPU).
        await thread.run(
            lambda: warm_up(engine, max_batch=max_batch, prefill_chunk=port.prefill_chunk)
        )
        return port

    @property
    def model_id(self) -> str:
        return self.engine.model_id

    @property
    def kv_bytes(self) -> int:
        return self._kv_bytes

    @property
    def num_rows(self) -> int:
        """Rows in the batch plus the serial run, as of the last engine call."""
        batch = self._batch.num_rows if self._batch is not None else 0
        return batch + (self._serial is not None)

    async def prepare(self, prompt: Prompt, params: SamplingParams) -> PreparedRequest:
        return await trio.to_thread.run_sync(self.engine.prepare, prompt, params)

    def prompt_cache_statistics(self) -> PromptCacheStatistics | None:
        cache = self.engine.prompt_cache
        return cache.statistics() if cache is not None else None

    def token_text(self, token_id: int) -> str:
        return self.engine.tokenizer.decode([token_id])

    def unbatchable_reason(self, request: PreparedRequest) -> str | None:
        return None

    def loop_cpu_s(self) -> float:
        return time.thread_time()

    # -- serial -----------------------------------------------------------------------------

    async def serial_start(self, request: PreparedRequest) -> None:
        await self.thread.run(self._serial_start, request)

    def _serial_start(self, request: PreparedRequest) -> None:
        def progress(done: int, total: int) -> None:
            self._serial_progress.append(RowProgress(SERIAL_ROW, done, total))

        generation = self.engine.generate(request, on_progress=progress)
        self._serial_generation = generation
        self._serial = iter(generation)

    async def serial_step(self) -> list[RowEvent]:
        return await self.thread.run(self._serial_step)

    def _serial_step(self) -> list[RowEvent]:
        assert self._serial is not None and self._serial_generation is not None
        delta = next(self._serial)
        events: list[RowEvent] = list(self._serial_progress)
        self._serial_progress.clear()
        stats = self._serial_generation.stats() if delta.finish_reason else None
        events.append(RowOutput(SERIAL_ROW, delta, stats))
        if stats is not None:
            self._serial_end()
        return events

    async def serial_stop(self) -> None:
        await self.thread.run(self._serial_end)

    def _serial_end(self) -> None:
        if self._serial is not None:
            self._serial.close()  # type: ignore[attr-defined]
        self._serial = None
        self._serial_generation = None
        self._serial_progress.clear()

    # -- batch ------------------------------------------------------------------------------

    def _new_batch(self) -> None:
        if self._batch is not None:
            self._batch.close()
        self._batch = BatchEngine(
            self.engine, max_batch=self.max_batch, prefill_chunk=self.prefill_chunk
        )
        self._kv_bytes = 0
        self._steps_counted = 0

    def _step_ahead(self) -> bool:
        """The engine thread's idle work: a step of the next batch call, if it may run one."""
        return self._batch is not None and self._batch.step_ahead()

    async def _batch_call(self, fn: Callable[[BatchEngine], T]) -> T:
        def call() -> T:
            assert self._batch is not None
            result = fn(self._batch)
            self._kv_bytes = self._batch.kv_bytes
            return result

        return await self.thread.run(call)

    async def batch_add(self, requests: Sequence[PreparedRequest]) -> list[int | Exception]:
        def add(batch: BatchEngine) -> list[int | Exception]:
            rows: list[int | Exception] = []
            for request in requests:
                try:
                    rows.append(batch.add(request))
                except Exception as exc:  # a failed add changes nothing: only this row fails
                    rows.append(exc)
            return rows

        return await self._batch_call(add)

    async def batch_step(self, steps: int = 1) -> list[RowEvent]:
        def step(batch: BatchEngine) -> list[RowEvent]:
            events = batch.step(steps)
            # Steps run ahead of the call count as its own.
            self.batch_steps_run += batch.steps_run - self._steps_counted
            self._steps_counted = batch.steps_run
            return events

        return await self._batch_call(step)

    async def batch_remove(self, rows: list[int]) -> None:
        await self._batch_call(lambda batch: batch.remove(rows))

    async def batch_park(self, row: int) -> bool:
        def park(batch: BatchEngine) -> bool:
            if not batch.can_park(row):
                return False
            batch.park(row)
            return True

        return await self._batch_call(park)

    async def batch_resume(self, row: int) -> None:
        await self._batch_call(lambda batch: batch.resume(row))

    async def batch_reset(self) -> None:
        await self.thread.run(self._new_batch)
