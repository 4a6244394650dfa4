"""The real engine behind the runtime's ``EnginePort``: every MLX call on the engine thread.

Tokenization (``prepare``) runs in a Trio worker thread instead, so it never waits behind a
batch step; it touches only the tokenizer, not MLX.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

import trio

from mlx_trio.engine.batch import DEFAULT_PREFILL_CHUNK
from mlx_trio.engine.core import EngineCore
from mlx_trio.engine.generate import Engine
from mlx_trio.engine.outputs import PromptCacheStatistics, RowEvent
from mlx_trio.engine.params import PreparedRequest, SamplingParams
from mlx_trio.engine.prompt import Prompt
from mlx_trio.engine.sampling_defaults import SamplingDefaults
from mlx_trio.engine.thread import EngineThread
from mlx_trio.engine.warmup import warm_up

logger = logging.getLogger(__name__)


class ThreadedEngine:
    """An ``EnginePort`` over an :class:`Engine` owned by an :class:`EngineThread`: each call
    runs its :class:`EngineCore` method there."""

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
        self.core = EngineCore(engine, max_batch=max_batch, prefill_chunk=prefill_chunk)
        # Between calls the engine thread steps the batch ahead of its next call.
        thread.add_idle_work(self.core.step_ahead)

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
        await port.batch_reset()
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
    def sampling_defaults(self) -> SamplingDefaults:
        return self.engine.sampling_defaults

    @property
    def max_batch(self) -> int:
        return self.core.max_batch

    @property
    def prefill_chunk(self) -> int:
        return self.core.prefill_chunk

    @property
    def kv_bytes(self) -> int:
        return self.core.kv_bytes

    @property
    def num_rows(self) -> int:
        """Rows in the batch plus the serial run, as of the last engine call."""
        return self.core.num_rows

    @property
    def batch_steps_run(self) -> int:
        """Batch steps run (a call may stop short of those asked; steps ahead count)."""
        return self.core.batch_steps_run

    async def prepare(self, prompt: Prompt, params: SamplingParams) -> PreparedRequest:
        return await trio.to_thread.run_sync(self.engine.prepare, prompt, params)

    def prompt_cache_statistics(self) -> PromptCacheStatistics | None:
        return self.core.prompt_cache_statistics()

    def token_text(self, token_id: int) -> str:
        return self.engine.preparer.token_text(token_id)

    def unbatchable_reason(self, request: PreparedRequest) -> str | None:
        return None

    def loop_cpu_s(self) -> float:
        return time.thread_time()

    async def serial_start(self, request: PreparedRequest) -> None:
        await self.thread.run(self.core.serial_start, request)

    async def serial_step(self) -> list[RowEvent]:
        return await self.thread.run(self.core.serial_step)

    async def serial_stop(self) -> None:
        await self.thread.run(self.core.serial_stop)

    async def batch_add(self, requests: Sequence[PreparedRequest]) -> list[int | Exception]:
        return await self.thread.run(self.core.batch_add, requests)

    async def batch_step(self, steps: int = 1) -> list[RowEvent]:
        return await self.thread.run(self.core.batch_step, steps)

    async def batch_remove(self, rows: list[int]) -> None:
        await self.thread.run(self.core.batch_remove, rows)

    async def batch_park(self, row: int) -> bool:
        return await self.thread.run(self.core.batch_park, row)

    async def batch_resume(self, row: int) -> None:
        await self.thread.run(self.core.batch_resume, row)

    async def batch_reset(self) -> None:
        await self.thread.run(self.core.batch_reset)
