"""The one way a real engine is opened: :func:`open_engine` takes the engine's options and the
runtime's limits and returns its port, under a supervisor. ``serve``, ``generate``, the
in-process API, the chaos harness and the benchmarks all open their engine here.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack, asynccontextmanager
from dataclasses import replace

import trio

from ...engine import torchless
from ...engine.calls import EngineStarted
from ...engine.devices import runs_on_gpu
from ...engine.model.loader import load_tokenizer_only
from ...engine.model.model_store import resolve_model
from ...engine.options import CoreRecipe, EngineOptions
from ...engine.preparer import RequestPreparer
from ...engine.primers import KernelPrimers
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


@asynccontextmanager
async def open_engine(
    options: EngineOptions, config: RuntimeConfig, *, primers: KernelPrimers | None = None
) -> AsyncIterator[CorePort]:
    """The engine ``options`` describe, booted (loaded, its memory budget planned, warmed up)
    for a batch of ``config.max_batch`` rows (None: the device's default), on a thread or in a
    process, under a supervisor that restarts it when it dies or wedges
    (``config.max_engine_restarts`` in a crash loop, then it gives up; design/016). Entering
    raises what loading the model raises. On exit the engine is stopped (a process asked to
    end, then killed if it does not).

    The model is resolved (downloaded or imported if need be) first; then, on a GPU, kernel
    primers compile the warm-up's kernels (``engine/primers.py``; ``primers``: started already,
    by a caller that could start them sooner) while an engine process starts and the tokenizer
    loads here beside it."""
    options = placed(options)
    config = config.on_device(gpu=runs_on_gpu(options.device))
    resolved = await trio.to_thread.run_sync(resolve_model, options.model)
    with ExitStack() as stack:
        if primers is None:
            primers = stack.enter_context(
                KernelPrimers.started(options, resolved.path, max_batch=config.max_batch)
            )
        recipe = CoreRecipe(
            options.loader(),
            max_batch=config.max_batch,
            warm_up=options.warm_up,
            kernels=primers.done if primers is not None and options.warm_up else None,
            keep_torch_out=torchless.wanted(resolved.path),
        )
        policy = RestartPolicy(
            max_restarts=config.max_engine_restarts, step_timeout_s=config.step_timeout_s
        )
        preparer: RequestPreparer | None = None

        @asynccontextmanager
        async def start() -> AsyncIterator[tuple[Transport, EngineStarted]]:
            nonlocal preparer
            if options.engine_process:
                # The tokenizer stays here, for every engine the child runs: loaded on a thread
                # of its own while the first child starts.
                tokenizer = None
                if preparer is None:
                    loader = ThreadPoolExecutor(1, thread_name_prefix="mlx-trio-tokenizer")
                    tokenizer = loader.submit(load_tokenizer_only, options.model)
                    loader.shutdown(wait=False)
                async with open_process_transport(recipe, ranks=options.ranks) as (
                    transport,
                    reply,
                ):
                    if tokenizer is not None:
                        loaded = await trio.to_thread.run_sync(tokenizer.result)
                        preparer = RequestPreparer(
                            loaded.tokenizer,
                            loaded.context_length,
                            loaded.processor,
                            has_draft_model=options.draft_model is not None,
                        )
                    assert reply.value is not None
                    yield transport, reply.value
            else:
                async with open_thread_transport(recipe) as (transport, started):
                    if preparer is None:
                        preparer = transport.core.engine.preparer
                    yield transport, started

        def make_port(transport: Transport, started: EngineStarted) -> CorePort:
            return CorePort(transport, started, preparer, retry_after_s=config.retry_after_s)

        async with open_supervised_engine(start, make_port, policy) as port:
            yield port
