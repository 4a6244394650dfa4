"""The Anthropic Messages API on the real default model through the official ``anthropic`` SDK,
on both engine transports: a text turn, ``messages.stream``, a tool-use round trip (the call
forced by ``tool_choice`` ``any``, its result sent back), count_tokens, and a reply held to
``output_config.format``'s JSON schema."""

from __future__ import annotations

import json
from typing import Any

import anthropic
import pytest

from tests.conftest import ON_ENGINE_PROCESS
from tests.server_thread import ServerThread, model_id

pytestmark = pytest.mark.e2e

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
WEATHER = {
    "name": "get_weather",
    "description": "The current weather in a city",
    "input_schema": {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 30}},
        "required": ["city"],
        "additionalProperties": False,
    },
}
JSON_FORMAT = {"type": "json_schema"}
# The SDK (2.x) no longer takes temperature as an argument; the API still does.
GREEDY = {"temperature": 0}


def sdk(server: ServerThread) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0)


def test_a_text_turn_and_its_stream_answer_paris(default_model_server: ServerThread):
    client, model = sdk(default_model_server), model_id(default_model_server)
    ask: Any = {"model": model, "max_tokens": 32, "messages": QUESTION, "extra_body": GREEDY}
    message = client.messages.create(**ask)
    assert message.stop_reason == "end_turn"
    text = message.content[0].text  # type: ignore[union-attr]
    assert "Paris" in text
    with client.messages.stream(**ask) as stream:
        streamed = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert streamed == text
    assert final.stop_reason == "end_turn"
    assert final.usage.output_tokens == message.usage.output_tokens
    counted = client.messages.count_tokens(model=model, messages=QUESTION)  # type: ignore[arg-type]
    usage = message.usage
    assert usage.input_tokens + (usage.cache_read_input_tokens or 0) == counted.input_tokens > 10


def test_output_config_format_holds_the_reply_to_its_schema(default_model_server: ServerThread):
    schema = {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 30}},
        "required": ["city"],
        "additionalProperties": False,
    }
    message = sdk(default_model_server).messages.create(
        model=model_id(default_model_server),
        max_tokens=48,
        messages=QUESTION,  # type: ignore[arg-type]
        extra_body=GREEDY | {"output_config": {"format": JSON_FORMAT | {"schema": schema}}},
    )
    assert message.stop_reason == "end_turn"
    reply = json.loads(message.content[0].text)  # type: ignore[union-attr]
    assert set(reply) == {"city"} and isinstance(reply["city"], str)


@ON_ENGINE_PROCESS  # the API's round trip, not the transport's
def test_a_forced_tool_use_and_its_result_round_trip(default_model_server: ServerThread):
    client, model = sdk(default_model_server), model_id(default_model_server)
    ask: Any = {
        "model": model,
        "max_tokens": 64,
        "extra_body": GREEDY,
        "tools": [WEATHER],
        "tool_choice": {"type": "any", "disable_parallel_tool_use": True},
        "messages": [{"role": "user", "content": "What is the weather in Paris?"}],
    }
    message = client.messages.create(**ask)
    assert message.stop_reason == "tool_use"
    use = next(b for b in message.content if b.type == "tool_use")
    assert use.name == "get_weather" and use.id.startswith("toolu_")
    assert isinstance(use.input, dict) and isinstance(use.input["city"], str)
    result = {"type": "tool_result", "tool_use_id": use.id, "content": "Sunny, 24 C"}
    follow: Any = {
        **ask,
        "tool_choice": {"type": "auto"},
        "messages": [
            *ask["messages"],
            {
                "role": "assistant",
                "content": [b.model_dump(exclude_none=True) for b in message.content],
            },
            {"role": "user", "content": [result]},
        ],
    }
    with client.messages.stream(**follow) as stream:
        answer = stream.get_final_message()
    assert answer.stop_reason in ("end_turn", "tool_use", "max_tokens")
    assert answer.content
