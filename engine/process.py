"""The engine in a process of its own: an ``EnginePort`` whose MLX work runs in a child.

The engine thread (``ThreadedEngine``) shares the GIL with the event loop, so whatever Python
the loop runs (sessions, channels, HTTP) is taken out of the engine's steps. On a GPU a decode
step is mostly host work (7 ms of CPU a step at 8 rows for the 1B-shaped benchmark model on
the H200's host), and the loop's share showed: the batch lane ran at 0.94-0.99x of raw mlx-lm
and HTTP at 0.74-0.89x from 32 streams up (design/008). :class:`ProcessEngine` runs the
engine's :class:`EngineCore` in a child process started with ``spawn`` instead; the parent keeps
only the tokenizer, so ``prepare`` never waits on the child.

The two talk over a socket pair, one reply for each request, in order: pickled
``(method, args)`` one way, ``(ok, value, state)`` the other, framed as
``multiprocessing.connection`` frames them, so the child uses a plain ``Connection``. ``state``
carries what the port answers without a call (KV bytes, rows, steps run, the prompt cache's
counters), as of that reply.

Between calls the child steps the batch ahead, as the engine thread does. The child ignores
SIGINT and SIGTERM: the parent decides when it ends (a ``None`` request, or the socket closing
when the parent dies). If the child dies, every call waiting on it and every call after raises
:class:`EngineProcessError`.
"""

from __future__ import annotations

import logging
import multiprocessing
import pickle
import signal
import socket
import struct
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager, suppress
from dataclasses import dataclass
from functools import partial
from multiprocessing.connection import Connection
from typing import Any, TypeVar

import outcome
import trio

from mlx_trio.engine.batch import DEFAULT_PREFILL_CHUNK
from mlx_trio.engine.core import EngineCore
from mlx_trio.engine.errors import MlxTrioError
from mlx_trio.engine.generate import Engine, RequestPreparer
from mlx_trio.engine.outputs import PromptCacheStatistics, RowEvent
from mlx_trio.engine.params import PreparedRequest, SamplingParams
from mlx_trio.engine.prompt import Prompt
from mlx_trio.engine.sampling_defaults import NO_DEFAULTS, SamplingDefaults
from mlx_trio.engine.warmup import WarmupReport

logger = logging.getLogger(__name__)

_SIZE = struct.Struct("!i")  # multiprocessing.connection's frame header
_LONG_SIZE = struct.Struct("!Q")  # after a size of -1, for frames over 2 GiB
CLOSE_TIMEOUT_S = 30.0
_RUN = "run"  # not a method of EngineCore: a function to run, with its arguments

T = TypeVar("T")


class EngineProcessError(MlxTrioError):
    """The engine process ended (it crashed, or was killed) or could not start."""


@dataclass(frozen=True, slots=True)
class _State:
    kv_bytes: int = 0
    num_rows: int = 0
    batch_steps_run: int = 0
    prompt_cache: PromptCacheStatistics | None = None


@dataclass(frozen=True, slots=True)
class _Started:  # the child's first message
    model_id: str
    warmup: WarmupReport | None
    sampling_defaults: SamplingDefaults


class _Reply:
    """A call's reply, once it comes: its outcome, as ``EngineThread.run`` delivers one."""

    __slots__ = ("done", "result")

    def __init__(self) -> None:
        self.done = trio.Event()
        self.result: outcome.Outcome | None = None

    def set(self, ok: bool, value: Any) -> None:
        self.result = outcome.Value(value) if ok else outcome.Error(value)
        self.done.set()


class ProcessEngine:
    """An ``EnginePort`` over an :class:`EngineCore` in a child process; use
    :func:`open_process_engine` or :meth:`load`."""

    def __init__(
        self,
        stream: trio.SocketStream,
        process: multiprocessing.process.BaseProcess,
        preparer: RequestPreparer | None,
        *,
        max_batch: int,
        prefill_chunk: int,
    ) -> None:
        self._stream = stream
        self._process = process
        self._preparer = preparer
        self.max_batch = max_batch
        self.prefill_chunk = prefill_chunk
        self._pending: deque[_Reply] = deque()
        self._buffer = bytearray()  # bytes received from the child, not yet a whole message
        self._send_lock = trio.Lock()
        self._state = _State()
        self._failure: str | None = None  # why the child is gone, once it is
        self._closed = False
        self._model_id = "?"
        self._sampling_defaults = NO_DEFAULTS
        self.warmup: WarmupReport | None = None

    @classmethod
    @asynccontextmanager
    async def load(
        cls,
        spec: str | None,
        *,
        device: str,
        max_batch: int,
        prompt_cache_bytes: int | None = None,
    ) -> AsyncIterator[ProcessEngine]:
        """Like ``ThreadedEngine.load``: the tokenizer here (resolving, and importing if need
        be, ``spec`` first), the model in the child, warmed up before this yields."""
        from mlx_trio.engine.loader import load_tokenizer_only

        loaded = await trio.to_thread.run_sync(load_tokenizer_only, spec)
        preparer = RequestPreparer(loaded.tokenizer, loaded.context_length)
        build = partial(Engine.load, spec, device=device, prompt_cache_bytes=prompt_cache_bytes)
        async with open_process_engine(build, preparer, max_batch=max_batch) as engine:
            yield engine

    # -- what the port answers without a call ---------------------------------------------

    @property
    def model_id(self) -> str:
        return self._model_id

    @property
    def sampling_defaults(self) -> SamplingDefaults:
        return self._sampling_defaults

    @property
    def kv_bytes(self) -> int:
        return self._state.kv_bytes

    @property
    def num_rows(self) -> int:
        """Rows in the batch plus the serial run, as of the last engine call."""
        return self._state.num_rows

    @property
    def batch_steps_run(self) -> int:
        return self._state.batch_steps_run

    @property
    def pid(self) -> int | None:
        return self._process.pid

    @property
    def exitcode(self) -> int | None:
        """The engine process's exit code; None while it runs."""
        return self._process.exitcode

    def prompt_cache_statistics(self) -> PromptCacheStatistics | None:
        return self._state.prompt_cache

    async def prepare(self, prompt: Prompt, params: SamplingParams) -> PreparedRequest:
        return await trio.to_thread.run_sync(self._the_preparer().prepare, prompt, params)

    def token_text(self, token_id: int) -> str:
        return self._the_preparer().token_text(token_id)

    def _the_preparer(self) -> RequestPreparer:
        if self._preparer is None:
            raise RuntimeError("this engine process was started without a tokenizer")
        return self._preparer

    def unbatchable_reason(self, request: PreparedRequest) -> str | None:
        return None

    def loop_cpu_s(self) -> float:
        # The loop no longer holds the engine's GIL, but its time between calls still delays
        # the next call: the batch group keeps weighing it the same way.
        return time.thread_time()

    # -- calls into the child -------------------------------------------------------------

    async def serial_start(self, request: PreparedRequest) -> None:
        await self._call("serial_start", request)

    async def serial_step(self) -> list[RowEvent]:
        return await self._call("serial_step")

    async def serial_stop(self) -> None:
        await self._call("serial_stop")

    async def batch_add(self, requests: Sequence[PreparedRequest]) -> list[int | Exception]:
        return await self._call("batch_add", list(requests))

    async def batch_step(self, steps: int = 1) -> list[RowEvent]:
        return await self._call("batch_step", steps)

    async def batch_remove(self, rows: list[int]) -> None:
        await self._call("batch_remove", rows)

    async def batch_park(self, row: int) -> bool:
        return await self._call("batch_park", row)

    async def batch_resume(self, row: int) -> None:
        await self._call("batch_resume", row)

    async def batch_reset(self) -> None:
        await self._call("batch_reset")

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        """Run ``fn(*args)`` in the engine process, between calls, as ``EngineThread.run`` does
        on the engine thread (``fn`` and ``args`` must pickle; the benchmarks settle MLX)."""
        return await self._call(_RUN, fn, *args)

    async def _call(self, method: str, *args: Any) -> Any:
        """Run ``method(*args)`` on the child's core; like ``EngineThread.run``, a cancelled
        caller does not stop the call, whose result is then dropped."""
        reply = _Reply()
        await self._send((method, args), reply)
        await reply.done.wait()
        assert reply.result is not None
        return reply.result.unwrap()

    async def _send(
        self, request: tuple[str, tuple[Any, ...]] | None, reply: _Reply | None
    ) -> None:
        if self._failure is not None:
            raise EngineProcessError(self._failure)
        if self._closed and request is not None:
            raise EngineProcessError("the engine process is closed")
        frame = _frame(pickle.dumps(request, protocol=pickle.HIGHEST_PROTOCOL))
        async with self._send_lock:
            if reply is not None:
                self._pending.append(reply)
            # A frame sent in part would garble every later one.
            with trio.CancelScope(shield=True):
                try:
                    await self._stream.send_all(frame)
                except (trio.BrokenResourceError, trio.ClosedResourceError) as exc:
                    self._fail(f"the engine process is gone ({type(exc).__name__})")
                    raise EngineProcessError(self._failure) from exc

    async def _receive(self) -> Any | None:
        """The child's next message, or None once it closed the socket (by exiting)."""
        while (payload := _take_frame(self._buffer)) is None:
            data = await self._stream.receive_some(1 << 20)
            if not data:
                return None
            self._buffer += data
        return pickle.loads(payload)

    async def _started(self) -> None:
        """Wait for the child's first message: started, or why it could not."""
        message = await self._receive()
        if message is None:
            code = await self._exit_code()
            raise EngineProcessError(f"the engine process exited while starting (exit code {code})")
        ok, value, self._state = message
        if not ok:
            raise value
        self._model_id = value.model_id
        self._sampling_defaults = value.sampling_defaults
        self.warmup = value.warmup

    async def _read_replies(self) -> None:
        try:
            while (message := await self._receive()) is not None:
                ok, value, self._state = message
                self._pending.popleft().set(ok, value)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass
        finally:
            # The child ended. Whatever waits fails.
            if not self._closed or self._pending:
                code = await self._exit_code()
                self._fail(f"the engine process exited (exit code {code})")

    async def _exit_code(self) -> int | None:
        with trio.CancelScope(shield=True):
            await trio.to_thread.run_sync(self._process.join, 1.0)
        return self._process.exitcode

    def _fail(self, message: str) -> None:
        """From now on every call raises ``message``; the calls waiting raise it now."""
        if self._failure is None:
            self._failure = message
            if not self._closed:
                logger.error("%s", message)
        while self._pending:
            self._pending.popleft().set(False, EngineProcessError(self._failure))

    async def aclose(self) -> None:
        """Ask the child to end, wait for it (at most ``CLOSE_TIMEOUT_S``, then kill it)."""
        if self._closed:
            return
        self._closed = True
        with trio.CancelScope(shield=True):
            with suppress(EngineProcessError):
                await self._send(None, None)
            await trio.to_thread.run_sync(self._process.join, CLOSE_TIMEOUT_S)
            if self._process.is_alive():
                logger.warning("the engine process did not end in time; killing it")
                self._process.kill()
                await trio.to_thread.run_sync(self._process.join)
            await self._stream.aclose()


@asynccontextmanager
async def open_process_engine(
    build: Callable[[], Engine],
    preparer: RequestPreparer | None,
    *,
    max_batch: int,
    prefill_chunk: int = DEFAULT_PREFILL_CHUNK,
    warm_up: bool = True,
) -> AsyncIterator[ProcessEngine]:
    """Start a child that calls ``build`` (picklable: it runs there) for its :class:`Engine`,
    warms it up (``warm_up``, as ``ThreadedEngine.load`` does) and serves an :class:`EngineCore`
    on it; yield its port once it is ready. ``preparer``: the tokenizer side of ``prepare``
    (None: ``prepare`` raises; a caller that tokenizes itself). Raises the child's own error if
    ``build`` fails, :class:`EngineProcessError` if the child dies."""
    context = multiprocessing.get_context("spawn")
    ours, theirs = context.Pipe(duplex=True)  # a socket pair on POSIX
    process = context.Process(
        target=serve_engine,
        args=(theirs, build, max_batch, prefill_chunk, warm_up, logging.getLogger().level),
        name="mlx-trio-engine",
        daemon=True,
    )
    await trio.to_thread.run_sync(process.start)
    theirs.close()
    sock = trio.socket.fromfd(ours.fileno(), socket.AF_UNIX, socket.SOCK_STREAM)
    ours.close()
    engine = ProcessEngine(
        trio.SocketStream(sock), process, preparer, max_batch=max_batch, prefill_chunk=prefill_chunk
    )
    try:
        await engine._started()
        logger.info("engine process %d serving %s", process.pid, engine.model_id)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(engine._read_replies)
            try:
                yield engine
            finally:
                await engine.aclose()
                nursery.cancel_scope.cancel()
    finally:
        if process.is_alive():  # failed before it was ready, or cancelled meanwhile
            process.kill()
            await trio.to_thread.run_sync(process.join)


# -- the child ------------------------------------------------------------------------------


def serve_engine(
    connection: Connection,
    build: Callable[[], Engine],
    max_batch: int,
    prefill_chunk: int,
    warm: bool,
    log_level: int,
) -> None:
    """The engine process's main: build, warm up, then serve requests until ``None`` or EOF."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(
        level=log_level, format="%(asctime)s %(levelname)s %(name)s (engine process): %(message)s"
    )
    from mlx_trio.engine.warmup import warm_up

    try:
        engine = build()
        core = EngineCore(engine, max_batch=max_batch, prefill_chunk=prefill_chunk)
        core.batch_reset()
        report = warm_up(engine, max_batch=max_batch, prefill_chunk=prefill_chunk) if warm else None
    except Exception as exc:
        logger.exception("the engine process could not start")
        _reply(connection, False, exc, _State())
        return
    started = _Started(engine.model_id, report, engine.sampling_defaults)
    _reply(connection, True, started, _state_of(core))
    try:
        while True:
            # While no request waits, step the batch ahead of its next call, a step at a time.
            while not connection.poll(0):
                try:
                    if not core.step_ahead():
                        break
                except Exception:
                    logger.exception("stepping ahead failed; the next call will see it")
                    break
            try:
                request = connection.recv()
            except EOFError:
                logger.info("the runtime went away; the engine process ends")
                return
            if request is None:
                return
            method, args = request
            fn = args[0] if method == _RUN else getattr(core, method)
            try:
                _reply(connection, True, fn(*args[method == _RUN :]), _state_of(core))
            except Exception as exc:
                _reply(connection, False, exc, _state_of(core))
    finally:
        core.close()
        import mlx.core as mx

        mx.clear_streams()


def _state_of(core: EngineCore) -> _State:
    return _State(
        core.kv_bytes, core.num_rows, core.batch_steps_run, core.prompt_cache_statistics()
    )


def _reply(connection: Connection, ok: bool, value: Any, state: _State) -> None:
    try:
        payload = pickle.dumps((ok, value, state), protocol=pickle.HIGHEST_PROTOCOL)
    except Exception as exc:  # an exception that does not pickle, say
        error = EngineProcessError(f"{type(value).__name__}: {value} (unpicklable: {exc})")
        payload = pickle.dumps((False, error, state), protocol=pickle.HIGHEST_PROTOCOL)
    connection.send_bytes(payload)


def _frame(payload: bytes) -> bytes:
    if len(payload) > 0x7FFFFFFF:
        return _SIZE.pack(-1) + _LONG_SIZE.pack(len(payload)) + payload
    return _SIZE.pack(len(payload)) + payload


def _take_frame(buffer: bytearray) -> bytes | None:
    """Cut the first whole frame's payload off ``buffer``; None while it is not all there."""
    if len(buffer) < _SIZE.size:
        return None
    (size,) = _SIZE.unpack_from(buffer)
    header = _SIZE.size
    if size == -1:
        if len(buffer) < header + _LONG_SIZE.size:
            return None
        (size,) = _LONG_SIZE.unpack_from(buffer, header)
        header += _LONG_SIZE.size
    if len(buffer) < header + size:
        return None
    payload = bytes(buffer[header : header + size])
    del buffer[: header + size]
    return payload
