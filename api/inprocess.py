"""The in-process API: ``open_runtime`` and channel handles.

    async with open_runtime(max_batch=8) as rt:                  # the embedded default model
        handle = await rt.submit(GenerationRequest("Hello"))
        async for event in handle:                               # TextDelta / Progress, then
            ...                                                  # one outcome
        outcome = await handle.result()

A request without ``params`` samples with the model's defaults (``rt.sampling_defaults``: its
``generation_config.json``, then OpenAI's values); ``rt.sampling_defaults.params(seed=1)``
builds params over them. ``submit`` raises ``InvalidRequestError`` for a bad request and
``OverloadedError`` when admission is full, before anything is admitted. ``collect`` returns
the whole text and the outcome; ``submit_with_callback`` calls a function for every event.

A program that serves from here for long should call :func:`freeze_startup_heap` once the
runtime is up, as ``mlx-trio serve`` does.
"""

from __future__ import annotations

import gc
import inspect
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from dataclasses import dataclass, replace
from functools import partial
from typing import Literal

import trio

from ..actors.config import RuntimeConfig, RuntimeStatistics
from ..actors.event_queue import EventQueue
from ..actors.messages import (
    CancelReason,
    Completed,
    Event,
    GenerationRequest,
    Outcome,
    TextDelta,
)
from ..actors.port import EnginePort
from ..actors.runtime import Runtime, open_runtime_actors
from ..actors.session import Session
from ..engine.budget import MemoryLimit, default_limit
from ..engine.rank_group import RankGroup
from ..engine.reply import ReplySyntax
from ..engine.sampling_defaults import SamplingDefaults

logger = logging.getLogger(__name__)


class SessionHandle:
    """One request's events (``async for``), outcome and cancellation.

    Iterating yields every event, ending with the outcome; a reader that leaves the outcome
    untaken for a second (its buffer full) is not sent it, and its iteration just ends, while
    ``result()`` still returns it. Closing the handle (``aclose``, or leaving ``async with``)
    before the outcome cancels the request ``consumer_closed``.

    The events have one reader, the task that reads first (it may leave an ``async for`` and
    read on later): another task's read raises ``SecondReaderError``. Each event's ``seq`` is
    its place (0, 1, 2, ...): no gap, nothing lost. Events wait for the reader up to
    ``event_buffer`` events and ``event_buffer_tokens`` tokens; beyond, the request waits too.
    """

    def __init__(self, session: Session, events: EventQueue) -> None:
        self._session = session
        self._events = events

    @property
    def id(self) -> str:
        return self._session.id

    @property
    def state(self) -> str:
        return self._session.state

    @property
    def prompt_tokens(self) -> tuple[int, ...]:
        """The prompt as the model reads it (the chat template applied)."""
        return self._session.request.prompt_tokens

    def __aiter__(self) -> AsyncIterator[Event]:
        return self._events.__aiter__()

    async def receive(self) -> Event:
        """The next event; ``trio.EndOfChannel`` after the last, ``SecondReaderError`` if
        another task reads the events. If cancelled, no event was taken."""
        return await self._events.receive()

    async def result(self) -> Outcome:
        """Wait for the outcome (reading no events: a slow reader may cause ``consumer_idle``)."""
        await self._session.done.wait()
        assert self._session.outcome is not None
        return self._session.outcome

    def cancel_nowait(self, reason: CancelReason = "requested") -> None:
        """Cancel the request without waiting for its outcome."""
        self._session.cancel(reason)

    async def cancel(self, reason: CancelReason = "requested") -> Outcome:
        """Cancel the request and wait for its outcome (already final: returned as is)."""
        self._session.cancel(reason)
        return await self.result()

    async def aclose(self) -> None:
        """Stop reading (any task may): a request without its outcome yet ends cancelled
        ``consumer_closed``. Cancelled, the handle is closed all the same."""
        await self._events.aclose()

    async def __aenter__(self) -> SessionHandle:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()


@dataclass(frozen=True, slots=True)
class Collected:
    text: str
    token_ids: tuple[int, ...]
    outcome: Outcome

    @property
    def finish_reason(self) -> str | None:
        return self.outcome.finish_reason if isinstance(self.outcome, Completed) else None


class RuntimeHandle:
    """What ``open_runtime`` yields."""

    def __init__(self, runtime: Runtime) -> None:
        self._runtime = runtime

    @property
    def model_id(self) -> str:
        return self._runtime.engine.model_id

    @property
    def sampling_defaults(self) -> SamplingDefaults:
        """What a request whose ``params`` is None gets, over OpenAI's values: the model's
        ``generation_config.json``."""
        return self._runtime.engine.sampling_defaults

    @property
    def config(self) -> RuntimeConfig:
        """The limits the runtime was opened with."""
        return self._runtime.config

    def token_text(self, token_id: int) -> str:
        """One token id's text, as the model's tokenizer decodes it alone."""
        return self._runtime.engine.token_text(token_id)

    def reply_syntax(self) -> ReplySyntax:
        """How the model's chat replies split into content, reasoning and tool calls:
        ``reply_syntax().splitter(handle.prompt_tokens, tools, choice)`` reads one."""
        return self._runtime.engine.reply_syntax()

    async def shutdown(self, grace_s: float | None = None) -> None:
        """Drain: admission closes, requests in flight get ``grace_s`` (the config's grace if
        None) to finish, the rest end cancelled ``shutdown``. Returns once every session
        ended; the ``open_runtime`` block then exits as usual."""
        await self._runtime.shutdown(grace_s)

    @property
    def runtime(self) -> Runtime:
        """The runtime's actors, for benchmarks that time its parts; callers of the API need
        none of it."""
        return self._runtime

    async def submit(self, request: GenerationRequest | str) -> SessionHandle:
        """Admit a request and start it; see the module docstring for what it raises."""
        if isinstance(request, str):
            request = GenerationRequest(request)
        session, events = await self._runtime.submit(request)
        return SessionHandle(session, events)

    async def submit_all(self, requests: list[GenerationRequest]) -> list[SessionHandle]:
        """Admit several requests together or not at all; raises as ``submit`` does, and then
        none of them was admitted or started."""
        started = await self._runtime.submit_all(requests)
        return [SessionHandle(session, events) for session, events in started]

    async def collect(self, request: GenerationRequest | str) -> Collected:
        """Run a request to its end; return its whole text, tokens and outcome."""
        handle = await self.submit(request)
        texts: list[str] = []
        tokens: list[int] = []
        async with handle:
            async for event in handle:
                if isinstance(event, TextDelta):
                    texts.append(event.text)
                    tokens.extend(event.token_ids)
        return Collected("".join(texts), tuple(tokens), await handle.result())

    async def submit_with_callback(
        self,
        request: GenerationRequest | str,
        on_event: Callable[[Event], Awaitable[bool | None] | bool | None],
        nursery: trio.Nursery,
    ) -> SessionHandle:
        """Admit a request and call ``on_event`` for each event from a task in ``nursery``.

        ``on_event`` (a function or a coroutine function) returning ``False`` stops the
        request: it ends cancelled ``requested`` and ``on_event`` is called no more. Raises as
        ``submit`` does; if cancelled before it returns, nothing is left admitted, and a
        cancelled ``nursery`` ends the request ``consumer_closed``.
        """
        handle = await self.submit(request)

        async def pump() -> None:
            async with handle:
                async for event in handle:
                    returned = on_event(event)
                    if inspect.isawaitable(returned):
                        returned = await returned
                    if returned is False:
                        handle.cancel_nowait("requested")
                        return

        nursery.start_soon(pump)
        return handle

    def cancel(self, request_id: str, reason: CancelReason = "requested") -> bool:
        """Cancel a live request by id; False if there is none."""
        session = self._runtime.session(request_id)
        if session is None:
            return False
        session.cancel(reason)
        return True

    def statistics(self) -> RuntimeStatistics:
        return self._runtime.statistics()

    async def run_exclusive(self, fn: Callable[[], Awaitable[object]]) -> object:
        return await self._runtime.run_exclusive(fn)

    async def run_when_idle(self, fn: Callable[[], Awaitable[object]]) -> object:
        return await self._runtime.run_when_idle(fn)


@asynccontextmanager
async def open_runtime(
    model: str | None = None,
    *,
    engine: EnginePort | None = None,
    device: Literal["auto", "cpu", "gpu"] = "auto",
    prompt_cache_bytes: int | None = None,
    memory_limit: str | int | float | MemoryLimit | None = None,
    engine_process: bool | None = None,
    config: RuntimeConfig | None = None,
    ranks: RankGroup | None = None,
    **config_fields: object,
) -> AsyncIterator[RuntimeHandle]:
    """Start a runtime on ``model`` (None: the embedded default) or on a given ``engine``.

    ``prompt_cache_bytes``: the prompt cache's budget (None: an eighth of memory, at most
    8 GiB; 0: off). ``memory_limit``: the memory budget (``"6GB"``, ``"512MiB"``, bytes, or a
    share of the device's memory such as ``0.3``; None: 0.9 of a GPU's, 0.5 of the CPU's):
    MLX's limits are set to it, and admission counts each request's projected KV bytes
    against what the weights and activations leave of it (design/015); a given ``engine``
    has its own. ``engine_process``: run the model in a child process of its own instead of
    on a thread beside the event loop; None picks the process on a GPU, where the two threads'
    shared GIL costs the most (design/009). Either runs under a supervisor that restarts it if
    it dies or wedges (``max_engine_restarts`` in a crash loop, then gives up; design/016).
    ``ranks``: run the engine over a group of ranks that ``mlx.launch`` starts, the model split
    over them (``RankGroup(3, "tensor")``; design/020); the prompt cache is off there.
    Keyword arguments are :class:`RuntimeConfig` fields (``max_batch=8``, ...).
    On exit, admission closes and in-flight requests get ``shutdown_grace_s`` to finish.
    """
    config = replace(config or RuntimeConfig(), **config_fields)  # type: ignore[arg-type]
    if engine is not None:
        async with open_runtime_actors(engine, config) as runtime:
            yield RuntimeHandle(runtime)
        return

    async with (
        open_supervised_port(
            model, device, prompt_cache_bytes, engine_process, config, memory_limit, ranks
        ) as port,
        open_runtime_actors(port, config) as runtime,
    ):
        yield RuntimeHandle(runtime)


def open_supervised_port(
    model: str | None,
    device: str,
    prompt_cache_bytes: int | None,
    engine_process: bool | None,
    config: RuntimeConfig,
    memory_limit: str | int | float | MemoryLimit | None = None,
    ranks: RankGroup | None = None,
) -> AbstractAsyncContextManager[EnginePort]:
    """The engine on a thread or in a process, under a supervisor that restarts it when it
    dies or wedges (``actors/engine_port/supervisor.py``)."""
    from ..actors.engine_port.port import CorePort, Transport
    from ..actors.engine_port.process import open_process_transport
    from ..actors.engine_port.supervisor import RestartPolicy, open_supervised_engine
    from ..actors.engine_port.thread import open_thread_transport
    from ..engine.batch import DEFAULT_PREFILL_CHUNK
    from ..engine.calls import EngineStarted
    from ..engine.generate import Engine, RequestPreparer
    from ..engine.loader import load_tokenizer_only, runs_on_gpu

    on_gpu = runs_on_gpu(device)
    if engine_process is None:
        engine_process = on_gpu
    if ranks is not None:
        # Each rank's prompt cache would decide hits on its own; the ranks must not differ.
        engine_process, prompt_cache_bytes = True, 0
    limit = _memory_limit(memory_limit, on_gpu=on_gpu)
    policy = RestartPolicy(
        max_restarts=config.max_engine_restarts, step_timeout_s=config.step_timeout_s
    )
    chunk = DEFAULT_PREFILL_CHUNK
    preparer: RequestPreparer | None = None
    load_options = {
        "device": device,
        "prompt_cache_bytes": prompt_cache_bytes,
        "max_preparation_tokens": config.max_preparation_tokens,
        "max_iteration_tokens": config.max_iteration_tokens,
        "memory_limit": limit,
    }

    @asynccontextmanager
    async def start() -> AsyncIterator[tuple[Transport, EngineStarted]]:
        nonlocal preparer
        if engine_process:
            if preparer is None:  # the tokenizer stays here, for every engine the child runs
                loaded = await trio.to_thread.run_sync(load_tokenizer_only, model)
                preparer = RequestPreparer(loaded.tokenizer, loaded.context_length)
            build = partial(Engine.load, model, **load_options)
            async with open_process_transport(
                build, max_batch=config.max_batch, prefill_chunk=chunk, ranks=ranks
            ) as (transport, reply):
                assert reply.value is not None
                yield transport, reply.value
        else:
            async with open_thread_transport(
                model, max_batch=config.max_batch, prefill_chunk=chunk, **load_options
            ) as (transport, started):
                if preparer is None:
                    preparer = transport.core.engine.preparer
                yield transport, started

    def make_port(transport: Transport, started: EngineStarted) -> CorePort:
        return CorePort(
            transport, started, preparer, max_batch=config.max_batch, prefill_chunk=chunk
        )

    return open_supervised_engine(start, make_port, policy)


def _memory_limit(given: str | int | float | MemoryLimit | None, *, on_gpu: bool) -> MemoryLimit:
    """``given`` parsed (raises ``InvalidRequestError``), or the device's default."""
    if given is None:
        return default_limit(on_gpu)
    return given if isinstance(given, MemoryLimit) else MemoryLimit.parse(given)


def freeze_startup_heap() -> int:
    """Collect garbage once, then move every object alive now out of the garbage collector's
    reach (``gc.freeze``); returns how many. Call it once the model is loaded and the runtime
    started: those objects live as long as the process, and a full collection walks them all
    while holding the GIL, so every stream waits (serving 192 requests of the default model on
    a 2-core machine, one full collection took 87 ms; with the startup heap frozen, 12 ms).
    Objects freed by reference counting still are; only a reference cycle among the frozen
    ones would never be collected. vLLM's server does the same after its warm-up."""
    start = time.perf_counter()
    gc.collect()
    collected_s = time.perf_counter() - start
    gc.freeze()
    frozen = gc.get_freeze_count()
    logger.info(
        "startup heap: %d objects moved out of the garbage collector's way "
        "(a full collection took %.0f ms)",
        frozen,
        collected_s * 1e3,
    )
    return frozen
