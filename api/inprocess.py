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

LoRA adapters: ``open_runtime(adapters={"tuned": "path/to/adapter"})`` serves each beside the
model; ``GenerationRequest(..., adapter="tuned")`` runs with one (``rt.adapters`` lists them).
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from contextlib import asynccontextmanager, nullcontext
from dataclasses import dataclass, replace
from dataclasses import fields as fields_of
from pathlib import Path

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
from ..engine.budget import MemoryLimit
from ..engine.heap import freeze_heap
from ..engine.options import AdapterSpec, EngineOptions
from ..engine.outputs import AdapterInfo
from ..engine.vocabulary.prompt import Prompt
from ..engine.vocabulary.reply import ReplySyntax
from ..engine.vocabulary.sampling_defaults import SamplingDefaults

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
    def adapters(self) -> tuple[AdapterInfo, ...]:
        """The LoRA adapters served beside the model: a request names one as its
        ``adapter``."""
        return self._runtime.engine.adapters

    @property
    def kv_scheme(self) -> str:
        """How rows keep their keys and values: quantized (``kv_bits``) or not."""
        return self._runtime.engine.kv_scheme

    @property
    def weights(self) -> str:
        """The weights' form as the engine runs them (dequantized at load on CUDA, say)."""
        return self._runtime.engine.weights

    @property
    def sampling_defaults(self) -> SamplingDefaults:
        """What a request whose ``params`` is None gets, over OpenAI's values: the model's
        ``generation_config.json``."""
        return self._runtime.engine.sampling_defaults

    @property
    def config(self) -> RuntimeConfig:
        """The limits the runtime was opened with."""
        return self._runtime.config

    async def tokenize(self, prompt: Prompt) -> list[int]:
        """The prompt's token ids, as a request's would be, whatever its length (for counting:
        ``context_length`` says what fits); ``InvalidRequestError`` for a malformed prompt."""
        return await self._runtime.engine.tokenize(prompt)

    def detokenize(self, token_ids: Sequence[int]) -> str:
        """The text of token ids together; ``InvalidRequestError`` for an id outside the
        vocabulary."""
        return self._runtime.engine.detokenize(token_ids)

    @property
    def context_length(self) -> int:
        """The most tokens a prompt and its reply may hold together."""
        return self._runtime.engine.context_length

    def token_text(self, token_id: int) -> str:
        """One token id's text, as the model's tokenizer decodes it alone."""
        return self._runtime.engine.token_text(token_id)

    @property
    def takes_images(self) -> bool:
        """Whether requests may carry images (a vision model's, design/031)."""
        return self._runtime.engine.takes_images

    def reply_syntax(self) -> ReplySyntax:
        """How the model's chat replies split into content, reasoning and tool calls:
        ``reply_syntax().splitter(handle.prompt_tokens, tools, choice)`` reads one."""
        return self._runtime.engine.reply_syntax()

    async def shutdown(self, grace_s: float | None = None) -> None:
        """Drain: admission closes, requests in flight get ``grace_s`` (the config's grace if
        None) to finish, the rest end cancelled ``shutdown``. Returns once every session
        ended, or at the latest ``shutdown_settle_s`` after the grace; the ``open_runtime``
        block then exits as usual."""
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
    model: str | EngineOptions | None = None,
    *,
    engine: EnginePort | None = None,
    config: RuntimeConfig | None = None,
    **fields: object,
) -> AsyncIterator[RuntimeHandle]:
    """Start a runtime on ``model`` (a model directory, GGUF file or Hugging Face id; None:
    the embedded default; or whole :class:`EngineOptions`) or on a given ``engine``.

    Keyword arguments are :class:`EngineOptions` fields (``device="cpu"``,
    ``prompt_cache_bytes=0``, ``memory_limit="6GB"`` or a share such as ``0.3``,
    ``engine_process=True``, ``ranks=RankGroup(3, "tensor")``, ...) and :class:`RuntimeConfig`
    fields (``max_batch=8``, ...): the engine is opened by ``open_engine``, on a thread or in a
    process, under a supervisor that restarts it if it dies or wedges (design/016); a given
    ``engine`` takes none of the engine's options. On exit, admission closes and in-flight
    requests get ``shutdown_grace_s`` to finish. Raises ``TypeError`` for a keyword that is
    neither's, ``InvalidRequestError`` for a memory limit that does not parse.
    """
    options, config = runtime_options(model, config, fields)
    if engine is not None:
        async with open_runtime_actors(engine, config) as runtime:
            yield RuntimeHandle(runtime)
        return
    # A model directory here: its kernel primers (``engine/primers.py``) start now, before the
    # engine's modules are imported here (seconds on a cold host), not after.
    from ..engine.devices import runs_on_gpu
    from ..engine.primers import KernelPrimers, local_model_dir

    config = config.on_device(gpu=runs_on_gpu(options.device))
    local = local_model_dir(options.model)
    with (
        nullcontext()
        if local is None
        else KernelPrimers.started(options, local, max_batch=config.max_batch)
    ) as primers:
        from ..actors.engine_port.open import open_engine

        async with (
            open_engine(options, config, primers=primers) as port,
            open_runtime_actors(port, config) as runtime,
        ):
            yield RuntimeHandle(runtime)


_ENGINE_FIELDS = frozenset(f.name for f in fields_of(EngineOptions))
_RUNTIME_FIELDS = frozenset(f.name for f in fields_of(RuntimeConfig))


def runtime_options(
    model: str | EngineOptions | None, config: RuntimeConfig | None, given: dict[str, object]
) -> tuple[EngineOptions, RuntimeConfig]:
    """``open_runtime``'s arguments sorted into the engine's options and the runtime's."""
    options = model if isinstance(model, EngineOptions) else EngineOptions(model=model)
    unknown = set(given) - _ENGINE_FIELDS - _RUNTIME_FIELDS
    if unknown:
        raise TypeError(
            f"open_runtime() got unknown keyword arguments: {', '.join(sorted(unknown))}"
        )
    engine_fields = {k: v for k, v in given.items() if k in _ENGINE_FIELDS}
    if isinstance(adapters := engine_fields.get("adapters"), Mapping):  # {name: directory}
        engine_fields["adapters"] = tuple(AdapterSpec(n, Path(p)) for n, p in adapters.items())
    if (limit := engine_fields.get("memory_limit")) is not None and not isinstance(
        limit, MemoryLimit
    ):
        engine_fields["memory_limit"] = MemoryLimit.parse(limit)  # type: ignore[arg-type]
    runtime_fields = {k: v for k, v in given.items() if k in _RUNTIME_FIELDS}
    return (
        replace(options, **engine_fields),  # type: ignore[arg-type]
        replace(config or RuntimeConfig(), **runtime_fields),  # type: ignore[arg-type]
    )


def freeze_startup_heap() -> int:
    """Move every object alive now out of the garbage collector's reach (``gc.freeze``, after
    a collection; ``engine/heap.py``); returns how many. Call it once the
    model is loaded and the runtime started: a full collection walks the startup heap while
    holding the GIL, so every stream waits (several times longer than with the startup heap
    frozen: design/024)."""
    return freeze_heap("startup heap")
