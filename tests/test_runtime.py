"""The actor runtime on the scripted engine, under Trio's MockClock (timeouts run instantly).

The scripted engine raises ExclusionViolation if two engine calls overlap or the serial lane
runs while batch rows are live, so every test also checks the lanes' mutual exclusion. Every test
ends by checking quiescence: no live sessions, no permits, no rows, no KV, lease back.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import pytest
import trio
import trio.testing

from mlx_trio.actors.batch_policy import STEPS_APART
from mlx_trio.actors.channels import offer
from mlx_trio.actors.lanes import SessionInbox
from mlx_trio.actors.messages import (
    Cancelled,
    Completed,
    Failed,
    GenerationRequest,
    Progress,
    TextDelta,
)
from mlx_trio.actors.testing.scripted import Script, ScriptedEngine, expected_tokens
from mlx_trio.api.inprocess import RuntimeHandle, open_runtime
from mlx_trio.engine.errors import InvalidRequestError, OverloadedError
from mlx_trio.engine.outputs import RowProgress
from mlx_trio.engine.params import SamplingParams


def request(prompt: str, max_tokens: int = 8, **kwargs) -> GenerationRequest:
    return GenerationRequest(prompt, SamplingParams(max_tokens=max_tokens), **kwargs)


def tokens_for(prompt: str, n: int) -> tuple[int, ...]:
    return tuple(expected_tokens(tuple(ord(c) for c in prompt), n))


@asynccontextmanager
async def scripted(
    script: Script | None = None, *, pid: int | None = None, **config
) -> AsyncIterator[tuple[RuntimeHandle, ScriptedEngine]]:
    engine = ScriptedEngine(script or Script(), pid=pid)
    config.setdefault("max_batch", 4)
    async with open_runtime(engine=engine, **config) as rt:
        yield rt, engine
        await trio.sleep(1.0)  # let any step in flight end (instant under MockClock)
        await trio.testing.wait_all_tasks_blocked()
        assert_quiescent(rt, engine)


def assert_quiescent(rt: RuntimeHandle, engine: ScriptedEngine) -> None:
    stats = rt.statistics()
    assert stats.live_sessions == 0
    assert stats.queued_sessions == 0
    assert stats.active_rows == stats.parked_rows == stats.pending_rows == 0
    assert stats.lane_mode == "idle"
    assert engine.num_rows == 0 and not engine.serial_active
    assert engine.kv_bytes == 0


async def test_concurrent_sessions_get_their_own_tokens(autojump_clock):
    async with scripted() as (rt, engine):
        results = {}

        async def run(i: int) -> None:
            results[i] = await rt.collect(request(f"prompt {i}", max_tokens=6))

        async with trio.open_nursery() as nursery:
            for i in range(10):
                nursery.start_soon(run, i)
        for i, result in results.items():
            assert result.token_ids == tokens_for(f"prompt {i}", 6)
            assert isinstance(result.outcome, Completed)
            assert result.outcome.finish_reason == "length"
            assert result.outcome.usage.completion_tokens == 6
            assert result.outcome.lane == "batch"
        assert engine.max_active_rows == 4
        stats = rt.statistics()
        assert stats.completed == 10
        assert stats.rows_submitted == {"batch": 10, "serial": 0}


async def test_long_prompt_reports_progress_then_text(autojump_clock):
    # One step a call: a call of several steps reports only its latest progress.
    async with scripted(Script(prefill_chunk=64), steps_per_call=1) as (rt, _):
        handle = await rt.submit(request("x" * 200, max_tokens=2))
        events = [event async for event in handle]
        progress = [e for e in events if isinstance(e, Progress)]
        assert [(p.done, p.total) for p in progress] == [
            (64, 200),
            (128, 200),
            (192, 200),
            (200, 200),
        ]
        assert [type(e) for e in events[len(progress) :]] == [TextDelta, TextDelta, Completed]


async def test_drain_finishes_running_rows_then_serial_runs_alone_then_batch_resumes(
    autojump_clock,
):
    async with scripted() as (rt, engine):
        async with trio.open_nursery() as nursery:
            order: list[str] = []

            async def run(name: str, req: GenerationRequest) -> None:
                result = await rt.collect(req)
                assert isinstance(result.outcome, Completed)
                order.append(name)

            for i in range(2):
                nursery.start_soon(run, f"batch{i}", request(f"b{i}", max_tokens=10))
            await trio.sleep(0.03)  # the batch is running
            nursery.start_soon(run, "serial", request("s", max_tokens=3, reproducible=True))
            await trio.sleep(0.001)
            nursery.start_soon(run, "late", request("late", max_tokens=2))
        assert order[2:] == ["serial", "late"]  # running rows finished first, late waited
        log = engine.call_log
        first_serial = log.index("serial_start")
        last_serial = max(i for i, call in enumerate(log) if call.startswith("serial"))
        assert all(call.startswith("serial") for call in log[first_serial : last_serial + 1])
        assert "batch_add" in log[last_serial:]
        assert rt.statistics().drains == 1


async def test_serial_lane_is_not_starved_by_continuous_batch_traffic(autojump_clock):
    async with scripted() as (rt, _):
        serial_done = trio.Event()

        async def flood() -> None:
            while not serial_done.is_set():
                try:
                    handle = await rt.submit(request("flood", max_tokens=5))
                except OverloadedError:
                    await trio.sleep(0.01)
                    continue
                async with handle:
                    async for _ in handle:
                        pass

        async with trio.open_nursery() as nursery:
            for _ in range(6):
                nursery.start_soon(flood)
            await trio.sleep(0.05)
            result = await rt.collect(request("serial", max_tokens=3, reproducible=True))
            serial_done.set()
        assert isinstance(result.outcome, Completed)
        assert result.outcome.lane == "serial"


async def test_cancelling_the_serial_waiter_calls_the_drain_off_at_once(autojump_clock):
    async with scripted() as (rt, engine):
        async with trio.open_nursery() as nursery:
            long = await rt.submit(request("long", max_tokens=50))
            nursery.start_soon(rt.collect, request("long2", max_tokens=50))
            await trio.sleep(0.05)
            serial = await rt.submit(request("serial", max_tokens=3, reproducible=True))
            await trio.sleep(0.02)
            assert rt.statistics().lane_mode == "draining"
            outcome = await serial.cancel()
            assert isinstance(outcome, Cancelled) and outcome.reason == "requested"
            await trio.sleep(0.001)
            joined = await rt.submit(request("joins while long rows run", max_tokens=2))
            result = [e async for e in joined]
            assert isinstance(result[-1], Completed)
            assert long.state == "running"  # it joined the same batch, no drain
            async for _ in long:
                pass
        assert "serial_start" not in engine.call_log


async def test_cancel_while_queued_never_reaches_the_engine(autojump_clock):
    async with scripted(max_live=1, max_queued=2) as (rt, engine):
        first = await rt.submit(request("first", max_tokens=20))
        queued = await rt.submit(request("queued", max_tokens=20))
        await trio.sleep(0.01)
        assert queued.state == "queued"
        assert rt.statistics().queued_sessions == 1
        outcome = await queued.cancel()
        assert isinstance(outcome, Cancelled) and outcome.reason == "requested"
        async for _ in first:
            pass
        assert engine.call_log.count("batch_add") == 1
        assert rt.statistics().cancelled["requested"] == 1


async def test_cancel_while_waiting_for_the_serial_lane_and_while_running(autojump_clock):
    async with scripted() as (rt, engine):
        running = await rt.submit(request("running", max_tokens=100))
        await trio.sleep(0.05)
        waiting = await rt.submit(request("waiting", max_tokens=5, reproducible=True))
        await trio.sleep(0.001)
        assert waiting.state == "preparing"
        assert (await waiting.cancel()).reason == "requested"
        steps_before = engine.num_batch_steps
        outcome = await running.cancel()
        assert isinstance(outcome, Cancelled) and outcome.reason == "requested"
        assert 0 < outcome.usage.completion_tokens < 100
        await trio.sleep(2 * Script().step_s)  # the row leaves at the next step
        assert engine.num_rows == 0
        assert engine.num_batch_steps <= steps_before + 2
        assert "serial_start" not in engine.call_log


async def test_consumer_closing_its_end_cancels_consumer_closed(autojump_clock):
    async with scripted() as (rt, _engine):
        other = await rt.submit(request("other", max_tokens=12))
        handle = await rt.submit(request("closer", max_tokens=100))
        async for event in handle:
            if isinstance(event, TextDelta):
                break
        await handle.aclose()
        outcome = await handle.result()
        assert isinstance(outcome, Cancelled) and outcome.reason == "consumer_closed"
        rest = [e async for e in other]
        assert isinstance(rest[-1], Completed)
        tokens = [t for e in rest if isinstance(e, TextDelta) for t in e.token_ids]
        assert tuple(tokens) == tokens_for("other", 12)


async def test_a_stalled_consumer_neither_slows_the_batch_nor_lives_past_its_idle_timeout(
    autojump_clock,
):
    script = Script(step_s=0.01)
    # One event a step, so that the stalled row's buffers fill within the fast row's 40 steps.
    config = dict(event_buffer=4, idle_timeout_s=5.0, steps_per_call=1)
    async with scripted(script, **config) as (rt, _engine):
        stalled = await rt.submit(request("stalled", max_tokens=200))
        started = trio.current_time()
        fast = await rt.collect(request("fast", max_tokens=40))
        elapsed = trio.current_time() - started
        assert isinstance(fast.outcome, Completed)
        assert elapsed < 45 * script.step_s  # the stalled row did not hold the batch back
        stats = rt.statistics()
        assert stats.parked_rows == 1
        outcome = await stalled.result()
        assert isinstance(outcome, Cancelled) and outcome.reason == "consumer_idle"
        assert trio.current_time() - started >= 5.0
        assert rt.statistics().cancelled["consumer_idle"] == 1


async def test_a_slow_reader_gets_every_token_in_order(autojump_clock):
    async with scripted(event_buffer=2) as (rt, _):
        handle = await rt.submit(request("slow reader", max_tokens=30))
        tokens = []
        async for event in handle:
            await trio.sleep(0.1)  # ten steps per read
            if isinstance(event, TextDelta):
                tokens.extend(event.token_ids)
        assert tuple(tokens) == tokens_for("slow reader", 30)
        assert isinstance(await handle.result(), Completed)


async def test_a_reader_that_comes_back_late_for_the_outcome_is_not_left_waiting(autojump_clock):
    # Found by the operation scripts: the tokens filled a stalled reader's buffer, the session
    # gave up sending the outcome after its cleanup grace, and left the channel open, so the
    # reader, once back, waited forever after the last token.
    async with scripted(event_buffer=2, steps_per_call=1) as (rt, _engine):
        handle = await rt.submit(request("late", max_tokens=2))
        await trio.sleep(5.0)  # longer than the session's cleanup grace
        with trio.fail_after(60):
            events = [event async for event in handle]
        tokens = [t for e in events if isinstance(e, TextDelta) for t in e.token_ids]
        assert tuple(tokens) == tokens_for("late", 2)
        outcome = await handle.result()
        assert isinstance(outcome, Completed) and outcome.usage.completion_tokens == 2


async def test_the_session_inbox_keeps_order_when_its_shortcut_declines():
    # The shortcut hands an event to the consumer from the lane's task; once it declines one
    # (say the consumer's buffer is full), later events queue behind it until the session
    # has handled it, or a consumer would see them out of order.
    taken: list[RowProgress] = []
    accepting = [True]

    def shortcut(event: RowProgress) -> bool:
        if accepting[0]:
            taken.append(event)
        return accepting[0]

    inbox = SessionInbox(shortcut, buffer=8)
    events = [RowProgress(0, done, 10) for done in range(6)]
    inbox.send_nowait(events[0])
    accepting[0] = False
    inbox.send_nowait(events[1])
    accepting[0] = True
    inbox.send_nowait(events[2])
    assert taken == [events[0]]
    assert await inbox.receive() == events[1]
    inbox.handled()
    assert await inbox.receive() == events[2]
    await inbox.send(events[3])  # events[2] is not handled yet
    inbox.handled()
    assert await inbox.receive() == events[3]
    inbox.handled()
    await inbox.send(events[4])  # caught up: the shortcut again
    assert taken == [events[0], events[4]]
    inbox.close_receiver()
    assert inbox.receiver_left
    with pytest.raises(trio.BrokenResourceError):
        inbox.send_nowait(events[5])
    assert not offer(inbox, events[5])
    assert taken == [events[0], events[4]]


async def test_overload_is_refused_at_once_with_retry_after(autojump_clock):
    async with scripted(max_live=2, max_queued=1, retry_after_s=2.5) as (rt, _):
        handles = [await rt.submit(request(f"r{i}", max_tokens=5)) for i in range(3)]
        with pytest.raises(OverloadedError, match=r"retry after 2\.5 s$") as info:
            await rt.submit(request("one too many"))
        assert info.value.retry_after_s == 2.5
        assert rt.statistics().refused == 1
        for handle in handles:
            assert isinstance(await handle.result(), Completed)


async def test_invalid_requests_raise_before_admission(autojump_clock):
    async with scripted(Script(context_length=100)) as (rt, engine):
        with pytest.raises(InvalidRequestError, match="prompt must not be empty"):
            await rt.submit(GenerationRequest(""))
        with pytest.raises(InvalidRequestError, match="maximum context length"):
            await rt.submit(request("x" * 99, max_tokens=5))
        assert engine.call_log == []
        assert rt.statistics().live_sessions == 0


async def test_a_failing_step_fails_only_its_rows_and_the_runtime_keeps_serving(autojump_clock):
    async with scripted(Script(fail_batch_steps=frozenset({3}))) as (rt, _engine):
        doomed = [await rt.submit(request(f"d{i}", max_tokens=10)) for i in range(2)]
        outcomes = [await h.result() for h in doomed]
        assert all(isinstance(o, Failed) and o.code == "engine_fault" for o in outcomes)
        assert "injected failure of batch step 3" in outcomes[0].message
        after = await rt.collect(request("after", max_tokens=4))
        assert after.token_ids == tokens_for("after", 4)
        stats = rt.statistics()
        assert stats.engine_faults == 1 and stats.failed == {"engine_fault": 2}
        assert stats.is_healthy


class RefusingEngine(ScriptedEngine):
    """Refuses the rows whose prompt starts with "refuse"; the first add call with a prompt
    starting with "crash" raises as a whole."""

    crashed = False

    async def batch_add(self, requests):
        texts = ["".join(map(chr, r.prompt_tokens)) for r in requests]
        if not self.crashed and any(t.startswith("crash") for t in texts):
            self.crashed = True
            raise RuntimeError("the add call broke")
        taken = [r for r, t in zip(requests, texts, strict=True) if not t.startswith("refuse")]
        rows = iter(await super().batch_add(taken))
        return [MemoryError("no room") if t.startswith("refuse") else next(rows) for t in texts]


async def test_rows_added_in_one_call_fail_alone_or_all_together(autojump_clock):
    engine = RefusingEngine(Script())
    async with open_runtime(engine=engine, max_batch=8) as rt:
        handles = {t: await rt.submit(request(t, max_tokens=4)) for t in ("a", "refuse", "b")}
        refused = await handles["refuse"].result()
        assert isinstance(refused, Failed) and "MemoryError: no room" in refused.message
        for text in ("a", "b"):
            assert isinstance(await handles[text].result(), Completed)
        assert engine.call_log.count("batch_add") == 1  # the three arrived together

        crashed = [await rt.submit(request(f"crash {i}", max_tokens=4)) for i in range(2)]
        outcomes = [await h.result() for h in crashed]
        assert all(isinstance(o, Failed) and "the add call broke" in o.message for o in outcomes)
        after = await rt.collect(request("after", max_tokens=4))
        assert after.token_ids == tokens_for("after", 4)
        await trio.testing.wait_all_tasks_blocked()
        assert_quiescent(rt, engine)


async def test_a_failing_row_sampler_fails_only_that_row(autojump_clock):
    async with scripted(Script(row_faults={"bad": 2})) as (rt, _):
        bad = await rt.submit(request("bad", max_tokens=8))
        good = await rt.collect(request("good", max_tokens=8))
        outcome = await bad.result()
        assert isinstance(outcome, Failed) and "injected sampler failure" in outcome.message
        assert good.token_ids == tokens_for("good", 8)


async def test_deadline_covers_queue_and_decode(autojump_clock):
    async with scripted(Script(step_s=0.1), max_live=1, max_queued=1) as (rt, _):
        first = await rt.submit(request("first", max_tokens=10, timeout_s=0.45))
        queued = await rt.submit(request("queued", max_tokens=10, timeout_s=0.3))
        assert (await queued.result()).reason == "deadline"
        outcome = await first.result()
        assert isinstance(outcome, Cancelled) and outcome.reason == "deadline"
        assert 0 < outcome.usage.completion_tokens < 10


async def test_a_stuck_step_abandons_its_rows_and_marks_the_runtime_unhealthy(autojump_clock):
    script = Script(hang_batch_steps=frozenset({2}))
    async with scripted(script, step_timeout_s=10.0) as (rt, _):
        handle = await rt.submit(request("stuck", max_tokens=5))
        outcome = await handle.result()
        assert isinstance(outcome, Cancelled) and outcome.reason == "engine_fault"
        stats = rt.statistics()
        assert stats.stuck_steps == 1 and not stats.is_healthy


async def test_shutdown_finishes_within_grace_then_cancels_the_rest(autojump_clock):
    engine = ScriptedEngine(Script(step_s=0.1))
    async with open_runtime(
        engine=engine, max_batch=2, max_live=2, max_queued=4, shutdown_grace_s=1.0
    ) as rt:
        short = await rt.submit(request("short", max_tokens=3))
        long = await rt.submit(request("long", max_tokens=1000))
        queued = await rt.submit(request("queued", max_tokens=3))
    assert isinstance(await short.result(), Completed)
    assert (await long.result()).reason == "shutdown"
    assert (await queued.result()).reason == "shutdown"
    assert engine.num_rows == 0


async def test_shutdown_ends_within_its_grace_and_settle_time_behind_a_hung_step(
    autojump_clock,
):
    engine = ScriptedEngine(Script(hang_batch_steps=frozenset({2})))
    async with open_runtime(
        engine=engine, step_timeout_s=600.0, shutdown_grace_s=1.0, shutdown_settle_s=2.0
    ) as rt:
        handle = await rt.submit(request("hung", max_tokens=5))
        while engine.num_batch_steps < 2:
            await trio.sleep(0.01)
        closing = trio.current_time()
    assert trio.current_time() - closing <= 3.0  # not the step's 600 s watchdog
    outcome = await handle.result()
    assert isinstance(outcome, Cancelled) and outcome.reason == "shutdown"


async def test_run_exclusive_drains_and_run_when_idle_waits_without_draining(autojump_clock):
    async with scripted() as (rt, engine):
        handle = await rt.submit(request("rows", max_tokens=20))
        await trio.sleep(0.05)
        seen = []

        async def exclusive() -> None:
            seen.append(("exclusive", engine.num_rows))

        await rt.run_exclusive(exclusive)
        assert seen == [("exclusive", 0)]
        assert rt.statistics().drains == 1
        assert isinstance(await handle.result(), Completed)

        handle = await rt.submit(request("rows again", max_tokens=20))
        await trio.sleep(0.05)

        async def idle() -> None:
            seen.append(("idle", engine.num_rows))

        await rt.run_when_idle(idle)
        assert seen[-1] == ("idle", 0)
        assert rt.statistics().drains == 1
        assert isinstance(await handle.result(), Completed)


async def test_cancel_by_id(autojump_clock):
    async with scripted() as (rt, _):
        handle = await rt.submit(request("by id", max_tokens=100, request_id="abc"))
        await trio.sleep(0.05)
        assert rt.cancel("abc")
        assert not rt.cancel("nope")
        assert (await handle.result()).reason == "requested"


async def streamed(
    rt: RuntimeHandle, prompt: str, max_tokens: int, chunks: list[int] | None = None
) -> tuple[list[int], object]:
    """A session's tokens as its deltas bring them (each delta's count appended to
    ``chunks``), and its outcome."""
    handle = await rt.submit(request(prompt, max_tokens=max_tokens))
    tokens: list[int] = []
    async for event in handle:
        if isinstance(event, TextDelta):
            tokens.extend(event.token_ids)
            if chunks is not None:
                chunks.append(len(event.token_ids))
    return tokens, await handle.result()


@pytest.mark.parametrize(("sessions", "step_s"), [(4, 0.05), (64, 0.01)])
async def test_a_large_fast_batch_takes_several_steps_a_call_with_the_same_tokens(
    autojump_clock, sessions, step_s
):
    # 64 rows of 10 ms steps: the event loop's per-row work would be a noticeable share of a
    # step, so engine calls run several steps; 4 rows of 50 ms steps (a CPU): one step a call.
    async with scripted(Script(step_s=step_s), max_batch=64, max_live=64) as (rt, engine):
        results = {}

        async def run(i: int) -> None:
            results[i] = await streamed(rt, f"prompt {i}", 40)

        async with trio.open_nursery() as nursery:
            for i in range(sessions):
                nursery.start_soon(run, i)
        for i, (tokens, outcome) in results.items():
            assert tuple(tokens) == tokens_for(f"prompt {i}", 40)
            assert isinstance(outcome, Completed) and outcome.usage.completion_tokens == 40
        assert rt.statistics().batch_steps == engine.num_batch_calls  # engine calls, counted
        if sessions == 4:
            assert engine.num_batch_calls == engine.num_batch_steps
        else:
            assert engine.num_batch_calls < engine.num_batch_steps / 2


async def test_a_lone_stream_gets_its_tokens_as_sampled_and_a_large_batch_in_calls(
    autojump_clock,
):
    # 64 rows of 10 ms steps run several steps a call, each row's tokens handed out together;
    # a lone stream after them runs one step a call and lets the engine run ahead instead, so
    # each token goes out as it is sampled (the scripted engine runs none ahead: one a call).
    async with scripted(Script(step_s=0.01), max_batch=64, max_live=64) as (rt, engine):
        async with trio.open_nursery() as nursery:
            for i in range(64):
                nursery.start_soon(rt.collect, request(f"prompt {i}", max_tokens=60))
        assert engine.num_batch_calls < engine.num_batch_steps / 3
        calls_before = len(engine.calls)
        chunks = []
        handle = await rt.submit(request("alone", max_tokens=30))
        async for event in handle:
            if isinstance(event, TextDelta):
                chunks.append(len(event.token_ids))
    assert sum(chunks) == 30 and max(chunks) == 1
    lone = engine.calls[calls_before:]
    assert {steps for steps, _ in lone} == {1} and max(ahead for _, ahead in lone) > 1


@pytest.mark.parametrize(("sessions", "steps"), [(16, 1), (64, STEPS_APART), (96, STEPS_APART)])
async def test_an_engine_in_a_process_of_its_own_hands_out_tokens_every_step_or_two(
    autojump_clock, sessions, steps
):
    # The 10 ms steps above, the engine in a process of its own (the loop's work does not slow
    # its steps): calls let the engine run ahead, each handing out the tokens of a step (16
    # rows) or two (64 and 96, where each call costs the engine time a row); the scripted engine
    # runs none ahead, so a call runs them.
    chunks: list[int] = []

    async def run(i: int) -> None:
        tokens, _ = await streamed(rt, f"prompt {i}", 40, chunks)
        assert tuple(tokens) == tokens_for(f"prompt {i}", 40)

    apart = scripted(Script(step_s=0.01), pid=4242, max_batch=96, max_live=96)
    async with apart as (rt, engine), trio.open_nursery() as nursery:
        for i in range(sessions):
            nursery.start_soon(run, i)
    assert sum(chunks) == sessions * 40
    decoding = [steps for steps, ahead in engine.calls if ahead]
    assert max(chunks) == steps and set(decoding) == {steps}
    assert len(decoding) >= 39 // steps


async def test_several_steps_a_call_still_cancel_and_count_tokens(autojump_clock):
    async with scripted(max_batch=8, steps_per_call=4) as (rt, engine):
        running = await rt.submit(request("running", max_tokens=100))
        done = await rt.collect(request("short", max_tokens=10))
        assert done.token_ids == tokens_for("short", 10)
        assert done.outcome.usage.completion_tokens == 10
        outcome = await running.cancel()
        assert isinstance(outcome, Cancelled) and outcome.reason == "requested"
        assert 0 < outcome.usage.completion_tokens < 100
    # Four steps a call, but for the two calls that gave a row its first token.
    assert 4 * (engine.num_batch_calls - 2) <= engine.num_batch_steps < 4 * engine.num_batch_calls


async def test_a_lone_request_starts_at_once_and_a_burst_joins_the_batch_in_one_call(
    autojump_clock,
):
    async with scripted() as (rt, engine):
        calls: list[tuple[str, float]] = []
        engine.on_call = lambda name: calls.append((name, trio.current_time()))
        submitted = trio.current_time()
        await rt.collect(request("alone", max_tokens=2))
        assert calls[0] == ("batch_add", submitted)  # nothing on its way: no window to wait
        calls.clear()
        async with trio.open_nursery() as nursery:  # four on their way: the batch waits
            for i in range(4):
                nursery.start_soon(rt.collect, request(f"burst {i}", max_tokens=2))
        assert [name for name, _ in calls].count("batch_add") == 1
