"""The memory budget on the actors' side: admission by projected KV bytes on the scripted engine
(a token is ``BYTES_PER_TOKEN`` of KV), under Trio's MockClock; the batch's retreat after a
failed allocation; and ``--memory-limit`` as given."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import pytest
import trio
import trio.testing

from mlx_trio.actors.messages import Cancelled, Completed, Failed, GenerationRequest
from mlx_trio.actors.port import EnginePort
from mlx_trio.actors.testing.faulty import FaultyEngine, StepFault
from mlx_trio.actors.testing.scripted import (
    BYTES_PER_TOKEN,
    Script,
    ScriptedEngine,
    scripted_budget,
)
from mlx_trio.api.inprocess import RuntimeHandle, SessionHandle, open_runtime
from mlx_trio.engine.budget import MemoryBudget, MemoryLimit, is_out_of_memory
from mlx_trio.engine.errors import InvalidRequestError, MemoryBudgetExceededError
from mlx_trio.engine.params import SamplingParams
from mlx_trio.engine.vocabulary.prompt import ChatMessage

POOL_TOKENS = 100


def request(prompt: str, max_tokens: int) -> GenerationRequest:
    return GenerationRequest(prompt, SamplingParams(max_tokens=max_tokens))


@asynccontextmanager
async def budgeted(
    engine: EnginePort | None = None, **config: object
) -> AsyncIterator[tuple[RuntimeHandle, list[int]]]:
    """A runtime over a scripted engine whose KV pool holds ``POOL_TOKENS`` tokens; yields it
    and a list that gets the gate's projected bytes at every engine call. Ends quiescent, with
    nothing projected."""
    if engine is None:
        engine = ScriptedEngine(Script(), memory_budget=scripted_budget(POOL_TOKENS))
    config.setdefault("max_batch", 8)
    projected: list[int] = []
    async with open_runtime(engine=engine, **config) as rt:
        scripted = engine.inner if isinstance(engine, FaultyEngine) else engine
        assert isinstance(scripted, ScriptedEngine)
        scripted.on_call = lambda _name: projected.append(rt.statistics().projected_kv_bytes)
        yield rt, projected
        await trio.sleep(1.0)
        await trio.testing.wait_all_tasks_blocked()
        stats = rt.statistics()
        assert stats.live_sessions == stats.queued_sessions == 0
        assert stats.projected_kv_bytes == 0


async def test_a_burst_beyond_the_kv_pool_queues_and_every_request_completes(autojump_clock):
    # Each request projects 40 tokens (10 of prompt, 30 new): two fit the pool of 100 at once.
    async with budgeted() as (rt, projected):
        outcomes = []

        async def run(i: int) -> None:
            outcomes.append((await rt.collect(request(f"prompt {i:03d}", 30))).outcome)

        async with trio.open_nursery() as nursery:
            for i in range(6):
                nursery.start_soon(run, i)
            await trio.testing.wait_all_tasks_blocked()
            stats = rt.statistics()
            assert (stats.live_sessions, stats.queued_sessions) == (2, 4)
        assert [type(o) for o in outcomes] == [Completed] * 6
        assert max(projected) == 80 * BYTES_PER_TOKEN
        assert all(p <= POOL_TOKENS * BYTES_PER_TOKEN for p in projected)


async def test_a_request_that_can_never_fit_is_refused_naming_the_field(autojump_clock):
    async with budgeted() as (rt, _):
        with pytest.raises(MemoryBudgetExceededError) as refused:
            await rt.submit(request("0123456789", 91))  # 101 tokens
        assert refused.value.param == "max_tokens"
        assert refused.value.code == "memory_budget_exceeded"
        assert "lower max_tokens to at most 90" in refused.value.message
        with pytest.raises(MemoryBudgetExceededError) as refused:
            await rt.submit(request("x" * 100, 1))  # the prompt alone does not fit
        assert refused.value.param == "prompt"
        chat = GenerationRequest([ChatMessage("user", "x" * 100)], SamplingParams(max_tokens=1))
        with pytest.raises(MemoryBudgetExceededError) as refused:
            await rt.submit(chat)
        assert refused.value.param == "prompt"  # the engine's name, whatever the prompt's form
        as_chat = refused.value.renamed({"prompt": "messages"})  # as the chat endpoint names it
        assert isinstance(as_chat, MemoryBudgetExceededError) and as_chat.param == "messages"
        # Exactly the pool fits, and nothing of the refusals was left admitted.
        result = await rt.collect(request("0123456789", 90))
        assert isinstance(result.outcome, Completed)
        assert rt.statistics().refused == 0  # refused as invalid, not as overloaded


async def finish(handle: SessionHandle) -> object:
    """Read a handle's events to its outcome."""
    async with handle:
        async for _ in handle:
            pass
    return await handle.result()


async def test_the_queue_is_first_in_first_out_a_small_request_does_not_overtake(autojump_clock):
    async with budgeted() as (rt, _):
        first = await rt.submit(request(f"{'first':>10}", 50))  # 60 tokens: live
        big = await rt.submit(request(f"{'big':>10}", 50))  # 60 more do not fit: queued
        small = await rt.submit(request(f"{'small':>10}", 1))  # 11 would fit
        await trio.testing.wait_all_tasks_blocked()
        assert (first.state, big.state, small.state) == ("running", "queued", "queued")
        outcomes = [await finish(h) for h in (first, big, small)]
        assert [type(o) for o in outcomes] == [Completed] * 3


async def test_leaving_the_queue_lets_the_next_waiter_in_at_once(autojump_clock):
    async with budgeted() as (rt, _):
        first = await rt.submit(request(f"{'first':>10}", 70))  # 80 tokens: runs a while
        big = await rt.submit(request(f"{'big':>10}", 50))  # queued
        small = await rt.submit(request(f"{'small':>10}", 1))  # 11 tokens, queued behind "big"
        await trio.testing.wait_all_tasks_blocked()
        assert (big.state, small.state) == ("queued", "queued")
        outcome = await big.cancel()
        assert isinstance(outcome, Cancelled) and outcome.reason == "requested"
        await trio.testing.wait_all_tasks_blocked()
        assert (first.state, small.state) == ("running", "running")  # 80 + 11 fit the pool
        assert isinstance(await finish(small), Completed)
        assert isinstance(await finish(first), Completed)
        await big.aclose()


async def test_every_outcome_gives_its_projected_bytes_back(autojump_clock):
    engine = ScriptedEngine(
        Script(fail_batch_steps=frozenset({3})), memory_budget=scripted_budget(POOL_TOKENS)
    )
    async with budgeted(engine) as (rt, _):
        async with trio.open_nursery() as nursery:
            results: dict[str, object] = {}

            async def run(name: str, max_tokens: int, timeout_s: float | None = None) -> None:
                req = GenerationRequest(
                    f"{name:>10}", SamplingParams(max_tokens=max_tokens), timeout_s=timeout_s
                )
                results[name] = (await rt.collect(req)).outcome

            nursery.start_soon(run, "failed", 20)  # in the batch at the failing step
            nursery.start_soon(run, "deadline", 65, 0.001)  # queued past its deadline
        assert isinstance(results["failed"], Failed)
        assert isinstance(results["deadline"], Cancelled)
        result = await rt.collect(request("0123456789", 90))  # the whole pool is free again
        assert isinstance(result.outcome, Completed)


async def test_running_out_of_memory_fails_the_step_and_halves_the_batch(autojump_clock):
    engine = FaultyEngine(ScriptedEngine(Script()), [StepFault("kv_exhausted", at_step=2)])
    async with budgeted(engine, max_batch=8, steps_per_call=1) as (rt, _):
        first = [rt.collect(request(f"first {i}", 4)) for i in range(8)]
        outcomes = []

        async def run(job) -> None:
            outcomes.append((await job).outcome)

        async with trio.open_nursery() as nursery:
            for job in first:
                nursery.start_soon(run, job)
        assert [o.code for o in outcomes if isinstance(o, Failed)] == ["engine_fault"] * 8
        stats = rt.statistics()
        assert (stats.batch_limit, stats.out_of_memory) == (4, 1)
        inner = engine.inner
        assert isinstance(inner, ScriptedEngine)
        inner.max_active_rows = 0
        outcomes.clear()
        async with trio.open_nursery() as nursery:
            for i in range(8):
                nursery.start_soon(run, rt.collect(request(f"again {i}", 4)))
        assert [type(o) for o in outcomes] == [Completed] * 8
        assert inner.max_active_rows <= 5  # 4, and one back after 8 calls that succeeded
        assert rt.statistics().batch_limit > 4


def test_out_of_memory_is_recognised_in_each_backends_words():
    for message in (
        "cudaMallocAsync(&data, size, stream) failed: out of memory",
        "[malloc] Unable to allocate 1073741824 bytes.",
        "[metal::malloc] Attempting to allocate 68719476736 bytes which is greater than the "
        "maximum allowed buffer size",
        "[METAL] Command buffer execution failed: Insufficient Memory",
    ):
        assert is_out_of_memory(RuntimeError(message))
    assert is_out_of_memory(MemoryError())
    assert not is_out_of_memory(RuntimeError("shapes (1,2) and (3,4) cannot be broadcast"))


@pytest.mark.parametrize(
    ("given", "limit"),
    [
        ("6GB", MemoryLimit(bytes=6 * 10**9)),
        ("6GiB", MemoryLimit(bytes=6 << 30)),
        ("6g", MemoryLimit(bytes=6 << 30)),
        ("512MiB", MemoryLimit(bytes=512 << 20)),
        ("1.5GiB", MemoryLimit(bytes=3 << 29)),
        ("2000000000", MemoryLimit(bytes=2_000_000_000)),
        (2_000_000_000, MemoryLimit(bytes=2_000_000_000)),
        ("0.3", MemoryLimit(fraction=0.3)),
        ("30%", MemoryLimit(fraction=0.3)),
        (0.5, MemoryLimit(fraction=0.5)),
    ],
)
def test_memory_limits_parse_as_bytes_or_a_share(given, limit):
    assert MemoryLimit.parse(given) == limit


@pytest.mark.parametrize("given", ["", "lots", "6 parsecs", "1.5", "0", "-1GB", "150%", 0, True])
def test_a_bad_memory_limit_is_refused_naming_it(given):
    with pytest.raises(InvalidRequestError, match=r"^memory_limit must be bytes") as refused:
        MemoryLimit.parse(given)
    assert refused.value.param == "memory_limit"


def test_a_projection_counts_the_slots_a_kv_step_may_leave_empty():
    budget = MemoryBudget(
        limit=0,
        device=0,
        weights=0,
        headroom=0,
        kv_pool=1024 * 512,
        kv_bytes_per_token=512,
        kv_bytes_per_row=100,
        kv_step=256,
        cache_limit=0,
    )
    assert budget.projected_bytes(30, 40) == 100 + (70 + 255) * 512
    assert budget.check_fits(30, 738) == 100 + 1023 * 512
    with pytest.raises(MemoryBudgetExceededError, match="lower max_tokens to at most 738"):
        budget.check_fits(30, 2000)
