"""The admission gate and the engine arbiter on their own channels, under Trio's MockClock: each
actor's rules as a caller of its inbox sees them, with no runtime around it."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import pytest
import trio
import trio.testing

from mlx_trio.actors import gate
from mlx_trio.actors.arbiter import (
    Acquire,
    DrainCalledOff,
    DrainRequested,
    EngineArbiter,
    Grant,
    Lease,
    ReleaseLease,
    acquire,
)
from mlx_trio.engine.errors import OverloadedError, RuntimeClosedError


@asynccontextmanager
async def running(actor: gate.AdmissionGate | EngineArbiter) -> AsyncIterator[None]:
    async with trio.open_nursery() as nursery:
        await nursery.start(actor.run)
        yield
        nursery.cancel_scope.cancel()


async def admit(g: gate.AdmissionGate) -> tuple[gate.Reply, trio.MemoryReceiveChannel[gate.Reply]]:
    send, recv = trio.open_memory_channel[gate.Reply](2)
    await g.inbox.send(gate.Admit(send))
    return await recv.receive(), recv


# -- the admission gate -------------------------------------------------------------------


async def test_the_gate_grants_then_queues_then_refuses_with_retry_after(autojump_clock):
    g = gate.AdmissionGate(max_live=2, max_queued=1, retry_after_s=3.0)
    async with running(g):
        first, _ = await admit(g)
        second, _ = await admit(g)
        queued, waiting = await admit(g)
        refused, _ = await admit(g)
        assert isinstance(first, gate.Permit) and isinstance(second, gate.Permit)
        assert first != second
        assert queued == gate.Queued(position=1)
        assert isinstance(refused, gate.Refused) and isinstance(refused.error, OverloadedError)
        assert (refused.error.retry_after_s, refused.error.live, refused.error.queued) == (3, 2, 1)
        await g.inbox.send(gate.ReturnPermit(first))
        assert isinstance(await waiting.receive(), gate.Permit)  # the queue moves up
        await trio.testing.wait_all_tasks_blocked()
        assert g.statistics() == gate.GateStatistics(live=2, queued=0, refused=1, closed=False)


async def test_a_waiter_that_left_the_queue_is_skipped(autojump_clock):
    g = gate.AdmissionGate(max_live=1, max_queued=2)
    async with running(g):
        held, _ = await admit(g)
        _, gone = await admit(g)
        _, staying = await admit(g)
        await gone.aclose()
        assert isinstance(held, gate.Permit)
        await g.inbox.send(gate.ReturnPermit(held))
        assert isinstance(await staying.receive(), gate.Permit)
        await trio.testing.wait_all_tasks_blocked()
        assert g.statistics().live == 1 and g.statistics().queued == 0


async def test_closing_refuses_the_queue_and_everyone_after(autojump_clock):
    g = gate.AdmissionGate(max_live=1, max_queued=1)
    async with running(g):
        await admit(g)
        _, waiting = await admit(g)
        await g.inbox.send(gate.Close())
        refused = await waiting.receive()
        assert isinstance(refused, gate.Refused)
        assert isinstance(refused.error, RuntimeClosedError)
        late, _ = await admit(g)
        assert isinstance(late, gate.Refused) and isinstance(late.error, RuntimeClosedError)


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
