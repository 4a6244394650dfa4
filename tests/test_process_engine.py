"""The engine in a process of its own (``ProcessEngine``): the same port as the engine thread's,
and a child that dies, or fails to start, costs requests an error and nothing more."""

from __future__ import annotations

import multiprocessing
import os
import signal
import socket
from dataclasses import replace
from multiprocessing.connection import Connection

import pytest
import trio

from mlx_trio.actors.engine_port.process import open_process_engine, take_frame
from mlx_trio.actors.engine_port.thread import EngineThread, ThreadedEngine
from mlx_trio.actors.messages import Cancelled, Completed, Failed, GenerationRequest, TextDelta
from mlx_trio.actors.port import EnginePort
from mlx_trio.api.inprocess import open_runtime
from mlx_trio.engine.errors import EngineUnavailableError, UnsupportedModelError
from mlx_trio.engine.options import CoreRecipe
from mlx_trio.engine.outputs import RowOutput
from mlx_trio.engine.params import PreparedRequest, SamplingParams, Speculation
from mlx_trio.engine.vocabulary.prompt import ChatMessage
from tests.tiny import build_engine, build_nothing, make_preparer


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens)


async def calls_and_their_tokens(port: EnginePort) -> tuple[list[object], dict[int, list]]:
    """The same batch calls on any port: what each returned, and each row's token ids."""
    tokens: dict[int, list[int]] = {}
    answers: list[object] = []

    def keep(events: list) -> None:
        for event in events:
            if isinstance(event, RowOutput):
                tokens.setdefault(event.row, []).extend(event.delta.token_ids)

    requests = [PreparedRequest(tuple(range(5 + i, 12 + 2 * i)), greedy(12)) for i in range(3)]
    rows = await port.batch_add(requests)
    answers.append(rows)
    keep(await port.batch_step(3))
    answers.append((port.num_rows, port.kv_bytes > 0))
    answers.append(await port.batch_park(rows[1]))
    keep(await port.batch_step(2))
    await port.batch_resume(rows[1])
    await port.batch_remove([rows[2]])
    for _ in range(20):
        keep(await port.batch_step(4))
    answers.append(port.num_rows)
    return answers, tokens


async def test_the_port_answers_each_batch_call_as_the_engine_thread_does(tiny_engine):
    with EngineThread() as thread:
        threaded = ThreadedEngine.over(tiny_engine, thread, max_batch=4)
        await threaded.batch_reset()
        answers, tokens = await calls_and_their_tokens(threaded)
    async with open_process_engine(CoreRecipe(build_engine, max_batch=4), make_preparer()) as port:
        assert port.pid != os.getpid() and port.model_id == "tiny-llama"
        answers_there, tokens_there = await calls_and_their_tokens(port)
    assert answers_there == answers
    # Rows 0 and 1 ran to max_tokens, the same tokens. Row 2 was removed on its way: how many
    # it got first depends on how many steps the engine had run ahead (they are dropped).
    assert [tokens_there[0], tokens_there[1]] == [tokens[0], tokens[1]]
    assert [len(tokens[0]), len(tokens[1])] == [12, 12]
    shorter = min(len(tokens[2]), len(tokens_there[2]))
    assert 0 < shorter < 12 and tokens_there[2][:shorter] == tokens[2][:shorter]


async def test_sessions_through_an_engine_process_complete_and_it_ends_with_the_runtime():
    async with open_process_engine(CoreRecipe(build_engine, max_batch=4), make_preparer()) as port:
        async with open_runtime(engine=port, max_batch=4) as rt:
            # Ctrl+C reaches the whole process group; the server drains, the child must not die.
            os.kill(port.pid, signal.SIGINT)  # type: ignore[arg-type]
            results = []

            async def one(text: str, reproducible: bool) -> None:
                request = GenerationRequest(text, greedy(8), reproducible=reproducible)
                results.append(await rt.collect(request))

            async with trio.open_nursery() as nursery:
                for i in range(3):
                    nursery.start_soon(one, f"the {i}", False)
            await one("the serial one", True)
        assert [r.outcome.lane for r in results] == ["batch"] * 3 + ["serial"]
        assert all(isinstance(r.outcome, Completed) and r.token_ids for r in results)
    assert port.exitcode == 0


async def test_a_speculative_request_through_an_engine_process_counts_its_drafts():
    prompt = "the cat sat on the mat and the dog sat on the log; " * 3
    plain = greedy(40)
    fast = replace(plain, speculative=Speculation("prompt_lookup"))
    recipe = CoreRecipe(build_engine, max_batch=4)
    async with (
        open_process_engine(recipe, make_preparer()) as port,
        open_runtime(engine=port, max_batch=4) as rt,
    ):
        results = [
            await rt.collect(GenerationRequest(prompt, params, reproducible=True))
            for params in (plain, fast)
        ]
    assert results[1].token_ids == results[0].token_ids
    usage = [r.outcome.usage for r in results if isinstance(r.outcome, Completed)]
    assert usage[0].drafted_tokens == 0 and 0 < usage[1].accepted_tokens <= usage[1].drafted_tokens


async def test_a_killed_engine_process_fails_each_request_once_and_the_runtime_still_closes():
    async with (
        open_process_engine(CoreRecipe(build_engine, max_batch=4), make_preparer()) as port,
        open_runtime(engine=port, max_batch=4) as rt,
    ):
        outcomes: list[object] = []

        async def stream(index: int) -> None:
            handle = await rt.submit(GenerationRequest(f"the {index}", greedy(400)))
            deltas = 0
            async with handle:
                async for event in handle:
                    if isinstance(event, TextDelta):
                        deltas += 1
                        if index == 0 and deltas == 2:
                            os.kill(port.pid, signal.SIGKILL)  # type: ignore[arg-type]
                    elif isinstance(event, Completed | Failed | Cancelled):
                        outcomes.append(event)

        async with trio.open_nursery() as nursery:
            for index in range(3):
                nursery.start_soon(stream, index)
        assert len(outcomes) == 3
        assert all(isinstance(o, Failed) and o.code == "engine_fault" for o in outcomes)
        assert "engine process exited" in outcomes[0].message  # type: ignore[attr-defined]
        # Unsupervised, the engine is down for good: later requests, on either lane, are
        # refused at once with the reason, and so is every call.
        assert port.liveness().condition == "down"
        for reproducible in (False, True):
            request = GenerationRequest(
                (ChatMessage("user", "hi"),), greedy(4), reproducible=reproducible
            )
            with pytest.raises(EngineUnavailableError, match="engine process exited"):
                await rt.collect(request)
        assert not rt.statistics().is_healthy
        with pytest.raises(EngineUnavailableError):
            await port.batch_step()
    assert port.exitcode == -signal.SIGKILL


async def test_an_engine_that_cannot_be_built_raises_its_own_error_and_leaves_no_process():
    # Another module's server may keep its engine process for the session (tests/conftest.py).
    before = set(multiprocessing.active_children())
    with pytest.raises(UnsupportedModelError, match="'nothing' is not supported"):
        async with open_process_engine(CoreRecipe(build_nothing, max_batch=2), None):
            pytest.fail("the engine process started")
    assert set(multiprocessing.active_children()) <= before


@pytest.mark.parametrize("size", [0, 7, 40_000])
def test_a_message_arriving_in_pieces_is_read_whole_in_multiprocessings_framing(size):
    ours, theirs = socket.socketpair()
    payloads = [bytes(range(256)) * (size // 256) + b"x" * (size % 256), b"next"]
    sent = Connection(os.dup(theirs.fileno()))
    for payload in payloads:
        sent.send_bytes(payload)
    sent.close()
    theirs.close()
    buffer, received = bytearray(), []
    with ours:
        while data := ours.recv(3):  # a few bytes at a time: every split of the header too
            buffer += data
            while (payload := take_frame(buffer)) is not None:
                received.append(payload)
    assert received == payloads and not buffer


@pytest.mark.e2e
async def test_the_default_model_in_an_engine_process_answers_as_on_the_engine_thread():
    questions = ["What is the capital of France?", "Name three colors.", "What is 2 + 2?"]

    async def answers(engine_process: bool) -> list[tuple[str, tuple[int, ...]]]:
        async with open_runtime(max_batch=4, engine_process=engine_process) as rt:
            requests = [GenerationRequest((ChatMessage("user", q),), greedy(16)) for q in questions]
            results: dict[int, object] = {}

            async def one(index: int) -> None:
                results[index] = await rt.collect(requests[index])

            async with trio.open_nursery() as nursery:
                for index in range(len(requests)):
                    nursery.start_soon(one, index)
            serial = await rt.collect(
                GenerationRequest(
                    (ChatMessage("user", questions[0]),), greedy(16), reproducible=True
                )
            )
            done = [results[i] for i in range(len(requests))] + [serial]
            assert all(isinstance(r.outcome, Completed) for r in done)  # type: ignore[attr-defined]
            return [(r.text, tuple(r.token_ids)) for r in done]  # type: ignore[attr-defined]

    in_a_process = await answers(True)
    assert in_a_process == await answers(False)
    assert "Paris" in in_a_process[0][0]
