"""Structured output on the real default model, asked through the official openai SDK: what
``parse()`` gets back validates against the Pydantic model every time, on both lanes' engine
transports, sampled or greedy."""

from __future__ import annotations

import json
from enum import StrEnum
from typing import Annotated

import openai
import pytest
from pydantic import BaseModel, Field

from tests.server_thread import model_id

pytestmark = pytest.mark.e2e


class Color(StrEnum):
    red = "red"
    green = "green"
    blue = "blue"


# Strings and lists are bounded, as a schema for a small model should be: sampled, a string
# without a bound may run to max_tokens (a "length" finish, as OpenAI's would be).
Short = Annotated[str, Field(max_length=20)]


class Address(BaseModel):
    street: str = Field(max_length=40)
    number: int = Field(ge=1, le=999)


class Person(BaseModel):
    name: str = Field(max_length=30)
    age: int = Field(ge=0, le=120)
    height_m: float = Field(ge=0.5, le=2.5)
    favourite: Color
    nicknames: list[Short] = Field(max_length=3)
    address: Address
    employer: Short | None = None


class Step(BaseModel):
    explanation: str = Field(max_length=60)
    output: str = Field(max_length=20)


class Solution(BaseModel):
    steps: list[Step] = Field(max_length=3)
    final_answer: int = Field(ge=-1000, le=1000)


class Flags(BaseModel):
    ok: bool
    scores: list[Annotated[float, Field(ge=0, le=1)]] = Field(max_length=4)
    colors: list[Color] = Field(max_length=3)


CASES = [
    (Person, "Invent a person who lives in Paris."),
    (Solution, "Solve 12 + 30 step by step."),
    (Flags, "Give me some flags and scores."),
]


@pytest.mark.parametrize(("schema", "prompt"), CASES, ids=[c[0].__name__ for c in CASES])
@pytest.mark.parametrize("temperature", [0.0, 0.7])
def test_parse_validates_against_the_pydantic_model(
    default_model_server, schema, prompt, temperature
):
    sdk = openai.OpenAI(base_url=f"{default_model_server.url}/v1", api_key="unused")
    reply = sdk.chat.completions.parse(
        model=model_id(default_model_server),
        messages=[{"role": "user", "content": prompt}],
        response_format=schema,
        temperature=temperature,
        seed=3,
        max_tokens=600,
    )
    choice = reply.choices[0]
    assert choice.finish_reason == "stop", choice.message.content
    assert isinstance(choice.message.parsed, schema)


def test_json_object_mode_streams_a_json_object(default_model_server):
    sdk = openai.OpenAI(base_url=f"{default_model_server.url}/v1", api_key="unused")
    stream = sdk.chat.completions.create(
        model=model_id(default_model_server),
        messages=[{"role": "user", "content": "Describe the moon in JSON."}],
        response_format={"type": "json_object"},
        max_tokens=300,
        temperature=0,
        stream=True,
    )
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert isinstance(json.loads(text), dict)


def test_a_schema_that_does_not_compile_is_a_400_naming_response_format(default_model_server):
    sdk = openai.OpenAI(base_url=f"{default_model_server.url}/v1", api_key="unused")
    bad = {"name": "bad", "schema": {"type": "objekt"}}
    with pytest.raises(openai.BadRequestError) as caught:
        sdk.chat.completions.create(
            model=model_id(default_model_server),
            messages=[{"role": "user", "content": "hi"}],
            response_format={"type": "json_schema", "json_schema": bad},
        )
    assert caught.value.body["param"] == "response_format"  # type: ignore[index]
