"""The admission gate, the engine arbiter and the batch group on their own channels, under
Trio's MockClock: each actor's rules as a caller of its inbox sees them, with no runtime around
it (the test plays the arbiter for the batch group, over the scripted engine)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import pytest
import trio
import trio.testing

from mlx_trio.actors import gate
from mlx_trio.actors.arbiter import (
    Acquire,
    ArbiterMessage,
    DrainCalledOff,
    DrainRequested,
    EngineArbiter,
    Grant,
    Lease,
    ReleaseLease,
    acquire,
)
from mlx_trio.actors.batch_group import BatchGroup
from mlx_trio.actors.batch_messages import AddRow, RowsComing, RowsNotComing
from mlx_trio.actors.lanes import SessionInbox
from mlx_trio.actors.testing.scripted import Script, ScriptedEngine, expected_tokens
from mlx_trio.engine.errors import OverloadedError, RuntimeClosedError
from mlx_trio.engine.outputs import RowOutput
from mlx_trio.engine.params import SamplingParams


@asynccontextmanager
async def running(actor: gate.AdmissionGate | EngineArbiter) -> AsyncIterator[None]:
    async with trio.open_nursery() as nursery:
        await nursery.start(actor.run)
        yield
        nursery.cancel_scope.cancel()


async def refusal(g: gate.AdmissionGate) -> OverloadedError | RuntimeClosedError:
    with pytest.raises((OverloadedError, RuntimeClosedError)) as refused:
        await g.admit()
    return refused.value


# -- the admission gate -------------------------------------------------------------------


async def test_the_gate_grants_then_queues_then_refuses_with_retry_after(autojump_clock):
    g = gate.AdmissionGate(max_live=2, max_queued=1, retry_after_s=3.0)
    async with running(g):
        first = await g.admit()
        second = await g.admit()
        waiting = await g.admit()
        refused = await refusal(g)
        assert first.permit is not None and second.permit is not None
        assert first.permit != second.permit
        assert waiting.permit is None  # queued
        assert isinstance(refused, OverloadedError)
        assert (refused.retry_after_s, refused.live, refused.queued) == (3, 2, 1)
        await first.release()
        assert isinstance(await waiting.wait(), gate.Permit)  # the queue moves up
        await trio.testing.wait_all_tasks_blocked()
        assert g.statistics() == gate.GateStatistics(live=2, queued=0, refused=1, closed=False)


async def test_a_waiter_that_left_the_queue_is_skipped(autojump_clock):
    g = gate.AdmissionGate(max_live=1, max_queued=2)
    async with running(g):
        held = await g.admit()
        gone = await g.admit()
        staying = await g.admit()
        await gone.release()
        assert held.permit is not None
        await held.release()
        assert isinstance(await staying.wait(), gate.Permit)
        await trio.testing.wait_all_tasks_blocked()
        assert g.statistics().live == 1 and g.statistics().queued == 0


async def test_releasing_gives_back_once_and_a_cancelled_admit_holds_nothing(autojump_clock):
    g = gate.AdmissionGate(max_live=1, max_queued=1)
    async with running(g):
        held = await g.admit()
        await held.release()
        await held.release()  # a second release gives nothing back twice
        with trio.CancelScope() as scope:
            scope.cancel()
            await g.admit()
        again = await g.admit()
        await trio.testing.wait_all_tasks_blocked()
        assert again.permit is not None
        assert g.statistics() == gate.GateStatistics(live=1, queued=0, refused=0, closed=False)


async def test_closing_refuses_the_queue_and_everyone_after(autojump_clock):
    g = gate.AdmissionGate(max_live=1, max_queued=1)
    async with running(g):
        await g.admit()
        waiting = await g.admit()
        await g.close()
        assert await waiting.wait() is None
        assert isinstance(await refusal(g), RuntimeClosedError)


# -- the engine arbiter -------------------------------------------------------------------


async def test_serial_waiters_drain_the_batch_and_go_first(autojump_clock):
    arbiter = EngineArbiter()
    async with running(arbiter):
        batch_send, batch_recv = trio.open_memory_channel[Grant](4)
        await arbiter.inbox.send(Acquire("batch", batch_send))
        batch_lease = await batch_recv.receive()
        assert isinstance(batch_lease, Lease) and batch_lease.kind == "batch"

        order: list[str] = []

        async def serial(name: str) -> None:
            lease = await acquire(arbiter.inbox, "serial")
            order.append(name)
            await trio.sleep(1)
            await arbiter.inbox.send(ReleaseLease(lease))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(serial, "first")
            await trio.testing.wait_all_tasks_blocked()
            nursery.start_soon(serial, "second")
            assert await batch_recv.receive() == DrainRequested()
            assert arbiter.statistics().draining
            await arbiter.inbox.send(ReleaseLease(batch_lease))
        assert order == ["first", "second"]
        assert arbiter.statistics().drains == 1


async def test_a_serial_waiter_that_leaves_calls_the_drain_off(autojump_clock):
    arbiter = EngineArbiter()
    async with running(arbiter):
        batch_send, batch_recv = trio.open_memory_channel[Grant](4)
        await arbiter.inbox.send(Acquire("batch", batch_send))
        lease = await batch_recv.receive()
        with trio.move_on_after(1):
            await acquire(arbiter.inbox, "serial")
        assert await batch_recv.receive() == DrainRequested()
        assert await batch_recv.receive() == DrainCalledOff()
        assert not arbiter.statistics().draining
        assert arbiter.statistics().holder == "batch" and lease.kind == "batch"


async def test_releasing_a_lease_not_held_is_a_bug(autojump_clock):
    arbiter = EngineArbiter()
    with pytest.raises(ExceptionGroup) as info:
        async with running(arbiter):
            await arbiter.inbox.send(ReleaseLease(Lease(99, "serial")))
            await trio.sleep(1)
    assert info.group_contains(AssertionError, match=r"^released Lease\(number=99")


# -- the batch group ----------------------------------------------------------------------


def expected(prompt: str, n: int) -> list[int]:
    return expected_tokens(tuple(ord(c) for c in prompt), n)


async def collect_row(inbox: SessionInbox) -> tuple[list[int], str | None]:
    """A session's reading: the row's tokens, and its finish reason."""
    tokens: list[int] = []
    while (event := await inbox.receive()) is not None:
        inbox.handled()
        if isinstance(event, RowOutput):
            tokens += event.delta.token_ids
            if event.stats is not None:
                return tokens, event.delta.finish_reason
    return tokens, None


async def test_the_batch_group_asks_for_the_lease_serves_rows_and_gives_it_back(autojump_clock):
    engine = ScriptedEngine(Script(step_s=0.01))
    arbiter_send, arbiter_recv = trio.open_memory_channel[ArbiterMessage](8)
    group = BatchGroup(engine, arbiter_send, max_batch=4, step_timeout_s=5, inbox_size=16)
    params = SamplingParams(temperature=0, max_tokens=6)
    async with trio.open_nursery() as nursery:
        await nursery.start(group.run)
        inboxes = [SessionInbox(lambda event: False, 16) for _ in range(3)]
        for text, inbox in zip(("a", "bb", "ccc"), inboxes, strict=True):
            await group.inbox.send(AddRow(await engine.prepare(text, params), inbox))
        ask = await arbiter_recv.receive()
        assert isinstance(ask, Acquire) and ask.kind == "batch"
        ask.grant.send_nowait(Lease(7, "batch"))
        results = [await collect_row(inbox) for inbox in inboxes]
        assert results == [(expected(text, 6), "length") for text in ("a", "bb", "ccc")]
        assert await arbiter_recv.receive() == ReleaseLease(Lease(7, "batch"))  # empty: back
        assert group.statistics().rows_submitted == 3
        nursery.cancel_scope.cancel()


async def test_an_empty_batch_waits_for_the_rows_announced_to_it_within_its_window(
    autojump_clock,
):
    engine = ScriptedEngine(Script(step_s=0.01))
    adds: list[float] = []
    engine.on_call = lambda name: adds.append(trio.current_time()) if name == "batch_add" else None
    arbiter_send, arbiter_recv = trio.open_memory_channel[ArbiterMessage](8)
    group = BatchGroup(
        engine, arbiter_send, max_batch=4, step_timeout_s=5, inbox_size=16, admission_window_s=0.1
    )
    params = SamplingParams(temperature=0, max_tokens=2)
    async with trio.open_nursery() as nursery:
        await nursery.start(group.run)
        inboxes = [SessionInbox(lambda event: False, 16) for _ in range(3)]
        await group.inbox.send(RowsComing(3))
        await group.inbox.send(AddRow(await engine.prepare("a", params), inboxes[0], True))
        (await arbiter_recv.receive()).grant.send_nowait(Lease(1, "batch"))
        await trio.sleep(0.02)
        assert adds == [] and group.statistics().rows_coming == 2  # it waits for the others
        await group.inbox.send(AddRow(await engine.prepare("b", params), inboxes[1], True))
        await group.inbox.send(RowsNotComing(1))  # the last went elsewhere: no more waiting
        assert [await collect_row(inbox) for inbox in inboxes[:2]] == [
            (expected("a", 2), "length"),
            (expected("b", 2), "length"),
        ]
        assert adds == [0.02]  # both in one call, once the last announced row was accounted for
        assert await arbiter_recv.receive() == ReleaseLease(Lease(1, "batch"))
        await group.inbox.send(RowsComing(1))  # announced, and never ended
        started = trio.current_time()
        await group.inbox.send(AddRow(await engine.prepare("c", params), inboxes[2]))
        (await arbiter_recv.receive()).grant.send_nowait(Lease(2, "batch"))
        assert await collect_row(inboxes[2]) == (expected("c", 2), "length")
        assert adds[1] - started == pytest.approx(0.1)  # no longer than the window
        nursery.cancel_scope.cancel()


async def test_a_burst_that_arrives_a_row_at_a_time_joins_an_empty_batch_in_one_call(
    autojump_clock,
):
    engine = ScriptedEngine(Script(step_s=0.01))
    adds: list[tuple[float, int]] = []
    rows = iter(range(1000))

    def on_call(name: str) -> None:
        if name == "batch_add":
            adds.append((trio.current_time(), next(rows)))

    engine.on_call = on_call
    arbiter_send, arbiter_recv = trio.open_memory_channel[ArbiterMessage](8)
    group = BatchGroup(
        engine,
        arbiter_send,
        max_batch=8,
        step_timeout_s=5,
        inbox_size=64,
        admission_window_s=0.1,
        arrival_gap_s=0.003,
    )
    params = SamplingParams(temperature=0, max_tokens=2)
    async with trio.open_nursery() as nursery:
        await nursery.start(group.run)
        inboxes = [SessionInbox(lambda event: False, 16) for _ in range(6)]
        for n, inbox in enumerate(inboxes[:5]):  # an HTTP server's pace: 2 ms apart
            await group.inbox.send(RowsComing(1))
            await group.inbox.send(AddRow(await engine.prepare(f"r{n}", params), inbox, True))
            if n == 0:
                (await arbiter_recv.receive()).grant.send_nowait(Lease(1, "batch"))
            await trio.sleep(0.002)
        for n, inbox in enumerate(inboxes[:5]):
            assert await collect_row(inbox) == (expected(f"r{n}", 2), "length")
        assert [t for t, _ in adds] == [pytest.approx(0.008 + 0.003)]  # one call, the gap after
        assert group.statistics().rows_submitted == 5
        assert await arbiter_recv.receive() == ReleaseLease(Lease(1, "batch"))
        started = trio.current_time()  # a lone request waits out the gap, no longer
        await group.inbox.send(RowsComing(1))
        await group.inbox.send(AddRow(await engine.prepare("lone", params), inboxes[5], True))
        (await arbiter_recv.receive()).grant.send_nowait(Lease(2, "batch"))
        assert await collect_row(inboxes[5]) == (expected("lone", 2), "length")
        assert adds[1][0] - started == pytest.approx(0.003)
        nursery.cancel_scope.cancel()


async def test_a_draining_batch_group_admits_nothing_new_and_hands_the_lease_back(
    autojump_clock,
):
    engine = ScriptedEngine(Script(step_s=0.01))
    arbiter_send, arbiter_recv = trio.open_memory_channel[ArbiterMessage](8)
    group = BatchGroup(engine, arbiter_send, max_batch=4, step_timeout_s=5, inbox_size=16)
    async with trio.open_nursery() as nursery:
        await nursery.start(group.run)
        running = SessionInbox(lambda event: False, 64)
        long = SamplingParams(temperature=0, max_tokens=20)
        await group.inbox.send(AddRow(await engine.prepare("running", long), running))
        (await arbiter_recv.receive()).grant.send_nowait(Lease(1, "batch"))
        await trio.sleep(0.05)  # a few steps in
        await group.inbox.send(DrainRequested())
        late = SessionInbox(lambda event: False, 64)
        short = SamplingParams(temperature=0, max_tokens=2)
        await group.inbox.send(AddRow(await engine.prepare("late", short), late))
        assert await collect_row(running) == (expected("running", 20), "length")
        assert await arbiter_recv.receive() == ReleaseLease(Lease(1, "batch"))
        assert group.statistics().rows_submitted == 1  # the late row waited out the drain
        again = await arbiter_recv.receive()  # then the group asks again for it
        assert isinstance(again, Acquire)
        again.grant.send_nowait(Lease(2, "batch"))
        assert await collect_row(late) == (expected("late", 2), "length")
        nursery.cancel_scope.cancel()
