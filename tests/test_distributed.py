"""The engine over several ranks (``mx.distributed`` on the ring backend, started by
``mlx.launch``) with the embedded default model: 3 ranks tensor-parallel (its 9 query and 3 KV
heads divide over 3) and 2 ranks pipeline-parallel give one process's greedy tokens, on the
serial lane and in a batch (over pipeline ranks with a cancellation and a disconnect); a rank
killed mid-request ends it ``engine_fault``, ``/health`` turns 503, and the supervisor starts a
new group; a rank killed while the group is idle is noticed at once, not at the next request."""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
import trio

from mlx_trio.actors.config import RuntimeConfig
from mlx_trio.api import (
    Cancelled,
    ChatMessage,
    Completed,
    GenerationRequest,
    SamplingParams,
    TextDelta,
    open_runtime,
)
from mlx_trio.api.server import ServeOptions
from mlx_trio.engine.options import EngineOptions
from mlx_trio.engine.ranks.rank_group import RankGroup
from tests.server_thread import ServerThread, ask, health, wait_for

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

# Few and short: 3 ranks on CI's 2 cores take about a second a step, and what is shown (the
# ranks' tokens are one process's, through a cancel and a disconnect) needs no more.
QUESTIONS = [
    "What is the capital of France?",
    "Name a color.",
    "Count to three.",
    "What is 2 + 2?",
    "Name an animal.",
]
CANCELLED, DISCONNECTED = 1, 2  # of the batch
MAX_TOKENS = 4
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, logprobs=True, top_logprobs=2)
NEAR_TIE = 0.05  # nats between the top two where the ranks' sum order may pick either
# Several ranks share 2 cores in CI: a step takes seconds, not the watchdog's default.
SLOW_STEPS = {"step_timeout_s": 120.0}


def chat(question: str) -> tuple[ChatMessage, ...]:
    return (ChatMessage("user", question),)


@pytest.fixture(scope="module")
def one_process() -> dict[str, list[int]]:
    """Each question's greedy tokens from one process (the engine's own solo generation)."""
    from mlx_trio.engine.generate import Engine

    engine = Engine.load(None, prompt_cache_bytes=0)
    return {
        q: [t for d in engine.generate(engine.prepare(chat(q), GREEDY)) for t in d.token_ids]
        for q in QUESTIONS
    }


def same_or_near_tie(tokens: list[int], logprobs: list, expected: list[int]) -> None:
    """``tokens`` are ``expected``, up to the first place where they part on a near-tie (the
    other rank count sums in another order): there the expected token is the runner-up, within
    ``NEAR_TIE`` of the top; after it the texts may differ."""
    for i, (got, want) in enumerate(zip(tokens, expected, strict=False)):
        if got == want:
            continue
        top = dict(logprobs[i].top)
        assert want in top and top[got] - top[want] < NEAR_TIE, (i, tokens, expected)
        return
    assert len(tokens) == len(expected)


async def collect(handle) -> tuple[list[int], list, object]:
    tokens, logprobs = [], []
    async for event in handle:
        if isinstance(event, TextDelta):
            tokens += event.token_ids
            logprobs += event.logprobs or ()
    return tokens, logprobs, await handle.result()


@pytest.mark.parametrize(
    ("ranks", "questions", "stopped"),
    # A cancel and a disconnect are the lockstep's, the same at any rank count: shown over
    # pipeline ranks. Tensor ranks (a second a step on CI's 2 cores) show their sums' tokens
    # in a batch of three.
    [
        (RankGroup(3, "tensor"), QUESTIONS[:3], set()),
        (RankGroup(2, "pipeline"), QUESTIONS, {CANCELLED, DISCONNECTED}),
    ],
    ids=["tensor-3", "pipeline-2"],
)
async def test_ranks_give_one_process_greedy_tokens_through_cancel_and_disconnect(
    ranks, questions, stopped, one_process
):
    async with open_runtime(ranks=ranks, max_batch=8, **SLOW_STEPS) as rt:
        # The serial lane.
        handle = await rt.submit(GenerationRequest(chat(QUESTIONS[0]), GREEDY, reproducible=True))
        tokens, logprobs, outcome = await collect(handle)
        assert isinstance(outcome, Completed)
        same_or_near_tie(tokens, logprobs, one_process[QUESTIONS[0]])

        # A batch: one cancelled and one whose reader goes away after a first token.
        handles = [await rt.submit(GenerationRequest(chat(q), GREEDY)) for q in questions]
        results: dict[int, tuple[list[int], list, object]] = {}

        async def read(i: int) -> None:
            if i in stopped:
                async for event in handles[i]:
                    if isinstance(event, TextDelta):
                        break
                if i == CANCELLED:
                    await handles[i].cancel()
                else:
                    await handles[i].aclose()
                results[i] = ([], [], await handles[i].result())
            else:
                results[i] = await collect(handles[i])

        async with trio.open_nursery() as nursery:
            for i in range(len(handles)):
                nursery.start_soon(read, i)
        for i, question in enumerate(questions):
            if i not in stopped:
                tokens, logprobs, outcome = results[i]
                assert isinstance(outcome, Completed), outcome
                same_or_near_tie(tokens, logprobs, one_process[question])
        if not stopped:
            return
        cancelled, disconnected = results[CANCELLED][2], results[DISCONNECTED][2]
        assert isinstance(cancelled, Cancelled) and cancelled.reason == "requested"
        assert isinstance(disconnected, Cancelled) and disconnected.reason == "consumer_closed"

        # The ranks are still in step after them.
        tokens, logprobs, _ = await collect(
            await rt.submit(GenerationRequest(chat(QUESTIONS[3]), GREEDY))
        )
        same_or_near_tie(tokens, logprobs, one_process[QUESTIONS[3]])


def rank_pids(rank: int) -> list[int]:
    """Processes of ``python -m mlx_trio.engine.ranks.rank`` that mlx.launch made rank ``rank``.

    Not a rank's own fork before it execs (MLX's ``system("g++ --version")``, ctypes'
    ``ldconfig -p``): it has the rank's command line and environment for a moment, longer on a
    loaded machine, and is no rank."""
    found: dict[int, int] = {}  # pid: parent's pid
    for proc in Path("/proc").iterdir():
        try:
            command = (proc / "cmdline").read_bytes()
            environ = (proc / "environ").read_bytes().split(b"\0")
            parent = int((proc / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        if b"mlx_trio.engine.ranks.rank" in command and f"MLX_RANK={rank}".encode() in environ:
            found[int(proc.name)] = parent
    return [pid for pid, parent in found.items() if parent not in found]


@pytest.fixture(scope="module")
def pipeline_server() -> Iterator[ServerThread]:
    """One server on 2 pipeline ranks for both kill tests: each kills a rank of the group it
    finds and counts the restarts and failures its kill added."""
    runtime = RuntimeConfig(max_batch=4, **SLOW_STEPS)
    options = ServeOptions(engine=EngineOptions(ranks=RankGroup(2, "pipeline")), runtime=runtime)
    with ServerThread(options) as server:
        wait_for(lambda: health(server.url) == 200, 180, "the ranks came up")
        yield server


def counters(server: ServerThread) -> tuple[int, dict[str, int]]:
    """The engine's restarts and the failed requests by reason, as ``/v1/stats`` says."""
    stats = httpx.get(f"{server.url}/v1/stats").json()
    return stats["engine"]["restarts"], stats["failed"]


def test_a_rank_killed_mid_request_fails_it_and_the_group_restarts(pipeline_server):
    server = pipeline_server
    wait_for(lambda: health(server.url) == 200, 180, "the ranks are up")
    restarts, failed = counters(server)
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)
    model = client.models.list().data[0].id
    stream = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "Tell me a long story about a dragon."}],
        max_tokens=200,
        temperature=0,
        stream=True,
    )
    chunks = iter(stream)
    next(chunks)  # under way
    (pid,) = rank_pids(1)
    os.kill(pid, signal.SIGKILL)
    with pytest.raises(openai.APIError):  # the stream ends in an error, not in silence
        for _ in chunks:
            pass
    assert wait_for(lambda: health(server.url) == 503, 5, "/health turned 503") < 5
    faults = failed.get("engine_fault", 0)
    assert counters(server)[1] == {**failed, "engine_fault": faults + 1}
    wait_for(lambda: health(server.url) == 200, 180, "a new group started")
    assert "Paris" in ask(client, model, "What is the capital of France?", max_tokens=12)
    assert counters(server)[0] == restarts + 1


def test_a_rank_killed_while_idle_restarts_the_group(pipeline_server):
    """No step in flight, so rank 0 learns nothing from the collectives: ``mlx.launch`` ends it
    (SIGTERM), and the runtime sees the group die at once rather than at the next request."""
    server = pipeline_server
    wait_for(lambda: health(server.url) == 200, 180, "the ranks are up")
    restarts, failed = counters(server)
    (pid,) = rank_pids(1)
    os.kill(pid, signal.SIGKILL)
    wait_for(lambda: health(server.url) == 503, 30, "/health turned 503")
    wait_for(lambda: health(server.url) == 200, 180, "a new group started")
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)
    model = client.models.list().data[0].id
    assert "Paris" in ask(client, model, "What is the capital of France?", max_tokens=12)
    assert counters(server) == (restarts + 1, failed)  # nothing was in flight to lose
