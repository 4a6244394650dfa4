"""A caller's cancel scope that expires around ``open_runtime`` while streams are open (a
timeout, Ctrl-C): every stream ends ``Cancelled(shutdown)``, nothing stays held, and the block
returns within the grace (issue 34: it hung in ``shutdown`` for good, or raised the
AssertionError "a session ends with its outcome")."""

from __future__ import annotations

import pytest
import trio

from mlx_trio.actors.messages import Cancelled, GenerationRequest
from mlx_trio.actors.scripted import Script, ScriptedEngine
from mlx_trio.api.inprocess import SessionHandle, open_runtime
from mlx_trio.engine.params import SamplingParams

GRACE_S = 2.0


async def open_streams_then_expire(
    engine: object,
    *,
    num_streams: int,
    expire_after_s: float,
    params: SamplingParams | None = None,
    **config: object,
) -> tuple[list[SessionHandle], list[object], float]:
    """Open ``num_streams`` (some decode, some queue), read them, and let a cancel scope
    around the runtime expire; the handles, the outcomes read, and how long the block took
    past its deadline to return."""
    handles: list[SessionHandle] = []
    outcomes: list[object] = []

    async def read(handle: SessionHandle) -> None:
        async for event in handle:
            if isinstance(event, Cancelled):
                outcomes.append(event)

    with trio.move_on_after(expire_after_s) as outer:
        async with open_runtime(engine=engine, shutdown_grace_s=GRACE_S, **config) as rt:
            for i in range(num_streams):
                asked = params or SamplingParams(max_tokens=400, temperature=0)
                handles.append(await rt.submit(GenerationRequest(f"prompt {i}", asked)))
            async with trio.open_nursery() as readers:
                for handle in handles:
                    readers.start_soon(read, handle)
    assert outer.cancelled_caught
    return handles, outcomes, trio.current_time() - outer.deadline


@pytest.mark.parametrize("seed", range(10))
async def test_an_outer_cancel_ends_every_stream_and_returns(autojump_clock, seed):
    engine = ScriptedEngine(Script(step_s=0.01 + seed * 0.003))
    with trio.fail_after(60):  # the hang: under the autojump clock, at once
        handles, _, late_s = await open_streams_then_expire(
            engine, num_streams=6, expire_after_s=0.05 + seed * 0.02, max_batch=4, max_live=4
        )
    assert late_s <= GRACE_S + 5  # the grace, the cleanup's bounds and the last step
    assert all(h.state == "terminal" for h in handles)
    for handle in handles:
        outcome = await handle.result()
        assert isinstance(outcome, Cancelled) and outcome.reason == "shutdown"


async def test_an_outer_cancel_on_the_real_engine_returns(tiny_engine):
    from mlx_trio.actors.engine_port.thread import EngineThread, ThreadedEngine

    with EngineThread() as thread:
        engine = ThreadedEngine(tiny_engine, thread, max_batch=4)
        # The tiny model may end a reply at once: its end tokens are kept out.
        never_end = {t: -100.0 for t in tiny_engine.tokenizer.eos_token_ids}
        params = SamplingParams(max_tokens=480, temperature=0, logit_bias=never_end)
        with trio.fail_after(60):
            handles, _, _ = await open_streams_then_expire(
                engine, num_streams=6, expire_after_s=0.3, params=params, max_batch=4, max_live=4
            )
    for handle in handles:
        outcome = await handle.result()
        assert isinstance(outcome, Cancelled) and outcome.reason == "shutdown", outcome
