"""The Responses API on the real default model, through the official openai SDK, on both engine
transports: text, ``responses.stream``, a forced function call and its output carried on (by
``previous_response_id`` and by sending the items back), and JSON held to a schema by
``text.format``."""

from __future__ import annotations

from typing import Any

import openai
import pytest
from pydantic import BaseModel, Field

from tests.conftest import ON_ENGINE_THREAD
from tests.server_thread import ServerThread, model_id

pytestmark = pytest.mark.e2e

QUESTION = "What is the capital of France?"


class GetWeather(BaseModel):
    city: str = Field(max_length=30)


class Person(BaseModel):
    name: str = Field(max_length=30)
    age: int = Field(ge=0, le=150)


WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "The current weather in a city",
    "parameters": GetWeather.model_json_schema(),
}


@pytest.fixture(scope="module")
def server(default_model_server: ServerThread) -> ServerThread:
    return default_model_server


def sdk(server: ServerThread) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


def ask(server: ServerThread, **extra: Any) -> dict[str, Any]:
    return {"model": model_id(server), "temperature": 0} | extra


def test_text_streamed_or_not_answers_paris(server):
    client = sdk(server)
    whole = client.responses.create(**ask(server, input=QUESTION, max_output_tokens=32))
    assert "Paris" in whole.output_text
    assert whole.status == "completed"
    assert whole.usage.input_tokens > 10
    with client.responses.stream(**ask(server, input=QUESTION, max_output_tokens=32)) as stream:
        deltas = [e.delta for e in stream if e.type == "response.output_text.delta"]
        final = stream.get_final_response()
    assert "".join(deltas) == final.output_text == whole.output_text


@ON_ENGINE_THREAD  # the API's round trip, not the transport's
def test_a_forced_call_and_its_output_round_trip(server):
    client = sdk(server)
    called = client.responses.create(
        **ask(
            server,
            input="What is the weather like in Paris today?",
            tools=[WEATHER],
            tool_choice="required",
            max_output_tokens=40,
        )
    )
    calls = [item for item in called.output if item.type == "function_call"]
    assert [c.name for c in calls] == ["get_weather"]
    GetWeather.model_validate_json(calls[0].arguments)
    result = {"type": "function_call_output", "call_id": calls[0].call_id, "output": "Sunny, 24 C"}
    followed = client.responses.create(
        **ask(
            server,
            previous_response_id=called.id,
            input=[result],
            tools=[WEATHER],
            max_output_tokens=24,
        )
    )
    assert followed.output_text
    # the same conversation sent whole, as a client that keeps no ids does: the same reply
    sent = client.responses.create(
        **ask(
            server,
            input=[
                {"role": "user", "content": "What is the weather like in Paris today?"},
                *[c.model_dump(exclude_none=True) for c in calls],
                result,
            ],
            tools=[WEATHER],
            max_output_tokens=24,
        )
    )
    assert sent.output_text == followed.output_text


def test_text_format_holds_the_reply_to_the_schema(server):
    client = sdk(server)
    schema = {"type": "json_schema", "name": "person", "schema": Person.model_json_schema()}
    request = ask(server, input="Invent a person.", text={"format": schema}, max_output_tokens=48)
    reply = client.responses.create(**request)
    Person.model_validate_json(reply.output_text)
    with client.responses.stream(**request) as stream:
        final = stream.get_final_response()
    Person.model_validate_json(final.output_text)
