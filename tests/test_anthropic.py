"""The Anthropic Messages API over the real server and the scripted engine, through the official
``anthropic`` SDK (which parses every body and event: a malformed one fails the test) and raw
httpx: shapes, thinking and tool-use blocks, stop reasons, streaming, count_tokens, Anthropic's
error shape for each status, auth by ``x-api-key``, and cancellation on disconnect.

The scripted engine's tokens are the prompt's characters (``ord(c)``, the messages' contents
joined by newlines) and its reply is a pure function of them; the reply syntax below marks
tokens of known replies as the end of a thinking block and as tool-call markers."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import anthropic
import httpx
import openai
import pytest

from mlx_trio.actors.config import RuntimeConfig
from mlx_trio.actors.testing.scripted import Script, ScriptedEngine, expected_tokens, token_text
from mlx_trio.api.http_state import HttpSettings
from mlx_trio.api.server import ServeOptions
from mlx_trio.engine.vocabulary.reply import ReplySyntax
from tests.server_thread import ServerThread, wait_for

MODEL = "claude-test"
KEY = "sk-ant-test"


def reply_to(prompt: str, n: int) -> list[str]:
    """The scripted engine's first ``n`` token texts in reply to ``prompt``."""
    return [token_text(t) for t in expected_tokens(tuple(ord(c) for c in prompt), n)]


QUESTION = "why?"  # its "?" opens a thinking block, as the syntax below says
THOUGHT = reply_to(QUESTION, 8)
CALLER = "look it up"  # the reply's second token opens a tool call, its fourth closes it
CALL = reply_to(CALLER, 8)
LOOKUP = {
    "name": "lookup",
    "description": "Look a word up.",
    "input_schema": {"type": "object", "properties": {"q": {"type": "string"}}},
}


def parse_call(text: str, tools: Any) -> dict[str, Any]:
    return {"name": "lookup", "arguments": {"q": text.strip()}}


SYNTAX = ReplySyntax(
    think=("<think>", THOUGHT[2]),
    think_ids=((ord("?"),), (ord("!"),)),
    native_calls=(CALL[1], CALL[3]),
    native_parser=parse_call,
)


@pytest.fixture(scope="module")
def server() -> Iterator[ServerThread]:
    options = ServeOptions(
        runtime=RuntimeConfig(max_batch=8, max_live=64, max_queued=64),
        http=HttpSettings(served_model_names=(MODEL,), api_keys=(KEY,)),
    )
    engine = ScriptedEngine(Script(step_s=0.002), reply_syntax=SYNTAX)
    with ServerThread(options, engine=engine) as running:
        running.wait_healthy()
        yield running


@pytest.fixture(scope="module")
def sdk(server: ServerThread) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.url, api_key=KEY, max_retries=0)


@pytest.fixture
def http(server: ServerThread) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.url, headers={"x-api-key": KEY}, timeout=30) as client:
        yield client


def user(text: str) -> list[dict[str, Any]]:
    return [{"role": "user", "content": text}]


def blocks(message: Any) -> list[dict[str, Any]]:
    """A message's content blocks as their JSON (streamed messages' blocks are a subclass)."""
    return [b.model_dump(exclude={"parsed_output"}, exclude_none=True) for b in message.content]


# -- replies ----------------------------------------------------------------------------


def test_a_text_turn_answers_a_message_with_usage(sdk: anthropic.Anthropic):
    message = sdk.messages.create(model=MODEL, max_tokens=6, messages=user("hello"))
    assert message.id.startswith("msg_")
    assert message.model == MODEL and message.role == "assistant"
    assert [b.type for b in message.content] == ["text"]
    assert message.content[0].text == "".join(reply_to("hello", 6))  # type: ignore[union-attr]
    assert message.stop_reason == "max_tokens" and message.stop_sequence is None
    assert message.usage.input_tokens == len("hello")
    assert message.usage.output_tokens == 6
    assert message.usage.cache_read_input_tokens == 0


def test_system_as_a_string_or_blocks_and_count_tokens_agree(sdk: anthropic.Anthropic):
    as_blocks = [{"type": "text", "text": "Be brief.", "cache_control": {"type": "ephemeral"}}]
    counts = [
        sdk.messages.count_tokens(model=MODEL, system=system, messages=user("hi")).input_tokens
        for system in ("Be brief.", as_blocks)
    ]
    assert counts == [len("Be brief.\nhi")] * 2
    message = sdk.messages.create(
        model=MODEL,
        max_tokens=3,
        system=as_blocks,
        messages=user("hi"),  # type: ignore[arg-type]
    )
    assert message.usage.input_tokens == counts[0]
    assert message.content[0].text == "".join(reply_to("Be brief.\nhi", 3))  # type: ignore[union-attr]


def test_messages_stream_gives_the_event_sequence_and_the_same_message(sdk: anthropic.Anthropic):
    whole = sdk.messages.create(model=MODEL, max_tokens=5, messages=user("stream"))
    with sdk.messages.stream(model=MODEL, max_tokens=5, messages=user("stream")) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_message()
    assert kinds[:2] == ["message_start", "content_block_start"]
    assert kinds[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert blocks(final) == blocks(whole)
    assert final.stop_reason == "max_tokens"
    assert final.usage.output_tokens == 5 and final.usage.input_tokens == len("stream")


def test_stream_true_sends_ping_and_well_formed_events(http: httpx.Client):
    body = {"model": MODEL, "max_tokens": 3, "messages": user("raw"), "stream": True}
    with http.stream("POST", "/v1/messages", json=body) as answer:
        assert answer.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in answer.iter_lines() if line]
    names = [line.removeprefix("event: ") for line in lines if line.startswith("event: ")]
    data = [json.loads(line.removeprefix("data: ")) for line in lines if line.startswith("data: ")]
    assert names[:2] == ["message_start", "ping"]
    assert [d["type"] for d in data] == names  # each event's data names it
    deltas = [d["delta"] for d in data if d["type"] == "content_block_delta"]
    assert "".join(d["text"] for d in deltas) == "".join(reply_to("raw", 3))


def test_thinking_comes_as_a_thinking_block_before_the_text(sdk: anthropic.Anthropic):
    thinking: Any = {"type": "enabled", "budget_tokens": 1024}
    message = sdk.messages.create(
        model=MODEL, max_tokens=8, messages=user(QUESTION), thinking=thinking
    )
    assert [b.type for b in message.content] == ["thinking", "text"]
    assert message.content[0].thinking == "".join(THOUGHT[:2])  # type: ignore[union-attr]
    assert message.content[0].signature == ""  # type: ignore[union-attr]
    assert message.content[1].text == "".join(THOUGHT[3:])  # type: ignore[union-attr]
    with sdk.messages.stream(
        model=MODEL, max_tokens=8, messages=user(QUESTION), thinking=thinking
    ) as stream:
        deltas = [e.delta.type for e in stream if e.type == "content_block_delta"]
        assert blocks(stream.get_final_message()) == blocks(message)
    assert "thinking_delta" in deltas and "text_delta" in deltas


@pytest.mark.parametrize("streamed", [False, True])
def test_a_tool_call_is_a_tool_use_block_and_its_result_goes_back(
    sdk: anthropic.Anthropic, streamed: bool
):
    ask: Any = {
        "model": MODEL,
        "max_tokens": 8,
        "messages": user(CALLER),
        "tools": [LOOKUP],
        "stop_sequences": [CALL[4].strip()],  # an end, as a model's own end of turn would be
    }
    if streamed:
        with sdk.messages.stream(**ask) as stream:
            kinds = [e.delta.type for e in stream if e.type == "content_block_delta"]
            message = stream.get_final_message()
        assert "input_json_delta" in kinds
    else:
        message = sdk.messages.create(**ask)
    assert message.stop_reason == "tool_use"
    text, use = message.content
    assert text.type == "text" and text.text == CALL[0].rstrip()
    assert use.type == "tool_use" and use.name == "lookup"
    assert use.id.startswith("toolu_")
    assert use.input == {"q": CALL[2].strip()}
    history = [
        *ask["messages"],
        {"role": "assistant", "content": blocks(message)},
        {
            "role": "user",
            "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "found"}],
        },
    ]
    follow = {**ask, "messages": history}
    counted = sdk.messages.count_tokens(model=MODEL, messages=history, tools=[LOOKUP])  # type: ignore[arg-type]
    assert counted.input_tokens == len(f"{CALLER}\n{text.text}\nfound")
    answer = sdk.messages.create(**follow)
    assert answer.usage.input_tokens == counted.input_tokens


def test_a_stop_sequence_ends_the_reply_and_is_named(sdk: anthropic.Anthropic):
    reply = reply_to("stops", 8)
    stops = ["never", reply[4].strip()]
    message = sdk.messages.create(
        model=MODEL, max_tokens=8, messages=user("stops"), stop_sequences=stops
    )
    assert message.stop_reason == "stop_sequence"
    assert message.stop_sequence == reply[4].strip()
    assert message.content[0].text == "".join(reply[:4])  # type: ignore[union-attr]
    with sdk.messages.stream(
        model=MODEL, max_tokens=8, messages=user("stops"), stop_sequences=stops
    ) as stream:
        final = stream.get_final_message()
    assert (final.stop_reason, final.stop_sequence) == ("stop_sequence", reply[4].strip())


def test_what_claude_code_sends_is_accepted(server: ServerThread):
    """Beta headers and query, cache_control on blocks and tools, metadata,
    context_management, adaptive thinking, output_config's effort, a system turn in the
    messages, fields Anthropic may add: all accepted (what Claude Code 2.1 sends)."""
    body = {
        "model": MODEL,
        "max_tokens": 4,
        "system": [{"type": "text", "text": "sys", "cache_control": {"type": "ephemeral"}}],
        "messages": [
            {
                "role": "user",
                "content": [{"type": "text", "text": "hi", "cache_control": {"type": "ephemeral"}}],
            },
            {"role": "system", "content": "mid"},  # the mid-conversation-system beta
        ],
        "thinking": {"type": "adaptive"},
        "output_config": {"effort": "high"},
        "tools": [LOOKUP | {"cache_control": {"type": "ephemeral"}}],
        "tool_choice": {"type": "auto"},
        "metadata": {"user_id": "someone"},
        "context_management": {"edits": [{"type": "clear_tool_uses_20250919"}]},
        "temperature": 1,
        "some_future_field": {"x": 1},
    }
    headers = {
        "Authorization": f"Bearer {KEY}",  # ANTHROPIC_AUTH_TOKEN's way
        "anthropic-version": "2023-06-01",
        "anthropic-beta": "claude-code-20250219,interleaved-thinking-2025-05-14",
    }
    answer = httpx.post(f"{server.url}/v1/messages?beta=true", json=body, headers=headers)
    assert answer.status_code == 200, answer.text
    assert answer.json()["content"][0]["text"] == "".join(reply_to("sys\nhi\nmid", 4))
    assert answer.headers["request-id"] == answer.json()["id"]


# -- errors -------------------------------------------------------------------------------


def error_of(answer: httpx.Response) -> tuple[int, str, str]:
    body = answer.json()
    assert body["type"] == "error" and set(body["error"]) == {"type", "message"}
    return answer.status_code, body["error"]["type"], body["error"]["message"]


@pytest.mark.parametrize(
    ("body", "named"),
    [
        ({"model": MODEL, "messages": user("hi")}, "max_tokens: Field required"),
        ({"model": MODEL, "max_tokens": 4, "messages": []}, "messages must not be empty"),
        (
            {
                "model": MODEL,
                "max_tokens": 4,
                "messages": [{"role": "user", "content": [{"type": "document", "source": {}}]}],
            },
            "messages.[0].content.[0]: content blocks of type 'document' are not supported",
        ),
        (
            {
                "model": MODEL,
                "max_tokens": 4,
                "messages": user("hi"),
                "tools": [{"type": "web_search_20250305", "name": "web_search"}],
            },
            "tools.[0]: tools of type 'web_search_20250305'",
        ),
        (
            {
                "model": MODEL,
                "max_tokens": 4,
                "messages": user("hi"),
                "tools": [LOOKUP],
                "tool_choice": {"type": "tool", "name": "missing"},
            },
            "tool_choice",
        ),
        (
            {"model": MODEL, "max_tokens": 4, "messages": user("hi"), "mcp_servers": [{}]},
            "mcp_servers is not supported",
        ),
        (
            {"model": MODEL, "max_tokens": 4, "messages": user("hi"), "stop_sequences": [""]},
            "stop_sequences",
        ),
        (
            {
                "model": MODEL,
                "max_tokens": 4,
                "messages": [*user("hi"), {"role": "assistant", "content": "Sure"}],
            },
            "a final assistant turn",
        ),
        (
            {
                "model": MODEL,
                "max_tokens": 4,
                "messages": user("hi"),
                "output_config": {"format": {"type": "regex", "pattern": "a"}},
            },
            "output_config.format: only type json_schema",
        ),
        (
            {
                "model": MODEL,
                "max_tokens": 4,
                "messages": user("hi"),
                "output_format": {"type": "json_schema"},
            },
            "output_format: a json_schema format needs its schema",
        ),
        (
            {
                "model": MODEL,
                "max_tokens": 4,
                "messages": user("hi"),
                "tools": [LOOKUP],
                "tool_choice": {"type": "any"},
                "output_config": {"format": {"type": "json_schema", "schema": {"type": "object"}}},
            },
            "a forced tool call (tool_choice any or tool) and output_config.format",
        ),
    ],
)
def test_a_bad_request_is_a_400_invalid_request_error_naming_it(http: httpx.Client, body, named):
    status, kind, message = error_of(http.post("/v1/messages", json=body))
    assert (status, kind) == (400, "invalid_request_error")
    assert named in message


def test_a_prompt_over_the_context_is_refused_in_anthropics_words(sdk: anthropic.Anthropic):
    with pytest.raises(anthropic.BadRequestError) as caught:
        sdk.messages.create(model=MODEL, max_tokens=4, messages=user("x" * 5000))
    assert caught.value.body["error"]["message"] == "prompt is too long: 5000 tokens > 4096 maximum"  # type: ignore[index]
    with pytest.raises(anthropic.BadRequestError, match="exceed context limit: 4000 \\+ 200 >"):
        sdk.messages.create(model=MODEL, max_tokens=200, messages=user("x" * 4000))


def test_sdk_errors_for_key_model_and_route(server: ServerThread, sdk: anthropic.Anthropic):
    with pytest.raises(anthropic.AuthenticationError) as caught:
        anthropic.Anthropic(base_url=server.url, api_key="wrong", max_retries=0).messages.create(
            model=MODEL, max_tokens=2, messages=user("hi")
        )
    assert caught.value.body["error"]["type"] == "authentication_error"  # type: ignore[index]
    with pytest.raises(anthropic.NotFoundError) as missing:
        sdk.messages.create(model="claude-opus-9", max_tokens=2, messages=user("hi"))
    assert missing.value.body["error"]["type"] == "not_found_error"  # type: ignore[index]
    assert f"serves '{MODEL}'" in missing.value.message
    route = httpx.post(f"{server.url}/v1/messages/nope", headers={"x-api-key": KEY}, json={})
    assert error_of(route)[:2] == (404, "not_found_error")
    no_key = httpx.post(f"{server.url}/v1/messages/count_tokens", json={})
    assert error_of(no_key)[:2] == (401, "authentication_error")


def test_either_key_header_opens_every_route(server: ServerThread):
    bearer = anthropic.Anthropic(base_url=server.url, auth_token=KEY, api_key=None)
    assert bearer.messages.create(model=MODEL, max_tokens=2, messages=user("b")).content
    chat = httpx.post(
        f"{server.url}/v1/chat/completions",
        headers={"x-api-key": KEY},
        json={"model": MODEL, "messages": user("c"), "max_tokens": 2},
    )
    assert chat.status_code == 200
    openai_shape = httpx.get(f"{server.url}/v1/models")  # OpenAI's routes keep OpenAI's shape
    assert openai_shape.json()["error"]["code"] == "invalid_api_key"


def test_overload_is_a_529_overloaded_error_with_retry_after():
    options = ServeOptions(runtime=RuntimeConfig(max_batch=1, max_live=1, max_queued=0))
    with ServerThread(options, engine=ScriptedEngine(Script(step_s=0.01))) as server:
        server.wait_healthy()
        sdk = anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0)
        with sdk.messages.stream(model="scripted", max_tokens=300, messages=user("hog")) as hog:
            next(iter(hog))
            with pytest.raises(anthropic.OverloadedError) as caught:
                sdk.messages.create(model="scripted", max_tokens=2, messages=user("late"))
            chat = httpx.post(
                f"{server.url}/v1/chat/completions",
                json={"model": "scripted", "messages": user("late"), "max_tokens": 2},
            )
        assert caught.value.status_code == 529
        assert caught.value.response.headers["retry-after"] == "1"
        assert caught.value.body["error"]["type"] == "overloaded_error"  # type: ignore[index]
        assert chat.status_code == 503  # OpenAI's routes: as before


# -- the runtime's guarantees --------------------------------------------------------------


def test_a_disconnect_mid_stream_frees_the_row_and_counts_in_the_metrics(
    server: ServerThread, http: httpx.Client
):
    def stats() -> dict[str, Any]:
        return http.get("/v1/stats").json()

    before = stats()["cancelled"]["consumer_closed"]
    body = {"model": MODEL, "max_tokens": 1000, "messages": user("leaver"), "stream": True}
    with http.stream("POST", "/v1/messages", json=body) as answer:
        lines = answer.iter_lines()
        assert next(line for line in lines if "text_delta" in line)
    wait_for(lambda: stats()["cancelled"]["consumer_closed"] == before + 1, 10, "the cancel")
    wait_for(lambda: stats()["active_rows"] == 0, 10, "the row's release")
    metrics = http.get("/metrics").text
    assert 'mlx_trio_requests_total{endpoint="messages",outcome="completed"}' in metrics
    assert 'mlx_trio_requests_total{endpoint="messages",outcome="cancelled"}' in metrics


def test_chat_completions_are_unchanged_beside_it(server: ServerThread):
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY)
    reply = client.chat.completions.create(model=MODEL, messages=user("hello"), max_tokens=6)  # type: ignore[arg-type]
    assert reply.choices[0].message.content == "".join(reply_to("hello", 6))
