"""The engine's state between calls, driven one call at a time from a single thread.

:class:`EngineCore` holds what the runtime's engine port changes: the batch (a
:class:`BatchEngine`) and the serial run (a :class:`Generation`). Every method is synchronous
and must be called from the one thread that owns MLX: the engine thread (``ThreadedEngine``)
or the engine process's main thread (``ProcessEngine``), each applying the port's calls
(``engine/calls.py``). That thread calls :func:`clear_thread_streams` before it ends.

Under a memory budget (the engine's ``memory_limit``) the core plans it for its batch's shape,
sets it in MLX, and keeps the prompt cache within what the KV pool has left beside its rows
(design/015-memory-budget.md). After its rows leave, when it is left with none or at most every
``TRIM_EVERY_S``, it gives the C allocator's free pages back (:meth:`EngineCore.tidy`).
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence

from .batch.batch import DEFAULT_PREFILL_CHUNK, PREFILL_BATCH, BatchEngine
from .budget import MemoryBudget, MemoryUsage
from .generate import Engine
from .generation import Generation
from .memory import apply_budget, memory_usage, plan_budget, trim_allocator
from .outputs import Delta, PromptCacheStatistics, RowEvent, RowOutput, RowProgress
from .params import PreparedRequest
from .ranks.distributed import AHEAD, STOP
from .threads import ThreadChooser, shape
from .vocabulary.sampling import repair_random_state

SERIAL_ROW = 0
# While rows come and go without the engine ever going idle, free pages are given back this
# often (a trim's cost is a fraction of a percent of the engine's time: design/024).
TRIM_EVERY_S = 10.0


class EngineCore:
    """The batch and the serial run of one :class:`Engine`; see ``EnginePort`` for each call."""

    def __init__(
        self, engine: Engine, *, max_batch: int, prefill_chunk: int = DEFAULT_PREFILL_CHUNK
    ) -> None:
        self.engine = engine
        self.max_batch = max_batch
        self.prefill_chunk = prefill_chunk
        self._batch: BatchEngine | None = None
        self._serial: Iterator[Delta] | None = None
        self._serial_generation: Generation | None = None
        self._serial_progress: list[RowProgress] = []
        self._serial_request: PreparedRequest | None = None
        # KV bytes of the batch as of its last call: read from other threads, which must not
        # see a step ahead half done.
        self.kv_bytes = 0
        self.batch_steps_run = 0  # batch steps run (a call may stop short of those asked)
        self._steps_counted = 0  # the current batch's steps_run, as of its last call
        self._rows_seen = 0  # rows held after the last call, to see rows leave
        self._rows_left = False  # rows left since the last trim
        self._trimmed_at = time.monotonic()
        self.memory = plan_memory(engine, max_batch=max_batch, prefill_chunk=prefill_chunk)
        if self.memory is not None:
            apply_budget(self.memory)
            if engine.prompt_cache is not None:
                engine.prompt_cache.bound_by(self._prompt_cache_room)
        # OpenBLAS's thread count, chosen per call from the calls' times (CPU only).
        self._threads = ThreadChooser.for_device(engine.loaded.device)
        self._serial_prefilled = False  # the serial run's first step (its prompt) is done

    @property
    def num_rows(self) -> int:
        """Rows in the batch plus the serial run."""
        batch = self._batch.num_rows if self._batch is not None else 0
        return batch + (self._serial is not None)

    def prompt_cache_statistics(self) -> PromptCacheStatistics | None:
        cache = self.engine.prompt_cache
        return cache.statistics() if cache is not None else None

    def memory_usage(self) -> MemoryUsage:
        """MLX's memory counts now."""
        return memory_usage()

    def tidy(self) -> None:
        """After each call: once rows have left, give the C allocator's free pages back, when
        no row is left or ``TRIM_EVERY_S`` after the last time (``trim_allocator``)."""
        rows = self.num_rows
        self._rows_left |= rows < self._rows_seen
        self._rows_seen = rows
        now = time.monotonic()
        if self._rows_left and (rows == 0 or now - self._trimmed_at >= TRIM_EVERY_S):
            trim_allocator()
            self._rows_left = False
            self._trimmed_at = now

    # -- the memory budget ------------------------------------------------------------------

    def projected_kv_bytes(self) -> int:
        """The KV the rows held here (batch and serial) can grow to, as admission projects it
        (0 without a budget)."""
        if self.memory is None:
            return 0
        sizes = self._batch.row_sizes() if self._batch is not None else []
        if self._serial_request is not None:
            request = self._serial_request
            sizes.append((len(request.prompt_tokens), request.params.max_tokens))
        return sum(self.memory.projected_bytes(p, m) for p, m in sizes)

    def _prompt_cache_room(self) -> int:
        """What the KV pool leaves the prompt cache: the pool less the rows' KV, projected or
        as it really is, whichever is more (a batch pads its rows to a common length)."""
        assert self.memory is not None
        actual = self._batch.kv_bytes if self._batch is not None else 0
        return self.memory.kv_pool - max(self.projected_kv_bytes(), actual)

    def _fit_prompt_cache(self) -> None:
        """Trim the prompt cache to the room the rows leave it (under a budget)."""
        if self.memory is not None and self.engine.prompt_cache is not None:
            self.engine.prompt_cache.fit()

    # -- serial -----------------------------------------------------------------------------

    def serial_start(self, request: PreparedRequest) -> None:
        def progress(done: int, total: int) -> None:
            self._serial_progress.append(RowProgress(SERIAL_ROW, done, total))

        generation = self.engine.generate(request, on_progress=progress)
        self._serial_generation = generation
        self._serial = iter(generation)
        self._serial_request = request
        self._serial_prefilled = False
        self._fit_prompt_cache()

    def serial_step(self) -> list[RowEvent]:
        assert self._serial is not None and self._serial_generation is not None
        if self._threads is not None:
            self._threads.begin(shape("decode" if self._serial_prefilled else "prefill", 1))
        # A prompt with images prefills a chunk a call, its progress alone (design/031).
        delta = None if self._serial_generation.prefill_step() else next(self._serial)
        self._serial_prefilled = delta is not None
        if self._threads is not None:
            self._threads.end(1)
        events: list[RowEvent] = list(self._serial_progress)
        self._serial_progress.clear()
        if delta is None:
            return events
        stats = self._serial_generation.stats() if delta.finish_reason else None
        events.append(RowOutput(SERIAL_ROW, delta, stats))
        if stats is not None:
            self.serial_stop()
        return events

    def serial_stop(self) -> None:
        # The run's KV goes to the prompt cache as it closes: it no longer counts as a row's.
        self._serial_request = None
        if self._serial is not None:
            self._serial.close()  # type: ignore[attr-defined]
        self._serial = None
        self._serial_generation = None
        self._serial_progress.clear()

    # -- batch ------------------------------------------------------------------------------

    def batch_reset(self) -> None:
        """Drop every row and start a fresh batch, with whatever shared state a failed step
        may have broken (MLX's global random state) repaired."""
        repair_random_state()
        if self._batch is not None:
            self._batch.close()
        self._batch = BatchEngine(
            self.engine,
            max_batch=self.max_batch,
            prefill_chunk=self.prefill_chunk,
            budget=self.engine.token_budget,
        )
        self.kv_bytes = 0
        self._steps_counted = 0

    def step_ahead(self) -> bool:
        """Idle work, a piece a call (``BatchEngine.step_ahead``: ended rows' KV to the prompt
        cache, or a step of the next batch call); whether it did any. A step is timed for
        the thread count as a call's steps are (a small batch's steps mostly run ahead of
        their calls)."""
        batch = self._batch
        if batch is None or not batch.may_step_ahead():
            return False
        self.lead(AHEAD)  # the other ranks step ahead too
        if self._threads is None:
            return batch.step_ahead()
        before = batch.steps_run
        self._threads.begin(batch.shape())
        worked = batch.step_ahead()
        self._threads.end(batch.steps_run - before)
        return worked

    def _the_batch(self) -> BatchEngine:
        if self._batch is None:
            self.batch_reset()
        assert self._batch is not None
        return self._batch

    def batch_add(self, requests: Sequence[PreparedRequest]) -> list[int | Exception]:
        batch = self._the_batch()
        rows: list[int | Exception] = []
        for request in requests:
            try:
                rows.append(batch.add(request))
            except Exception as exc:  # a failed add changes nothing: only this row fails
                rows.append(exc)
        self._fit_prompt_cache()  # before the new rows' prefill allocates their KV
        self.kv_bytes = batch.kv_bytes
        return rows

    def batch_step(self, steps: int = 1, ahead: int = 0) -> list[RowEvent]:
        batch = self._the_batch()
        if self._threads is None:
            events = batch.step(steps, ahead)
        else:
            before = batch.steps_run
            self._threads.begin(batch.shape())
            events = batch.step(steps, ahead)
            self._threads.end(batch.steps_run - before)
        # Steps run ahead of the call count as its own.
        self.batch_steps_run += batch.steps_run - self._steps_counted
        self._steps_counted = batch.steps_run
        self._fit_prompt_cache()  # the batch's KV grew
        self.kv_bytes = batch.kv_bytes
        return events

    def batch_remove(self, rows: list[int]) -> None:
        batch = self._the_batch()
        batch.remove(rows)
        self.kv_bytes = batch.kv_bytes

    def batch_park(self, row: int) -> bool:
        batch = self._the_batch()
        if not batch.can_park(row):
            return False
        batch.park(row)
        self.kv_bytes = batch.kv_bytes
        return True

    def batch_resume(self, row: int) -> None:
        batch = self._the_batch()
        batch.resume(row)
        self.kv_bytes = batch.kv_bytes

    def close(self) -> None:
        self.serial_stop()
        if self._batch is not None:
            self._batch.close()
            self._batch = None
        if self._threads is not None:
            self._threads.close()
        self.lead(STOP)

    def lead(self, message: object) -> None:
        """Over several ranks, on rank 0: send ``message`` (a call, ``AHEAD`` or ``STOP``) to
        the other ranks, which do the same (``engine/ranks/distributed.py``); else nothing."""
        lockstep = self.engine.lockstep
        if lockstep is not None and lockstep.is_leader:
            lockstep.send(message)


def plan_memory(
    engine: Engine, *, max_batch: int, prefill_chunk: int = DEFAULT_PREFILL_CHUNK
) -> MemoryBudget | None:
    """The memory budget of ``engine``'s ``memory_limit`` for a batch of ``max_batch`` rows
    (None without a limit); raises ``InvalidRequestError`` if the limit is too small."""
    if engine.memory_limit is None or engine.model_memory is None:
        return None
    rows, chunk = PREFILL_BATCH, prefill_chunk
    if (tokens := engine.token_budget) is not None:
        # Beside decoding rows a step's prompt tokens stay within the iteration budget; with
        # none decoding, every prepared prompt takes a whole chunk (the preparation budget
        # bounds them). The attention scores grow with the chunk: the worst step is the
        # largest chunks that fill the larger of the two.
        chunk = tokens.max_chunk
        per_step = max(tokens.max_iteration_tokens, tokens.max_preparation_tokens)
        rows = max(1, min(max_batch, per_step // chunk))
    return plan_budget(
        engine.model_memory,
        engine.memory_limit,
        on_gpu=engine.loaded.device == "gpu",
        max_batch=max_batch,
        prefill_batch=rows,
        prefill_chunk=chunk,
        serial_prefill_chunk=engine.prefill_step_size,
    )


def clear_thread_streams() -> None:
    """Destroy the MLX streams this thread created; the thread that owned a core calls it
    before it ends.

    MLX 0.32 leaves that to each thread (mlx-lm's generation stream is thread-local); left to the
    interpreter's exit, it can abort the process after all the work is done ("terminate called
    without an active exception", seen once in this project's README example test).
    """
    import mlx.core as mx

    mx.clear_streams()
