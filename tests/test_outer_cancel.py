"""A caller's cancel scope that expires around ``open_runtime`` while streams are open (a
timeout, Ctrl-C): every stream ends ``Cancelled(shutdown)``, nothing stays held, and the block
returns within the grace (issue 34: it hung in ``shutdown`` for good, or raised the
AssertionError "a session ends with its outcome").

On the scripted engine under the autojump clock (the cancel at many points of a stream's life,
and Ctrl-C), then on the tiny model: on an engine thread of the test's, and under the engine's
supervisor on a thread and in a process, as ``open_runtime`` runs a model (its supervisor runs
beside the runtime, inside the caller's scope).
"""

from __future__ import annotations

import contextlib
import math
import signal
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from dataclasses import dataclass, field

import pytest
import trio
import trio.testing

from mlx_trio.actors.engine_port.port import CorePort, Transport
from mlx_trio.actors.engine_port.process import open_process_transport
from mlx_trio.actors.engine_port.supervisor import RestartPolicy, open_supervised_engine
from mlx_trio.actors.engine_port.thread import EngineThread, ThreadedEngine, ThreadTransport
from mlx_trio.actors.messages import (
    Cancelled,
    Completed,
    Event,
    Failed,
    GenerationRequest,
    TextDelta,
)
from mlx_trio.actors.port import EnginePort
from mlx_trio.actors.testing.scripted import Script, ScriptedEngine
from mlx_trio.api.inprocess import RuntimeHandle, SessionHandle, open_runtime
from mlx_trio.engine.calls import EngineStarted
from mlx_trio.engine.core import EngineCore
from mlx_trio.engine.options import CoreRecipe
from mlx_trio.engine.params import SamplingParams
from tests.tiny import build_engine, make_preparer

GRACE_S = 2.0
NUM_STREAMS = 6
MAX_LIVE = 4  # the other two wait in the queue
OUTCOMES = (Completed, Cancelled, Failed)

OpenRuntime = Callable[[], AbstractAsyncContextManager[RuntimeHandle]]


@dataclass
class Streams:
    """What a run of :func:`expire_with_streams_open` saw."""

    handles: list[SessionHandle] = field(default_factory=list)
    read: list[list[Event]] = field(default_factory=list)  # each stream's events, as read
    reading_on: list[bool] = field(default_factory=list)  # its reader outlived the scope
    late_s: float = math.nan  # how long the block took past its deadline to return
    rt: RuntimeHandle | None = None


def mid_decode_and_queued(streams: Streams) -> bool:
    """The first ``MAX_LIVE`` streams have their first token, the others wait in the queue."""
    assert streams.rt is not None
    decoding = all(any(isinstance(e, TextDelta) for e in read) for read in streams.read[:MAX_LIVE])
    return decoding and streams.rt.statistics().queued_sessions == NUM_STREAMS - MAX_LIVE


async def expire_with_streams_open(
    open_rt: OpenRuntime,
    params: SamplingParams,
    *,
    expire_after_s: float | None = None,
) -> Streams:
    """Open ``NUM_STREAMS`` streams and read them; let a cancel scope around the runtime
    expire ``expire_after_s`` after it opened (None: once the first streams are mid-decode and
    the others queued). Every other stream's reader is inside that scope; the rest read on
    outside it, to the end of their stream."""
    streams = Streams()

    async def read(handle: SessionHandle, into: list[Event]) -> None:
        async for event in handle:
            into.append(event)

    async with trio.open_nursery() as outside:
        with trio.move_on_after(math.inf) as outer:
            if expire_after_s is not None:
                outer.deadline = trio.current_time() + expire_after_s
            async with open_rt() as rt, trio.open_nursery() as inside:
                streams.rt = rt
                for i in range(NUM_STREAMS):
                    handle = await rt.submit(GenerationRequest(f"prompt {i}", params))
                    streams.handles.append(handle)
                    streams.read.append([])
                    streams.reading_on.append(i % 2 == 1)
                    nursery = outside if i % 2 == 1 else inside
                    nursery.start_soon(read, handle, streams.read[-1])
                if expire_after_s is None:
                    while not mid_decode_and_queued(streams):
                        await trio.sleep(0.001)
                    outer.deadline = trio.current_time()  # it expires now
                await trio.sleep_forever()
        assert outer.cancelled_caught
        streams.late_s = trio.current_time() - outer.deadline
    return streams


async def check_every_stream_ended_cancelled_shutdown(streams: Streams) -> None:
    """One outcome each, ``Cancelled(shutdown)``; a reader still reading got it, last; no
    permit, queue place or row is left held."""
    assert len(streams.handles) == NUM_STREAMS
    for handle, read, reading_on in zip(
        streams.handles, streams.read, streams.reading_on, strict=True
    ):
        assert handle.state == "terminal"
        outcome = await handle.result()
        assert isinstance(outcome, Cancelled) and outcome.reason == "shutdown", outcome
        outcomes_read = [e for e in read if isinstance(e, OUTCOMES)]
        if reading_on:
            assert outcomes_read == [outcome] and read[-1] is outcome
        else:
            assert outcomes_read in ([], [outcome])
    assert streams.rt is not None
    stats = streams.rt.statistics()
    assert (stats.live_sessions, stats.queued_sessions, stats.active_rows) == (0, 0, 0)
    assert (stats.pending_rows, stats.parked_rows, stats.projected_kv_bytes) == (0, 0, 0)
    assert stats.cancelled["shutdown"] == NUM_STREAMS == sum(stats.cancelled.values())
    assert stats.completed == 0 and not any(stats.failed.values())


def scripted_runtime(engine: EnginePort) -> OpenRuntime:
    return lambda: open_runtime(
        engine=engine, shutdown_grace_s=GRACE_S, max_batch=4, max_live=MAX_LIVE
    )


LONG = SamplingParams(max_tokens=400, temperature=0)  # 4 s a stream, past the grace


# -- the scripted engine, under the autojump clock ------------------------------------------


@pytest.mark.parametrize("seed", range(12))
async def test_an_outer_cancel_at_any_point_ends_every_stream_and_returns(autojump_clock, seed):
    """The scope expires at a different point each time: in admission, the first prefill,
    mid-decode; the batch's steps of varied length."""
    engine = ScriptedEngine(Script(step_s=0.01 + seed * 0.003))
    with trio.fail_after(60):  # the hang: under the autojump clock, at once
        streams = await expire_with_streams_open(
            scripted_runtime(engine), LONG, expire_after_s=0.005 + seed * 0.017
        )
    assert streams.late_s <= GRACE_S  # the cancelled sessions end at once, well within it
    await check_every_stream_ended_cancelled_shutdown(streams)
    assert engine.num_rows == 0


async def test_a_scope_cancelled_before_the_runtime_opens_leaves_it_at_once(autojump_clock):
    """The actors start even so, the block's first checkpoint raises Cancelled, and the
    runtime shuts down (the shielded actors hung its start for good)."""
    engine = ScriptedEngine(Script(step_s=0.01))
    submitted: list[SessionHandle] = []
    with trio.fail_after(60), trio.CancelScope() as outer:
        outer.cancel()
        async with scripted_runtime(engine)() as rt:
            submitted.append(await rt.submit(GenerationRequest("never", LONG)))
    assert outer.cancelled_caught and submitted == []
    assert rt.statistics().live_sessions == 0 and rt.statistics().is_closed


@pytest.mark.parametrize("max_batch", [1, 4], ids=["serial lane", "batch lane"])
async def test_an_outer_cancel_mid_decode_with_streams_queued(autojump_clock, max_batch):
    engine = ScriptedEngine(Script(step_s=0.01))

    def open_rt() -> AbstractAsyncContextManager[RuntimeHandle]:
        return open_runtime(
            engine=engine, shutdown_grace_s=GRACE_S, max_batch=max_batch, max_live=MAX_LIVE
        )

    if max_batch == 1:  # one stream decodes at a time: the others wait for the lane
        with trio.fail_after(60):
            streams = await expire_with_streams_open(open_rt, LONG, expire_after_s=0.5)
    else:
        with trio.fail_after(60):
            streams = await expire_with_streams_open(open_rt, LONG)
    assert streams.late_s <= GRACE_S
    await check_every_stream_ended_cancelled_shutdown(streams)
    assert engine.num_rows == 0


def test_ctrl_c_with_streams_open_ends_every_stream_and_propagates():
    """Ctrl-C (SIGINT: Trio raises KeyboardInterrupt in the code it interrupts) in the block:
    the runtime shuts down (the streams get the grace, then end ``Cancelled(shutdown)``) and
    KeyboardInterrupt comes out of it."""
    engine = ScriptedEngine(Script(step_s=0.01))
    handles: list[SessionHandle] = []

    async def main() -> None:
        async with open_runtime(
            engine=engine, shutdown_grace_s=GRACE_S, max_batch=4, max_live=MAX_LIVE
        ) as rt:
            for i in range(NUM_STREAMS):
                handles.append(await rt.submit(GenerationRequest(f"prompt {i}", LONG)))
            while rt.statistics().active_rows < 4:
                await trio.sleep(0.01)
            signal.raise_signal(signal.SIGINT)
            await trio.sleep_forever()

    clock = trio.testing.MockClock(autojump_threshold=0)
    # Trio turns SIGINT into KeyboardInterrupt only over Python's default handler; a process
    # started in the background by a shell inherits SIGINT ignored (the signal would never
    # arrive, and the run on the MockClock would spin forever).
    with default_sigint(), pytest.raises(KeyboardInterrupt):
        trio.run(main, clock=clock)
    assert len(handles) == NUM_STREAMS
    for handle in handles:
        assert handle.state == "terminal"
        outcome = handle._session.outcome
        assert isinstance(outcome, Cancelled) and outcome.reason == "shutdown", outcome
    assert engine.num_rows == 0


@contextlib.contextmanager
def default_sigint() -> Iterator[None]:
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


# -- the tiny model ----------------------------------------------------------------------------

# The tiny model may end a reply at once: its end tokens are kept out.
NEVER_END = {t: -100.0 for t in make_preparer().tokenizer.eos_token_ids}
ENDLESS = SamplingParams(max_tokens=480, temperature=0, logit_bias=NEVER_END)


@pytest.mark.parametrize("run", range(5))
async def test_an_outer_cancel_on_the_real_engine_thread(tiny_engine, run):
    with EngineThread() as thread:
        engine = ThreadedEngine.over(tiny_engine, thread, max_batch=4)

        def open_rt() -> AbstractAsyncContextManager[RuntimeHandle]:
            return open_runtime(
                engine=engine, shutdown_grace_s=GRACE_S, max_batch=4, max_live=MAX_LIVE
            )

        with trio.fail_after(60):  # the hang, which took more than 60 s
            streams = await expire_with_streams_open(open_rt, ENDLESS)
        await check_every_stream_ended_cancelled_shutdown(streams)
        assert engine.num_rows == 0


def make_port(transport: Transport, started: EngineStarted) -> CorePort:
    return CorePort(transport, started, make_preparer())


def supervised_runtime(
    start: Callable[[], AbstractAsyncContextManager[tuple[Transport, EngineStarted]]],
    ports: list[CorePort],
) -> OpenRuntime:
    """``open_runtime``'s own composition for a model: the supervised engine's port, then the
    runtime's actors over it, both inside the caller's scope."""

    @asynccontextmanager
    async def open_rt() -> AsyncIterator[RuntimeHandle]:
        async with (
            open_supervised_engine(start, make_port, RestartPolicy(max_restarts=0)) as port,
            open_runtime(
                engine=port, shutdown_grace_s=GRACE_S, max_batch=4, max_live=MAX_LIVE
            ) as rt,
        ):
            ports.append(port)
            yield rt

    return open_rt


@pytest.mark.parametrize("run", range(3))
async def test_an_outer_cancel_on_a_supervised_engine_thread(tiny_engine, run):
    @asynccontextmanager
    async def start() -> AsyncIterator[tuple[Transport, EngineStarted]]:
        thread = EngineThread()
        thread.__enter__()
        try:
            core = EngineCore(tiny_engine, max_batch=4, prefill_chunk=16)
            transport = ThreadTransport(thread, core)
            await thread.run(core.batch_reset)
            yield transport, EngineStarted.of(core)
        finally:
            with trio.CancelScope(shield=True):
                await trio.to_thread.run_sync(thread.close)

    ports: list[CorePort] = []
    with trio.fail_after(60):
        streams = await expire_with_streams_open(supervised_runtime(start, ports), ENDLESS)
    await check_every_stream_ended_cancelled_shutdown(streams)
    [port] = ports
    assert port.liveness().is_up and port.liveness().last_cause is None  # no engine fault


async def test_an_outer_cancel_on_a_supervised_engine_process():
    @asynccontextmanager
    async def start() -> AsyncIterator[tuple[Transport, EngineStarted]]:
        async with open_process_transport(CoreRecipe(build_engine, max_batch=4)) as (
            transport,
            reply,
        ):
            assert reply.value is not None
            yield transport, reply.value

    ports: list[CorePort] = []
    with trio.fail_after(120):  # the child's start included
        streams = await expire_with_streams_open(supervised_runtime(start, ports), ENDLESS)
    await check_every_stream_ended_cancelled_shutdown(streams)
    [port] = ports
    assert port.liveness().last_cause is None  # no engine fault
