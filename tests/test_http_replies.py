"""Chat replies split over HTTP (reasoning, content, tool calls), on the scripted engine with the
official openai SDK: what the model wrote reaches the client whole, in the right fields,
streamed or not. (How text splits is ``test_tools.py``'s; this is the plumbing.)"""

from __future__ import annotations

from collections.abc import Iterator

import openai
import pytest

from mlx_trio.actors.testing.scripted import ScriptedEngine, expected_tokens, token_text
from mlx_trio.api import openai_format as fmt
from mlx_trio.api.http_responses import sse
from mlx_trio.engine.vocabulary.reply import ReplySyntax
from tests.server_thread import ServerThread

MODEL = "scripted"
TOOL = {"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}}
QUESTION = "why?"  # its "?" opens a thinking block, as the syntax below says
REPLY = [token_text(t) for t in expected_tokens(tuple(ord(c) for c in QUESTION), 8)]
# The scripted reply's third token ends its thinking.
SYNTAX = ReplySyntax(think=("<think>", REPLY[2]), think_ids=((ord("?"),), (ord("!"),)))


@pytest.fixture(scope="module")
def sdk() -> Iterator[openai.OpenAI]:
    with ServerThread(engine=ScriptedEngine(reply_syntax=SYNTAX)) as server:
        yield openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused")


def ask(content: str, **extra) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": content}]} | extra


def test_a_reply_that_opens_thinking_splits_into_reasoning_and_content(sdk):
    reply = sdk.chat.completions.create(**ask(QUESTION, max_tokens=8))
    message = reply.choices[0].message
    assert message.reasoning_content == "".join(REPLY[:2])  # type: ignore[attr-defined]
    assert message.content == "".join(REPLY[3:])
    stream = sdk.chat.completions.create(**ask(QUESTION, max_tokens=8, stream=True))
    deltas = [c.choices[0].delta for c in stream if c.choices]
    reasoning = "".join(getattr(d, "reasoning_content", None) or "" for d in deltas)
    assert reasoning == "".join(REPLY[:2])
    assert "".join(d.content or "" for d in deltas) == "".join(REPLY[3:])


def test_a_prompt_that_does_not_open_thinking_is_all_content(sdk):
    reply = sdk.chat.completions.create(**ask("how", max_tokens=6))
    expected = [token_text(t) for t in expected_tokens(tuple(ord(c) for c in "how"), 6)]
    assert reply.choices[0].message.content == "".join(expected)
    assert getattr(reply.choices[0].message, "reasoning_content", None) is None


@pytest.mark.parametrize("stream", [False, True])
def test_tools_offered_leave_a_reply_without_calls_whole_with_its_logprobs(sdk, stream):
    reply = sdk.chat.completions.create(
        **ask("plain", max_tokens=7, tools=[TOOL], logprobs=True, stream=stream)
    )
    expected = "".join(token_text(t) for t in expected_tokens(tuple(ord(c) for c in "plain"), 7))
    choices = [c.choices[0] for c in reply if c.choices] if stream else reply.choices  # type: ignore[union-attr]
    text = "".join((c.delta.content if stream else c.message.content) or "" for c in choices)
    assert text == expected
    assert [c.finish_reason for c in choices][-1] == "length"
    assert all(not (c.delta if stream else c.message).tool_calls for c in choices)
    records = [r for c in choices if c.logprobs for r in c.logprobs.content or []]
    assert "".join(r.token for r in records) == expected  # held text's logprobs still sent


@pytest.mark.parametrize("kind", ["chat", "completion"])
def test_a_text_chunk_from_the_template_is_the_chunk_itself(kind):
    ids = {"request_id": 'chatcmpl-"1"', "created": 1_700_000_000, "model": "org/modèle"}
    chunks = fmt.TextChunks(kind, **ids)
    for index in (0, 3):
        for text in ["", "Paris", 'a "quote", a \\ and a\nnewline', "é 日本 🙂", "\x00\x1f\x7f"]:
            want = sse(fmt.chunk_body(kind, index=index, text=text, **ids))
            assert chunks(index, text) == want
