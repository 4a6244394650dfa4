"""The engine in a process of its own: the port's transport to an engine core in a child.

The engine thread (``ThreadedEngine``) shares the GIL with the event loop, so whatever Python
the loop runs (sessions, channels, HTTP) is taken out of the engine's steps. On a GPU a decode
step is mostly host work, and the loop's share showed (design/008, design/009).
:class:`ProcessEngine` runs the engine's :class:`EngineCore` in a child process started with
``spawn`` instead (its main loop: ``engine/child.py``); the parent keeps only the tokenizer, so
``prepare`` never waits on the child.

The two talk over a socket pair, one reply for each call, in order: pickled calls
(``engine/calls.py``) one way, pickled :class:`Reply` objects the other, framed as
``multiprocessing.connection`` frames them, so the child uses a plain ``Connection`` while
:class:`ProcessTransport` reads the same frames from a ``trio.SocketStream``. If the child
dies, every call waiting on it and every call after raises :class:`EngineProcessError`.
"""

from __future__ import annotations

import logging
import multiprocessing
import pickle
import socket
import struct
from collections import deque
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager, suppress
from typing import Any, Protocol, TypeVar, cast

import trio

from ...engine import spawn
from ...engine.calls import Call, EngineCall, EngineStarted, EngineState, Reply
from ...engine.child import serve_pickled_engine
from ...engine.errors import EngineProcessError
from ...engine.options import CoreRecipe
from ...engine.preparer import RequestPreparer
from ...engine.ranks.rank_group import RankGroup
from .port import CallClock, CorePort
from .ranks import open_rank_group

__all__ = [
    "EngineProcessError",
    "ProcessEngine",
    "ProcessTransport",
    "open_process_engine",
    "open_process_transport",
]

logger = logging.getLogger(__name__)

_SIZE = struct.Struct("!i")  # multiprocessing.connection's frame header
_LONG_SIZE = struct.Struct("!Q")  # after a size of -1, for frames over 2 GiB
CLOSE_TIMEOUT_S = 30.0

R = TypeVar("R")


class EngineProcess(Protocol):
    """What the transport asks of the process its engine runs in."""

    @property
    def pid(self) -> int | None: ...

    @property
    def exitcode(self) -> int | None: ...

    def is_alive(self) -> bool: ...

    def kill(self) -> None: ...

    def join(self, timeout: float | None = None) -> None: ...


class _Pending:
    """A call waiting for its reply, or for the error that there will be none."""

    __slots__ = ("done", "error", "reply")

    def __init__(self) -> None:
        self.done = trio.Event()
        self.reply: Reply[Any] | None = None
        self.error: EngineProcessError | None = None


class ProcessTransport:
    """Calls to an :class:`EngineCore` in a child process over a socket; use
    :func:`open_process_engine`, which runs :meth:`read_replies` beside it."""

    def __init__(self, stream: trio.SocketStream, process: EngineProcess):
        """``process``: the child (a ``multiprocessing`` process, or a launched rank group,
        which answers the same)."""
        self._stream = stream
        self.process = process
        self._pending: deque[_Pending] = deque()
        self._buffer = bytearray()  # bytes received from the child, not yet a whole message
        self._send_lock = trio.Lock()
        self._failure: str | None = None  # why the child is gone, once it is
        self._closed = False
        self.state = EngineState()  # as of the child's last reply
        self.clock = CallClock()

    @property
    def pid(self) -> int | None:
        return self.process.pid

    def death(self) -> str | None:
        if self._failure is not None:
            return self._failure
        if not self._closed and not self.process.is_alive():
            return f"the engine process exited (exit code {self.process.exitcode})"
        return None

    def kill(self) -> None:
        """Kill the child (SIGKILL); the reader then fails every call waiting on it."""
        if self.process.is_alive():
            logger.error("killing the engine process %s", self.process.pid)
            self.process.kill()

    async def call(self, call: Call[R]) -> Reply[R]:
        """Send ``call`` to the child and wait for its reply; raises
        :class:`EngineProcessError` if the child is gone. If cancelled, the call still runs in
        the child and its reply is dropped."""
        pending = _Pending()
        await self._send(cast(EngineCall, call), pending)
        await pending.done.wait()
        if pending.error is not None:
            raise pending.error
        assert pending.reply is not None
        return pending.reply

    async def _send(self, call: EngineCall | None, pending: _Pending | None) -> None:
        if self._failure is not None:
            raise EngineProcessError(self._failure)
        if self._closed and call is not None:
            raise EngineProcessError("the engine process is closed")
        frame = _frame(pickle.dumps(call, protocol=pickle.HIGHEST_PROTOCOL))
        async with self._send_lock:
            if pending is not None:
                self._pending.append(pending)
                assert call is not None
                self.clock.sent(call)
            # A frame sent in part would garble every later one.
            with trio.CancelScope(shield=True):
                try:
                    await self._stream.send_all(frame)
                except (trio.BrokenResourceError, trio.ClosedResourceError) as exc:
                    # The same failure whether this or the reader sees the child gone first.
                    code = await self._exit_code()
                    self._fail(f"the engine process exited (exit code {code})")
                    raise EngineProcessError(self._failure) from exc

    async def _receive(self) -> Reply[Any] | None:
        """The child's next reply, or None once it closed the socket (by exiting)."""
        while (payload := take_frame(self._buffer)) is None:
            data = await self._stream.receive_some(1 << 20)
            if not data:
                return None
            self._buffer += data
        return pickle.loads(payload)

    async def started(self) -> Reply[EngineStarted]:
        """Wait for the child's first reply: started, or why it could not (then raised).
        If cancelled, the child may still be starting."""
        reply = await self._receive()
        if reply is None:
            code = await self._exit_code()
            raise EngineProcessError(f"the engine process exited while starting (exit code {code})")
        reply.unwrap()
        self.state = reply.state
        return reply

    async def read_replies(self) -> None:
        """Hand each reply to the call that waits for it, until the child ends; then fail what
        waits. If cancelled, the calls waiting keep waiting."""
        try:
            while (reply := await self._receive()) is not None:
                self.state = reply.state
                self.clock.answered()
                pending = self._pending.popleft()
                pending.reply = reply
                pending.done.set()
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass
        finally:
            # The child ended. Whatever waits fails.
            if not self._closed or self._pending:
                code = await self._exit_code()
                self._fail(f"the engine process exited (exit code {code})")

    async def _exit_code(self) -> int | None:
        with trio.CancelScope(shield=True):
            await trio.to_thread.run_sync(self.process.join, 1.0)
        return self.process.exitcode

    def _fail(self, message: str) -> None:
        """From now on every call raises ``message``; the calls waiting raise it now."""
        self.clock.clear()
        if self._failure is None:
            self._failure = message
            if not self._closed:
                logger.error("%s", message)
        while self._pending:
            pending = self._pending.popleft()
            pending.error = EngineProcessError(self._failure)
            pending.done.set()

    async def aclose(self) -> None:
        """Ask the child to end, wait for it (at most ``CLOSE_TIMEOUT_S``, then kill it).
        Shielded: once called, it finishes."""
        if self._closed:
            return
        self._closed = True
        with trio.CancelScope(shield=True):
            with suppress(EngineProcessError):
                await self._send(None, None)
            await trio.to_thread.run_sync(self.process.join, CLOSE_TIMEOUT_S)
            if self.process.is_alive():
                logger.warning("the engine process did not end in time; killing it")
                self.process.kill()
                await trio.to_thread.run_sync(self.process.join)
            await self._stream.aclose()


class ProcessEngine(CorePort):
    """The ``EnginePort`` over an :class:`EngineCore` in a child process; use
    :func:`open_process_engine`."""

    def __init__(
        self,
        transport: ProcessTransport,
        started: Reply[EngineStarted],
        preparer: RequestPreparer | None,
    ) -> None:
        """``started``: the child's first reply."""
        assert started.value is not None
        super().__init__(transport, started.value, preparer)
        self._process = transport.process

    @property
    def pid(self) -> int | None:
        return self._process.pid

    @property
    def exitcode(self) -> int | None:
        """The engine process's exit code; None while it runs."""
        return self._process.exitcode


@asynccontextmanager
async def open_process_engine(
    recipe: CoreRecipe, preparer: RequestPreparer | None
) -> AsyncIterator[ProcessEngine]:
    """Start a child that boots ``recipe``'s core (``boot_core``; its ``build`` must pickle:
    it runs there) and serves it; yield its port once it is ready. ``preparer``: the tokenizer
    side of ``prepare`` (None: ``prepare`` raises; a caller that tokenizes itself). Raises the
    child's own error if booting fails, :class:`EngineProcessError` if the child dies. On exit,
    cancelled or not, the child is asked to end, and killed if it does not."""
    async with open_process_transport(recipe) as (transport, started):
        yield ProcessEngine(transport, started, preparer)


@asynccontextmanager
async def open_process_transport(
    recipe: CoreRecipe, *, ranks: RankGroup | None = None
) -> AsyncIterator[tuple[ProcessTransport, Reply[EngineStarted]]]:
    """The child of :func:`open_process_engine` and the transport to it, with its first reply;
    a supervisor starts one of these for each engine it runs. ``ranks``: the engine runs over
    a group of ranks that ``mlx.launch`` starts instead (``actors/engine_port/ranks.py``)."""
    if ranks is not None:
        async with (
            open_rank_group(recipe, ranks) as (stream, group),
            _serving(ProcessTransport(stream, group), group) as served,
        ):
            yield served
        return
    context = multiprocessing.get_context("spawn")
    ours, theirs = context.Pipe(duplex=True)  # a socket pair on POSIX
    process = context.Process(
        target=serve_pickled_engine,
        args=(theirs, pickle.dumps(recipe), logging.getLogger().level),
        kwargs={"keep_torch_out": recipe.keep_torch_out},
        name="mlx-trio-engine",
        daemon=True,
    )
    await trio.to_thread.run_sync(spawn.start, process)
    theirs.close()
    sock = trio.socket.fromfd(ours.fileno(), socket.AF_UNIX, socket.SOCK_STREAM)
    ours.close()
    async with _serving(ProcessTransport(trio.SocketStream(sock), process), process) as served:
        yield served


@asynccontextmanager
async def _serving(
    transport: ProcessTransport, process: EngineProcess
) -> AsyncIterator[tuple[ProcessTransport, Reply[EngineStarted]]]:
    """``transport`` once its engine answered it started, reading its replies meanwhile;
    on exit the engine is asked to end, and ``process`` killed if it is still there."""
    try:
        started = await transport.started()
        assert started.value is not None
        logger.info("engine process %d serving %s", process.pid, started.value.model_id)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(transport.read_replies)
            try:
                yield transport, started
            finally:
                await transport.aclose()
                nursery.cancel_scope.cancel()
    finally:
        if process.is_alive():  # failed before it was ready, or cancelled meanwhile
            process.kill()
            await trio.to_thread.run_sync(process.join)


def _frame(payload: bytes) -> bytes:
    if len(payload) > 0x7FFFFFFF:
        return _SIZE.pack(-1) + _LONG_SIZE.pack(len(payload)) + payload
    return _SIZE.pack(len(payload)) + payload


def take_frame(buffer: bytearray) -> bytes | None:
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
