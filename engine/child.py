"""The engine process's side: its main loop, synchronous, on the process's main thread.

The runtime's ``ProcessEngine`` (``mlx_trio.actors.engine_port.process``) starts a child with
``spawn`` that runs :func:`serve_pickled_engine`: torch kept out first where the model is a text
model (``engine/torchless.py``), then the recipe unpickled and :func:`serve_engine` run: boot its
core (``options.boot_core``), send :class:`EngineStarted`, then answer each call
(``engine/calls.py``) with a :class:`Reply`, one for each, in order, over a
``multiprocessing.connection.Connection``. Between calls it steps the batch ahead, as the engine
thread does.

The child ignores SIGINT and SIGTERM: the parent decides when it ends (a ``None`` call, or the
socket closing when the parent dies). A child that cannot build its engine sends the error back
and exits.
"""

from __future__ import annotations

import logging
import pickle
import signal
import time
from multiprocessing.connection import Connection
from typing import Any

from . import torchless
from .calls import EngineState, Reply, answer
from .errors import EngineProcessError
from .heap import freeze_heap
from .options import CoreRecipe, boot_core

logger = logging.getLogger(__name__)


def serve_pickled_engine(
    connection: Connection, recipe: bytes, log_level: int, *, keep_torch_out: bool
) -> None:
    """:func:`serve_engine` of a pickled ``recipe``: this module imports none of the engine's
    heavy modules (its core, mlx-lm), so where ``keep_torch_out`` they first see torch absent,
    and the recipe, whose model loader imports them, is unpickled only after."""
    if keep_torch_out:
        torchless.keep_out()
    serve_engine(connection, pickle.loads(recipe), log_level)


def serve_engine(
    connection: Connection,
    recipe: CoreRecipe,
    log_level: int,
    *,
    terminable: bool = False,
) -> None:
    """The engine process's main: boot ``recipe``'s core, then answer calls until ``None`` or
    EOF.

    Signals meant for the server do not end it (the runtime ends it, after draining);
    ``terminable`` keeps SIGTERM's default for rank 0 of a group, which ``mlx.launch`` ends
    with SIGTERM when another rank dies (ignoring it left the launcher waiting, and the group
    up, until the next request hung in a collective)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if not terminable:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(
        level=log_level, format="%(asctime)s %(levelname)s %(name)s (engine process): %(message)s"
    )
    try:
        core, started = boot_core(recipe)
    except Exception as exc:
        logger.exception("the engine process could not start")
        _send(connection, Reply(None, exc, EngineState()))
        return
    freeze_heap("the engine process's heap")
    _send(connection, Reply(started, None, EngineState.of(core)))
    # At debug level, each call's and each step run ahead's time (where a request's time goes).
    timed = logger.isEnabledFor(logging.DEBUG)
    try:
        while True:
            # While no call waits, step the batch ahead of its next call, a step at a time.
            while not connection.poll(0):
                began = time.perf_counter()
                try:
                    if not core.step_ahead():
                        break
                except Exception:
                    logger.exception("stepping ahead failed; the next call will see it")
                    break
                if timed:
                    logger.debug("a step ahead: %.2f ms", (time.perf_counter() - began) * 1e3)
            try:
                call = connection.recv()
            except EOFError:
                logger.info("the runtime went away; the engine process ends")
                return
            if call is None:
                return
            began = time.perf_counter()
            reply = answer(core, call)
            _send(connection, reply)
            if timed:
                elapsed = (time.perf_counter() - began) * 1e3
                logger.debug("%s: %.2f ms, answered", type(call).__name__, elapsed)
    finally:
        from .core import clear_thread_streams

        core.close()
        clear_thread_streams()


def _send(connection: Connection, reply: Reply[Any]) -> None:
    try:
        payload = pickle.dumps(reply, protocol=pickle.HIGHEST_PROTOCOL)
    except Exception as exc:  # an exception or a value that does not pickle, say
        value = reply.error if reply.error is not None else reply.value
        error = EngineProcessError(f"{type(value).__name__}: {value} (unpicklable: {exc})")
        payload = pickle.dumps(Reply(None, error, reply.state), protocol=pickle.HIGHEST_PROTOCOL)
    connection.send_bytes(payload)
