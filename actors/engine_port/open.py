"""The one way a real engine is opened: :func:`open_engine` takes the engine's options and the
runtime's limits and returns its port, under a supervisor. ``serve``, ``generate``, the
in-process API, the chaos harness and the benchmarks all open their engine here.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from dataclasses import replace

import trio

from ...engine.calls import EngineStarted
from ...engine.generate import RequestPreparer
from ...engine.model.loader import load_tokenizer_only, runs_on_gpu
from ...engine.options import CoreRecipe, EngineOptions
from ..config import RuntimeConfig
from .port import CorePort, Transport
from .process import open_process_transport
from .supervisor import RestartPolicy, open_supervised_engine
from .thread import open_thread_transport


def placed(options: EngineOptions) -> EngineOptions:
    """``options`` with where the engine runs decided: a process on a GPU where not given,
    always a process over ranks, and no prompt cache there (each rank's would decide hits on
    its own, and the ranks must not differ)."""
    if options.ranks is not None:
        return replace(options, engine_process=True, prompt_cache_bytes=0)
    if options.engine_process is None:
        return replace(options, engine_process=runs_on_gpu(options.device))
    return options


def open_engine(
    options: EngineOptions, config: RuntimeConfig
) -> AbstractAsyncContextManager[CorePort]:
    """The engine ``options`` describe, booted (loaded, its memory budget planned, warmed up)
    for a batch of ``config.max_batch`` rows, on a thread or in a process, under a supervisor
    that restarts it when it dies or wedges (``config.max_engine_restarts`` in a crash loop,
    then it gives up; design/016). Entering raises what loading the model raises. On exit the
    engine is stopped (a process asked to end, then killed if it does not)."""
    options = placed(options)
    recipe = CoreRecipe(options.loader(), max_batch=config.max_batch, warm_up=options.warm_up)
    policy = RestartPolicy(
        max_restarts=config.max_engine_restarts, step_timeout_s=config.step_timeout_s
    )
    preparer: RequestPreparer | None = None

    @asynccontextmanager
    async def start() -> AsyncIterator[tuple[Transport, EngineStarted]]:
        nonlocal preparer
        if options.engine_process:
            if preparer is None:  # the tokenizer stays here, for every engine the child runs
                loaded = await trio.to_thread.run_sync(load_tokenizer_only, options.model)
                preparer = RequestPreparer(loaded.tokenizer, loaded.context_length)
            async with open_process_transport(recipe, ranks=options.ranks) as (transport, reply):
                assert reply.value is not None
                yield transport, reply.value
        else:
            async with open_thread_transport(recipe) as (transport, started):
                if preparer is None:
                    preparer = transport.core.engine.preparer
                yield transport, started

    def make_port(transport: Transport, started: EngineStarted) -> CorePort:
        return CorePort(transport, started, preparer, retry_after_s=config.retry_after_s)

    return open_supervised_engine(start, make_port, policy)
