"""``mlx-trio serve``: Hypercorn's Trio worker serving the HTTP app over the runtime.

The server listens first and loads the model second, so ``/health`` answers 503 ("loading")
instead of refusing connections. SIGINT or SIGTERM (or ``shutdown``) closes admission, gives
in-flight requests the runtime's grace period, then stops the server. Once the model is
loaded, the startup heap is frozen out of the garbage collector's way (``freeze_startup_heap``).
"""

from __future__ import annotations

import logging
import os
import signal
from dataclasses import dataclass, field
from functools import partial

import trio
from hypercorn.config import Config as HypercornConfig
from hypercorn.trio import serve as hypercorn_serve

from ..actors.config import RuntimeConfig
from ..actors.port import EnginePort
from ..engine.errors import InvalidRequestError, MlxTrioError
from ..engine.options import EngineOptions
from ..engine.params import SamplingParams
from ..engine.vocabulary.sampling_defaults import describe
from .http import build_app
from .http_state import AppState, HttpSettings
from .inprocess import RuntimeHandle, freeze_startup_heap, open_runtime

logger = logging.getLogger("mlx_trio.server")


@dataclass(frozen=True, slots=True)
class ServeOptions:
    host: str = "127.0.0.1"
    port: int = 8000
    engine: EngineOptions = field(default_factory=EngineOptions)  # the model, where it runs
    runtime: RuntimeConfig = field(default_factory=RuntimeConfig)
    http: HttpSettings = field(default_factory=HttpSettings)
    keep_alive_timeout_s: float = 5.0
    # Hypercorn's read timeout covers the whole connection, response included: it would cut
    # every stream or generation longer than it. The body has its own deadline (HttpSettings).
    read_timeout_s: float | None = None
    handle_signals: bool = True


def serve_http11_only() -> None:
    """Hypercorn switches a cleartext connection to HTTP/2 on the HTTP/2 preface or on
    ``Upgrade: h2c``, with no setting to refuse it, and then never times the connection out
    while it is idle (its HTTP/2 side sends no idle event until a stream ends): an idle HTTP/2
    connection, or one that sent half a HEADERS frame, stayed open 150 s and more where
    HTTP/1.1 closes at 5 s. An OpenAI-style API needs no cleartext HTTP/2, so the check that
    switches is turned off: ``Upgrade: h2c`` is ignored (RFC 9110 lets a server), and the
    preface is a request HTTP/1.1 refuses. (TLS, where HTTP/2 comes by ALPN, is not served.)"""
    from hypercorn.protocol.h11 import H11Protocol

    if not hasattr(H11Protocol, "_check_protocol"):  # a Hypercorn that changed: say so
        logger.warning("could not turn off Hypercorn's switch to cleartext HTTP/2")
        return

    async def no_switch(self: H11Protocol, event: object) -> None:
        return None

    H11Protocol._check_protocol = no_switch  # type: ignore[method-assign]


def _hypercorn_config(options: ServeOptions) -> HypercornConfig:
    config = HypercornConfig()
    config.bind = [f"{options.host}:{options.port}"]
    config.keep_alive_timeout = options.keep_alive_timeout_s
    config.read_timeout = options.read_timeout_s
    config.h11_max_incomplete_size = 16 * 1024  # larger request heads get 431
    config.backlog = 1024
    config.accesslog = None
    config.errorlog = logging.getLogger("hypercorn.error")
    return config


async def serve(
    options: ServeOptions,
    *,
    engine: EnginePort | None = None,
    shutdown: trio.Event | None = None,
    state: AppState | None = None,
    task_status: trio.TaskStatus[str] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve until ``shutdown`` is set (or a signal); ``task_status`` gets the base URL.

    ``state``: the app's state (default: a new one on ``options.http``), for a caller that
    wants to reach the runtime it serves (``state.runtime``, set once the model is loaded).
    """
    shutdown = trio.Event() if shutdown is None else shutdown
    state = AppState(options.http) if state is None else state
    serve_http11_only()
    stopped = trio.Event()
    async with trio.open_nursery() as nursery:
        try:
            bound = await nursery.start(
                partial(
                    hypercorn_serve,
                    build_app(state),
                    _hypercorn_config(options),
                    shutdown_trigger=stopped.wait,
                )
            )
        except* OSError as failed:  # the port is taken, the address is not this machine's, ...
            exc = _first(failed)
            why = exc.strerror or str(exc) if isinstance(exc, OSError) else str(exc)
            raise MlxTrioError(
                f"cannot listen on {options.host}:{options.port}: {why}; "
                "choose another with --port (or --host)"
            ) from None
        url = bound[0].replace("0.0.0.0", "127.0.0.1")
        if options.handle_signals:
            await nursery.start(_stop_on_signal, shutdown, state)
        logger.info("listening on %s (loading the model)", url)
        task_status.started(url)
        try:
            async with open_runtime(options.engine, engine=engine, config=options.runtime) as rt:
                await _check_flags_against_the_model(rt, options)
                state.runtime = rt
                names = state.model_names(rt)
                state.model_id = names[0]
                freeze_startup_heap()
                served = f" as {', '.join(names)}" if names != (rt.model_id,) else ""
                logger.info(
                    "serving model '%s'%s (weights: %s) at %s", rt.model_id, served, rt.weights, url
                )
                logger.info("sampling defaults: %s", describe(state.sampling_layers(rt)))
                example = curl_example(url, names[0], bool(options.http.api_keys))
                logger.info("try: %s", example)
                await shutdown.wait()
                logger.info("shutting down: admission closed, finishing in-flight requests")
        finally:
            stopped.set()


async def _check_flags_against_the_model(rt: RuntimeHandle, options: ServeOptions) -> None:
    """The flags only the loaded model can check (``--top-k`` below its vocabulary): one
    line naming the flag, not a 400 on every request."""
    top_k = options.http.sampling.top_k
    if top_k is None:
        return
    try:
        await rt.runtime.engine.prepare("check", SamplingParams(max_tokens=1, top_k=top_k))
    except InvalidRequestError as exc:
        raise MlxTrioError(f"--top-k: {exc.message}") from None


def _first(group: BaseExceptionGroup) -> BaseException:
    """The first leaf of a (nested) exception group."""
    exc: BaseException = group
    while isinstance(exc, BaseExceptionGroup):
        exc = exc.exceptions[0]
    return exc


async def _stop_on_signal(
    shutdown: trio.Event,
    state: AppState,
    *,
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> None:
    """A signal drains the server; SIGHUP too (a closed terminal, a supervisor's reload). One
    that comes while the model loads ends the process at once: nothing is served yet, and the
    load (MLX's, on a thread) cannot be interrupted, so waiting for it ignored the signal for
    as long as the load took."""
    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM, signal.SIGHUP) as signals:
        task_status.started()
        async for signum in signals:
            if state.runtime is None:
                name = signal.Signals(signum).name
                logger.warning("%s while the model loads: stopping now", name)
                for handler in logging.getLogger().handlers:
                    handler.flush()
                os._exit(128 + signum)
            shutdown.set()
            return


def curl_example(url: str, model_id: str, needs_key: bool) -> str:
    auth = " -H 'Authorization: Bearer $MLX_TRIO_API_KEY'" if needs_key else ""
    body = (
        f'{{"model": "{model_id}", "messages": [{{"role": "user", '
        f'"content": "What is the capital of France?"}}], "max_tokens": 32, "temperature": 0}}'
    )
    return (
        f"curl -s {url}/v1/chat/completions -H 'Content-Type: application/json'{auth} -d '{body}'"
    )
