"""Tool calling on the real default model, asked through the official openai SDK: a forced call
(``tool_choice`` ``required`` or a named function) is always a call of an offered tool with
arguments that validate against its schema, streamed or not, on both engine transports; a
conversation carries a call and its result on; the SDK's own Pydantic tools parse."""

from __future__ import annotations

import json
from enum import StrEnum
from typing import Any

import openai
import pytest
from pydantic import BaseModel, Field

from tests.conftest import ON_ENGINE_PROCESS, ON_ENGINE_THREAD
from tests.server_thread import model_id

pytestmark = pytest.mark.e2e


class Unit(StrEnum):
    celsius = "celsius"
    fahrenheit = "fahrenheit"


class GetWeather(BaseModel):
    """The current weather in a city."""

    city: str = Field(max_length=30)
    unit: Unit


class Booking(BaseModel):
    restaurant: str = Field(max_length=30)
    guests: int = Field(ge=1, le=20)
    time: str = Field(max_length=10)
    notes: str | None = Field(default=None, max_length=40)


def function(model: type[BaseModel], name: str, description: str) -> dict[str, Any]:
    return {
        "type": "function",
        "function": {
            "name": name,
            "description": description,
            "parameters": model.model_json_schema(),
        },
    }


TOOLS = [
    function(GetWeather, "get_weather", "The current weather in a city"),
    function(Booking, "book_table", "Book a table at a restaurant"),
]
ARGUMENTS = {"get_weather": GetWeather, "book_table": Booking}
QUESTION = [{"role": "user", "content": "What is the weather like in Paris today?"}]


def sdk(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused")


def check_call(name: str, arguments: str) -> BaseModel:
    """The call validates, and has no arguments its tool does not declare."""
    assert name in ARGUMENTS, name
    assert set(json.loads(arguments)) <= set(ARGUMENTS[name].model_fields), arguments
    return ARGUMENTS[name].model_validate_json(arguments)


# Greedy on one transport and sampled on the other: the call's grammar, not how the engine
# is reached, is what each shows.
@ON_ENGINE_THREAD
def test_a_greedy_required_call_validates_against_its_tool(default_model_server):
    check_required_call(default_model_server, temperature=0.0)


@ON_ENGINE_PROCESS
def test_a_sampled_required_call_validates_against_its_tool(default_model_server):
    check_required_call(default_model_server, temperature=0.8)


def check_required_call(default_model_server, temperature: float) -> None:
    reply = sdk(default_model_server).chat.completions.create(
        model=model_id(default_model_server),
        messages=QUESTION,
        tools=TOOLS,
        tool_choice="required",
        parallel_tool_calls=False,
        temperature=temperature,
        seed=5,
        max_tokens=200,
    )
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    (call,) = choice.message.tool_calls or []
    assert call.type == "function" and call.id.startswith("call_")
    check_call(call.function.name, call.function.arguments)


@ON_ENGINE_PROCESS  # the stream's shape, not the transport's
def test_a_streamed_required_call_arrives_as_delta_tool_calls(default_model_server):
    stream = sdk(default_model_server).chat.completions.create(
        model=model_id(default_model_server),
        messages=QUESTION,
        tools=TOOLS,
        tool_choice="required",
        temperature=0,
        max_tokens=300,
        stream=True,
    )
    calls: dict[int, dict[str, str]] = {}
    content, reasons = "", []
    for chunk in stream:
        delta = chunk.choices[0].delta
        content += delta.content or ""
        reasons.append(chunk.choices[0].finish_reason)
        for part in delta.tool_calls or []:
            call = calls.setdefault(part.index, {"id": "", "name": "", "arguments": ""})
            call["id"] += part.id or ""
            call["name"] += part.function.name or "" if part.function else ""
            call["arguments"] += part.function.arguments or "" if part.function else ""
    assert content == "" and reasons[-1] == "tool_calls"
    assert sorted(calls) == list(range(len(calls))) and calls  # indexed from 0
    for call in calls.values():
        assert call["id"].startswith("call_")
        check_call(call["name"], call["arguments"])


@ON_ENGINE_PROCESS
def test_a_named_function_is_the_one_called(default_model_server):
    reply = sdk(default_model_server).chat.completions.create(
        model=model_id(default_model_server),
        messages=QUESTION,
        tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "book_table"}},
        temperature=0,
        max_tokens=200,
    )
    calls = reply.choices[0].message.tool_calls or []
    assert [c.function.name for c in calls] == ["book_table"]
    check_call("book_table", calls[0].function.arguments)


@ON_ENGINE_THREAD
def test_a_conversation_with_a_tool_result_continues(default_model_server):
    client, model = sdk(default_model_server), model_id(default_model_server)
    asked = client.chat.completions.create(
        model=model,
        messages=QUESTION,
        tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        temperature=0,
        max_tokens=200,
    )
    message = asked.choices[0].message
    (call,) = message.tool_calls or []
    result = {"temperature": 18, "unit": "celsius", "sky": "sunny"}
    history = [
        *QUESTION,
        message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": json.dumps(result)},
    ]
    answer = client.chat.completions.create(
        model=model, messages=history, tools=TOOLS, temperature=0, max_tokens=30
    )
    choice = answer.choices[0]
    assert choice.finish_reason in ("stop", "length", "tool_calls")
    assert choice.message.content or choice.message.tool_calls
    # With tool_choice none the tools are not offered: the reply is text.
    plain = client.chat.completions.create(
        model=model, messages=history, tools=TOOLS, tool_choice="none", max_tokens=12
    )
    assert plain.choices[0].message.tool_calls is None and plain.choices[0].message.content


@ON_ENGINE_THREAD  # the SDK's parsing, not the transport's
def test_the_sdks_pydantic_tools_parse(default_model_server):
    reply = sdk(default_model_server).chat.completions.parse(
        model=model_id(default_model_server),
        messages=QUESTION,
        tools=[openai.pydantic_function_tool(GetWeather)],
        tool_choice="required",
        parallel_tool_calls=False,
        temperature=0,
        max_tokens=200,
    )
    (call,) = reply.choices[0].message.tool_calls or []
    assert isinstance(call.function.parsed_arguments, GetWeather)


def test_a_tool_schema_that_does_not_compile_is_a_400_naming_tools(default_model_server):
    bad = {"type": "function", "function": {"name": "f", "parameters": {"type": "objekt"}}}
    with pytest.raises(openai.BadRequestError) as caught:
        sdk(default_model_server).chat.completions.create(
            model=model_id(default_model_server),
            messages=QUESTION,
            tools=[bad],
            tool_choice="required",
        )
    assert caught.value.body["param"] == "tools"  # type: ignore[index]


async def test_a_forced_call_in_process_with_the_public_api():
    """What the README's in-process paragraph says: a Chat with tools, the call grammar, and
    the reply split by the model's reply syntax."""
    from mlx_trio.api import (
        Called,
        Chat,
        ChatMessage,
        GenerationRequest,
        SamplingParams,
        TextDelta,
        Tool,
        ToolChoice,
        call_grammar,
        open_runtime,
    )

    tools = [Tool.of("get_weather", "The weather in a city", GetWeather.model_json_schema())]
    choice = ToolChoice("function", "get_weather")
    params = SamplingParams(
        temperature=0, max_tokens=100, grammar=call_grammar(tools, choice, parallel=False)
    )
    async with open_runtime(max_batch=2) as rt:
        chat = Chat((ChatMessage("user", "Weather in Oslo?"),), tuple(tools))
        handle = await rt.submit(GenerationRequest(chat, params))
        splitter = rt.reply_syntax().splitter(handle.prompt_tokens, tools, choice)
        pieces = []
        async for event in handle:
            if isinstance(event, TextDelta):
                pieces += splitter.feed(event.text)
        pieces += splitter.finish()
    (called,) = pieces
    assert isinstance(called, Called) and called.call.name == "get_weather"
    check_call("get_weather", called.call.arguments)
