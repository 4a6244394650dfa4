"""What a reader of a request's events can rely on, on the scripted engine under MockClock: one
reader, numbered events, a queue bounded in tokens as well as events, the tokens committed in
every outcome, and a callback that stops its request by returning False."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import pytest
import trio
import trio.testing

from mlx_trio.actors.messages import (
    Cancelled,
    Completed,
    Event,
    Failed,
    GenerationRequest,
    Progress,
    TextDelta,
)
from mlx_trio.actors.testing.scripted import Script, ScriptedEngine, expected_tokens, token_text
from mlx_trio.api.inprocess import RuntimeHandle, SessionHandle, open_runtime
from mlx_trio.engine.errors import SecondReaderError
from mlx_trio.engine.params import SamplingParams

LONG_PROMPT = "a prompt that takes several prefill steps " * 5  # 210 tokens, 64 a step


def request(prompt: str, max_tokens: int = 8, **kwargs: object) -> GenerationRequest:
    params = SamplingParams(max_tokens=max_tokens)
    return GenerationRequest(prompt, params, **kwargs)  # type: ignore[arg-type]


def tokens_for(prompt: str, n: int) -> tuple[int, ...]:
    return tuple(expected_tokens(tuple(ord(c) for c in prompt), n))


def tokens_in(events: list[Event]) -> tuple[int, ...]:
    return tuple(t for e in events if isinstance(e, TextDelta) for t in e.token_ids)


@asynccontextmanager
async def scripted(script: Script | None = None, **config: object) -> AsyncIterator[RuntimeHandle]:
    engine = ScriptedEngine(script or Script())
    config.setdefault("max_batch", 4)
    async with open_runtime(engine=engine, **config) as rt:
        yield rt
        await trio.sleep(1.0)  # let any step in flight end (instant under MockClock)
        await trio.testing.wait_all_tasks_blocked()
        stats = rt.statistics()
        assert stats.live_sessions == stats.queued_sessions == stats.active_rows == 0
        assert engine.num_rows == 0 and engine.kv_bytes == 0


# -- one reader -----------------------------------------------------------------------------


async def test_an_async_for_in_a_second_task_is_refused_and_the_first_reads_on(autojump_clock):
    async with scripted() as rt:
        handle = await rt.submit(request("one reader", max_tokens=6))
        events: list[Event] = []
        async for event in handle:
            events.append(event)
            break

        async def second_reader() -> None:
            with pytest.raises(
                SecondReaderError,
                match=r"^request req-1's events have one reader, the task that read first$",
            ):
                async for _ in handle:
                    pass

        async with trio.open_nursery() as nursery:
            nursery.start_soon(second_reader)
        async for event in handle:  # the first reader reads on, a loop later
            events.append(event)
        assert tokens_in(events) == tokens_for("one reader", 6)
        assert isinstance(events[-1], Completed)


async def test_another_task_cannot_read_a_handle_that_one_task_iterates(autojump_clock):
    async with scripted() as rt:
        handle = await rt.submit(request("iterated", max_tokens=10))
        seen: list[Event] = []
        refused: list[str] = []

        async def intruder() -> None:
            try:
                await handle.receive()
            except SecondReaderError as exc:
                refused.append(exc.message)

        async with trio.open_nursery() as nursery:
            async for event in handle:
                seen.append(event)
                if len(seen) == 2:
                    nursery.start_soon(intruder)
                    await trio.testing.wait_all_tasks_blocked()
        assert refused == ["request req-1's events have one reader, the task that read first"]
        assert tokens_in(seen) == tokens_for("iterated", 10)  # nothing went to the intruder
        assert isinstance(seen[-1], Completed)


async def test_two_tasks_stepping_one_iterator_is_refused(autojump_clock):
    async with scripted() as rt:
        handle = await rt.submit(request("stepped", max_tokens=4))
        iterator = aiter(handle)
        first = await anext(iterator)  # this task reads first

        async def step_it_too() -> None:
            with pytest.raises(
                SecondReaderError,
                match=r"^request req-1's events have one reader, the task that read first$",
            ):
                await anext(iterator)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(step_it_too)
        rest = [event async for event in iterator]
        assert tokens_in([first, *rest]) == tokens_for("stepped", 4)


# -- numbered events ------------------------------------------------------------------------


@pytest.mark.parametrize("reproducible", [False, True], ids=["batch lane", "serial lane"])
async def test_events_are_numbered_from_0_without_a_gap_through_the_outcome(
    autojump_clock, reproducible: bool
):
    async with scripted(steps_per_call=3) as rt:
        handle = await rt.submit(request(LONG_PROMPT, max_tokens=7, reproducible=reproducible))
        events = [event async for event in handle]
        assert any(isinstance(e, Progress) for e in events)
        assert [e.seq for e in events] == list(range(len(events)))
        outcome = await handle.result()
        assert outcome is events[-1]
        assert isinstance(outcome, Completed) and outcome.seq == len(events) - 1


async def test_a_reader_that_left_early_can_tell_what_it_missed(autojump_clock):
    async with scripted(event_buffer_tokens=5, steps_per_call=1) as rt:
        handle = await rt.submit(request("left", max_tokens=50))
        seen = [await handle.receive() for _ in range(3)]
        await trio.sleep(1.0)  # 100 steps' time: the queue fills up to its 5 tokens
        await handle.aclose()
        outcome = await handle.result()
        assert isinstance(outcome, Cancelled) and outcome.reason == "consumer_closed"
        assert [e.seq for e in seen] == [0, 1, 2]
        assert outcome.committed_tokens == len(tokens_in(seen)) + 5
        assert outcome.seq == 3 + 5  # five one-token deltas sent, never taken


# -- a queue bounded in tokens --------------------------------------------------------------


async def test_a_stalled_reader_is_sent_no_more_tokens_than_the_token_bound(autojump_clock):
    async with scripted(event_buffer=64, event_buffer_tokens=5, steps_per_call=1) as rt:
        handle = await rt.submit(request("stalled", max_tokens=200))
        await trio.sleep(2.0)  # 200 steps' time, well within the idle timeout
        assert handle.state == "running"  # waiting for the reader, not cancelled
        await handle.cancel()
        events = [event async for event in handle]
        assert tokens_in(events) == tokens_for("stalled", 5)  # not 64 events' worth
        assert isinstance(events[-1], Cancelled) and events[-1].committed_tokens == 5


async def test_a_reader_stalled_on_the_token_bound_is_cancelled_idle(autojump_clock):
    async with scripted(
        event_buffer=64, event_buffer_tokens=5, steps_per_call=1, idle_timeout_s=5.0
    ) as rt:
        handle = await rt.submit(request("idle", max_tokens=200))
        await trio.sleep(4.0)
        assert handle.state == "running"
        outcome = await handle.result()
        assert isinstance(outcome, Cancelled) and outcome.reason == "consumer_idle"
        assert outcome.committed_tokens == 5


async def test_a_delta_bigger_than_the_token_bound_arrives_split(autojump_clock):
    params = SamplingParams(max_tokens=20, logprobs=True)
    async with scripted(event_buffer_tokens=3, steps_per_call=8) as rt:
        handle = await rt.submit(GenerationRequest("split", params))
        events = [event async for event in handle]
        deltas = [e for e in events if isinstance(e, TextDelta)]
        expected = tokens_for("split", 20)
        assert tokens_in(events) == expected
        assert "".join(d.text for d in deltas) == "".join(token_text(t) for t in expected)
        assert max(len(d.token_ids) for d in deltas) == 3
        for delta in deltas:
            assert delta.logprobs is not None
            assert tuple(record.token for record in delta.logprobs) == delta.token_ids
        assert [e.seq for e in events] == list(range(len(events)))
        assert isinstance(events[-1], Completed) and events[-1].committed_tokens == 20


# -- the tokens committed in every outcome --------------------------------------------------


async def test_a_failed_request_says_how_many_tokens_it_sent(autojump_clock):
    async with scripted(Script(row_faults={"faulty": 6}), steps_per_call=1) as rt:
        handle = await rt.submit(request("faulty", max_tokens=20))
        events = [event async for event in handle]
        failed = events[-1]
        assert isinstance(failed, Failed) and failed.code == "engine_fault"
        assert tokens_in(events) == tokens_for("faulty", 6)
        assert failed.committed_tokens == 6
        assert failed.seq == len(events) - 1


async def test_a_completed_request_says_how_many_tokens_it_sent(autojump_clock):
    async with scripted() as rt:
        collected = await rt.collect(request("complete", max_tokens=9))
        assert isinstance(collected.outcome, Completed)
        assert collected.outcome.committed_tokens == len(collected.token_ids) == 9


# -- a callback that returns False ----------------------------------------------------------


@pytest.mark.parametrize("is_async", [False, True], ids=["function", "coroutine function"])
async def test_a_callback_that_returns_false_stops_its_request(autojump_clock, is_async: bool):
    async with scripted(steps_per_call=1) as rt:
        calls: list[Event] = []

        def on_event(event: Event) -> bool:
            calls.append(event)
            return len(calls) < 3

        async def on_event_async(event: Event) -> bool:
            await trio.sleep(0.001)
            return on_event(event)

        async with trio.open_nursery() as nursery:
            handle = await rt.submit_with_callback(
                request("stop me", max_tokens=50),
                on_event_async if is_async else on_event,
                nursery,
            )
        outcome = await handle.result()
        assert isinstance(outcome, Cancelled) and outcome.reason == "requested"
        assert len(calls) == 3  # none after the one that returned False
        assert rt.statistics().cancelled["requested"] == 1


async def test_a_callback_that_returns_nothing_sees_its_request_to_the_end(autojump_clock):
    async with scripted() as rt:
        calls: list[Event] = []
        async with trio.open_nursery() as nursery:
            handle: SessionHandle = await rt.submit_with_callback(
                request("to the end", max_tokens=5), calls.append, nursery
            )
        assert isinstance(await handle.result(), Completed)
        assert tokens_in(calls) == tokens_for("to the end", 5)
        assert calls[-1] is await handle.result()
