"""The batch's token budget: the rules on their own, the runtime over the scripted engine
stepping by them, and the real batch engine's greedy output under a small budget."""

from __future__ import annotations

import pytest
import trio

from mlx_trio.actors.messages import Completed, GenerationRequest, TextDelta
from mlx_trio.actors.testing.scripted import Script, ScriptedEngine
from mlx_trio.api.inprocess import open_runtime
from mlx_trio.engine.batch.schedule import MIN_CHUNK, TokenBudget, default_budget
from mlx_trio.engine.errors import InvalidRequestError
from mlx_trio.engine.params import SamplingParams

# -- the rules -------------------------------------------------------------------------------


def test_prompts_join_in_order_while_the_preparation_budget_holds():
    budget = TokenBudget(max_preparation_tokens=1000, max_iteration_tokens=256)
    assert budget.prompts_to_prepare([], [400, 400, 400]) == 2
    assert budget.prompts_to_prepare([700], [200, 50]) == 2
    assert budget.prompts_to_prepare([700], [400, 50]) == 0  # no overtaking the long one
    assert budget.prompts_to_prepare([], [5000, 10]) == 1  # one always may, however long
    assert budget.prompts_to_prepare([5000], [10]) == 0


def test_an_iteration_reserves_a_token_per_decoding_row_and_shares_the_rest():
    budget = TokenBudget(max_preparation_tokens=4096, max_iteration_tokens=512, max_chunk=256)
    assert budget.chunk(decoding=0, preparing=1) == 256  # bounded by the largest chunk
    assert budget.chunk(decoding=0, preparing=8) == 256  # no rhythm to keep: whole chunks
    assert budget.chunk(decoding=12, preparing=4) == 120  # 125, to a multiple of 256 / 32
    assert budget.chunk(decoding=13, preparing=4) == 120  # the same shape as rows come and go
    assert budget.chunk(decoding=500, preparing=2) == MIN_CHUNK  # prompts still move


def test_each_device_has_its_budget_and_a_flag_overrides_one_limit():
    cpu, gpu = default_budget("cpu"), default_budget("gpu")
    assert gpu.max_chunk > cpu.max_chunk and gpu.max_iteration_tokens > cpu.max_iteration_tokens
    assert default_budget("gpu", iteration=1000) == TokenBudget(
        gpu.max_preparation_tokens, 1000, gpu.max_chunk, gpu.alone_from
    )
    # Long prompts prefill one row at a time on a GPU only; 0 turns that off, a count moves it.
    assert gpu.alone_from is not None and cpu.alone_from is None
    assert default_budget("gpu", alone_from=0).alone_from is None
    assert default_budget("cpu", alone_from=300).prefills_alone(300)
    assert not default_budget("cpu", alone_from=300).prefills_alone(299)
    message = r"^max_preparation_tokens must be at least 1, got 0$"
    with pytest.raises(InvalidRequestError, match=message) as refused:
        TokenBudget(0, 256)
    assert refused.value.param == "max_preparation_tokens"


# -- the runtime over the scripted engine -----------------------------------------------------

BUDGET = TokenBudget(max_preparation_tokens=1000, max_iteration_tokens=200, max_chunk=128)


def long_prompt(i: int, length: int = 450) -> str:
    return f"[{i}] " + "x" * (length - 5)


async def test_a_burst_of_long_prompts_never_exceeds_the_preparation_budget(autojump_clock):
    engine = ScriptedEngine(Script(step_s=0.01, budget=BUDGET))
    results: list[object] = []
    async with open_runtime(engine=engine, max_batch=16) as rt, trio.open_nursery() as nursery:

        async def one(i: int) -> None:
            request = GenerationRequest(long_prompt(i), SamplingParams(max_tokens=8))
            results.append((await rt.collect(request)).outcome)

        for i in range(12):
            nursery.start_soon(one, i)
    assert len(results) == 12 and all(isinstance(o, Completed) for o in results)
    prepared = [tokens for _, tokens, _ in engine.iterations]
    assert max(prepared) <= BUDGET.max_preparation_tokens
    assert max(prepared) > BUDGET.max_preparation_tokens // 2  # prompts were prepared together
    for decoding, _, prompt_tokens in engine.iterations:
        if decoding:  # beside decoding rows an iteration keeps to its budget
            assert decoding + prompt_tokens <= BUDGET.max_iteration_tokens


async def test_a_decoding_row_gets_a_token_every_iteration_while_a_prompt_is_prepared(
    autojump_clock,
):
    engine = ScriptedEngine(Script(step_s=0.01, budget=BUDGET))
    steps_with_a_token: list[int] = []
    async with open_runtime(engine=engine, max_batch=8, steps_per_call=1) as rt:
        short = await rt.submit(GenerationRequest("short", SamplingParams(max_tokens=200)))
        async for _ in short:  # its first token: it decodes now
            break
        first_long_step = engine.num_batch_steps
        longs = [
            await rt.submit(GenerationRequest(long_prompt(i, 900), SamplingParams(max_tokens=2)))
            for i in range(3)
        ]
        async for _ in short:
            steps_with_a_token.append(engine.num_batch_steps)
            if all(h.state == "done" for h in longs):
                break
        await short.cancel()
    prefill_steps = [n for n, (_, prepared, _) in enumerate(engine.iterations, 1) if prepared > 0]
    during = [n for n in prefill_steps if n > first_long_step]
    assert len(during) >= 3 * 900 // BUDGET.max_iteration_tokens  # the prompts took a while
    assert set(during) <= set(steps_with_a_token)  # and the short row stepped in every one


async def test_while_a_prompt_is_prepared_calls_are_single_steps_and_tokens_are_not_held(
    autojump_clock,
):
    # 48 rows of 10 ms steps: calls run several steps, each row's tokens come in a chunk of
    # them. While long prompts are prepared, each step is long on a real engine, and a call of
    # several would hold every decoding row's tokens for all of them: one step a call then.
    engine = ScriptedEngine(Script(step_s=0.01, budget=BUDGET))
    async with open_runtime(engine=engine, max_batch=64, max_live=64) as rt:
        rows = [
            await rt.submit(GenerationRequest(f"short {i}", SamplingParams(max_tokens=400)))
            for i in range(48)
        ]
        watched = rows[0]
        chunks_before: list[int] = []
        async for event in watched:
            if isinstance(event, TextDelta):
                chunks_before.append(len(event.token_ids))
            if len(chunks_before) == 20:
                break
        prepared = trio.Event()

        async def long_prompts() -> None:
            async with trio.open_nursery() as nursery:
                for i in range(3):
                    prompt = GenerationRequest(long_prompt(i, 900), SamplingParams(max_tokens=1))
                    nursery.start_soon(rt.collect, prompt)
            prepared.set()

        chunks_during: list[int] = []
        async with trio.open_nursery() as nursery:
            nursery.start_soon(long_prompts)
            async for event in watched:
                if isinstance(event, TextDelta):
                    chunks_during.append(len(event.token_ids))
                if prepared.is_set():
                    break
        for handle in rows:
            handle.cancel_nowait()
    assert max(chunks_before[-5:]) > 1  # several steps a call before the prompts came
    assert len(chunks_during) >= 3 * 900 // BUDGET.max_iteration_tokens
    assert max(chunks_during[1:-1]) == 1  # one token at a time while they were prepared


async def test_cancelling_a_row_mid_prefill_frees_its_place_at_the_next_iteration(
    autojump_clock,
):
    budget = TokenBudget(max_preparation_tokens=1000, max_iteration_tokens=100, max_chunk=100)
    engine = ScriptedEngine(Script(step_s=0.01, budget=budget))
    async with open_runtime(engine=engine, max_batch=8, steps_per_call=1) as rt:
        first = await rt.submit(
            GenerationRequest(long_prompt(0, 900), SamplingParams(max_tokens=2))
        )
        second = await rt.submit(
            GenerationRequest(long_prompt(1, 900), SamplingParams(max_tokens=2))
        )
        while engine.num_batch_steps < 3:
            await trio.sleep(0.001)
        assert [t for _, t, _ in engine.iterations][-1] <= 900  # only the first is prepared
        await first.cancel()
        in_flight = engine.num_batch_steps  # a step that began before the cancel, if any
        while len(engine.iterations) <= in_flight:
            await trio.sleep(0.001)
        # The next iteration after it prepares the second prompt in the first one's place.
        assert engine.iterations[in_flight][1] == len(long_prompt(1, 900))
        outcome = await second.result()
    assert isinstance(outcome, Completed)


async def test_the_runtime_reports_tokens_prefilled_and_decoded_and_each_prefill_time(
    autojump_clock,
):
    engine = ScriptedEngine(Script(step_s=0.01, budget=BUDGET))
    async with open_runtime(engine=engine, max_batch=4) as rt:
        request = GenerationRequest(long_prompt(0), SamplingParams(max_tokens=10))
        outcome = (await rt.collect(request)).outcome
        stats = rt.statistics()
        assert (stats.prefilled_tokens, stats.decoded_tokens) == (len(long_prompt(0)), 10)
        assert stats.prefill_tokens_per_s > 0 and stats.decode_tokens_per_s > 0
        assert isinstance(outcome, Completed)
        timings = outcome.timings
        assert timings.prefill_s is not None and timings.prefill_s >= 4 * 0.01  # 4 chunks
        assert timings.queued_s + timings.prefill_s == pytest.approx(timings.ttft_s)
        await trio.sleep(11)  # idle for longer than the rates' window
        stats = rt.statistics()
        assert stats.decode_tokens_per_s == 0 and stats.decoded_tokens == 10
