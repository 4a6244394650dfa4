"""Structured output on the real default model, asked through the official openai SDK: what
``parse()`` gets back validates against the Pydantic model every time, on both lanes' engine
transports, sampled or greedy."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from enum import StrEnum
from typing import Annotated, Literal

import httpx
import openai
import pytest
from pydantic import BaseModel, Field

from tests.conftest import ON_ENGINE_PROCESS, ON_ENGINE_THREAD
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


class Priority(StrEnum):
    low = "low"
    medium = "medium"
    high = "high"


class Point(BaseModel):
    x: float = Field(ge=-100, le=100)
    y: float = Field(ge=-100, le=100)


class Polygon(BaseModel):
    name: Short
    points: list[Point] = Field(min_length=3, max_length=4)


class Task(BaseModel):
    title: str = Field(max_length=40)
    priority: Priority
    done: bool
    estimate_hours: float | None = Field(default=None, ge=0, le=100)


class TodoList(BaseModel):
    owner: Short
    tasks: list[Task] = Field(max_length=3)


class Ingredient(BaseModel):
    item: Short
    grams: int = Field(ge=1, le=2000)


class Recipe(BaseModel):
    dish: str = Field(max_length=30)
    servings: int = Field(ge=1, le=12)
    ingredients: list[Ingredient] = Field(max_length=4)
    vegetarian: bool


class Movie(BaseModel):
    title: str = Field(max_length=40)
    year: int = Field(ge=1900, le=2030)
    rating: float = Field(ge=0, le=10)
    genres: list[Short] = Field(max_length=3)


class Sentiment(StrEnum):
    positive = "positive"
    neutral = "neutral"
    negative = "negative"


class Review(BaseModel):
    sentiment: Sentiment
    confidence: float = Field(ge=0, le=1)
    keywords: list[Short] = Field(max_length=3)


class City(BaseModel):
    name: Short
    country: Short
    population_millions: float = Field(ge=0, le=50)
    capital: bool


class Trip(BaseModel):
    origin: City
    destination: City
    days: int = Field(ge=1, le=30)


class Money(BaseModel):
    amount: float = Field(ge=0, le=1_000_000)
    currency: Literal["EUR", "USD", "GBP"]


class LineItem(BaseModel):
    description: str = Field(max_length=30)
    quantity: int = Field(ge=1, le=100)
    price: Money


class Invoice(BaseModel):
    number: int = Field(ge=1, le=99999)
    items: list[LineItem] = Field(min_length=1, max_length=3)
    paid: bool
    note: Short | None = None


class Contact(BaseModel):
    email: str = Field(max_length=40)
    phone: str | None = Field(default=None, max_length=20)


class Company(BaseModel):
    name: str = Field(max_length=30)
    founded: int = Field(ge=1800, le=2026)
    employees: int = Field(ge=1, le=1_000_000)
    contact: Contact
    public: bool


class Weather(BaseModel):
    city: Short
    temperature_c: float = Field(ge=-60, le=60)
    conditions: Literal["sunny", "cloudy", "rain", "snow"]
    wind_kmh: int | None = Field(default=None, ge=0, le=300)


class Grade(BaseModel):
    subject: Short
    score: int = Field(ge=0, le=100)


class Student(BaseModel):
    name: Short
    grades: list[Grade] = Field(max_length=4)
    mentor: Contact | None = None  # (a Person here made this the batch's longest row)


class Event(BaseModel):
    name: str = Field(max_length=30)
    day: int = Field(ge=1, le=31)
    month: int = Field(ge=1, le=12)
    attendees: list[Short] = Field(max_length=3)


class Answer(BaseModel):
    answer: Literal["yes", "no"]
    reason: str = Field(max_length=60)


class Matrix(BaseModel):
    rows: list[list[int]] = Field(min_length=2, max_length=2)


class Book(BaseModel):
    title: str = Field(max_length=40)
    author: Short
    pages: int = Field(ge=1, le=2000)


class Library(BaseModel):
    books: list[Book] = Field(min_length=1, max_length=2)
    open_weekends: bool


class Settings(BaseModel):
    theme: Literal["light", "dark"]
    font_size: int = Field(ge=8, le=32)
    notifications: Flags
    language: Short | None = None


# Twenty schemas, asked together (the batch serves them side by side); two of them also one at
# a time, greedy.
SCHEMAS = [
    (Person, "Invent a person who lives in Paris."),
    (Solution, "Solve 12 + 30 step by step."),
    (Flags, "Give me some flags and scores."),
    (Polygon, "Describe a triangle."),
    (TodoList, "Plan my Saturday."),
    (Recipe, "A recipe for pancakes."),
    (Movie, "Tell me about a film you like."),
    (Review, "Review: the food was great but slow service."),
    (Trip, "A trip from Rome to Berlin."),
    (Invoice, "Write an invoice for two chairs."),
    (Company, "Describe a small bakery business."),
    (Weather, "What is the weather in Oslo?"),
    (Student, "A student's report card."),
    (Event, "A birthday party."),
    (Answer, "Is the sky blue?"),
    (Matrix, "A 2x2 identity matrix."),
    (Library, "A small town library."),
    (Settings, "My app settings."),
    (City, "Describe Madrid."),
    (Ingredient, "One ingredient of bread."),
]
CASES = [SCHEMAS[0], SCHEMAS[2]]  # Person (nested, optional), Flags (lists, enums)


def parse(server, schema: type[BaseModel], prompt: str, **sampling: object):
    """The first choice of the openai SDK's ``parse()`` of ``prompt`` into ``schema``."""
    sdk = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused")
    reply = sdk.chat.completions.parse(
        model=model_id(server),
        messages=[{"role": "user", "content": prompt}],
        response_format=schema,
        max_tokens=600,
        **sampling,  # type: ignore[arg-type]
    )
    return reply.choices[0]


@ON_ENGINE_THREAD
@pytest.mark.parametrize(("schema", "prompt"), CASES, ids=[c[0].__name__ for c in CASES])
def test_parse_validates_against_the_pydantic_model_greedy(default_model_server, schema, prompt):
    choice = parse(default_model_server, schema, prompt, temperature=0)
    assert choice.finish_reason == "stop", choice.message.content
    assert isinstance(choice.message.parsed, schema)


@ON_ENGINE_PROCESS
def test_twenty_schemas_asked_together_each_validate(default_model_server):
    def sampled(case: tuple[type[BaseModel], str]) -> tuple[str | None, object]:
        choice = parse(default_model_server, *case, temperature=0.7, seed=11)
        return choice.finish_reason, choice.message.parsed

    with ThreadPoolExecutor(len(SCHEMAS)) as pool:
        results = list(pool.map(sampled, SCHEMAS))
    assert len({schema for schema, _ in SCHEMAS}) == 20
    for (schema, _), (reason, parsed) in zip(SCHEMAS, results, strict=True):
        assert reason == "stop", schema.__name__
        assert isinstance(parsed, schema)


@ON_ENGINE_THREAD  # the grammar's, not the transport's
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


def ref_chain(n: int) -> dict:
    defs: dict = {f"d{i}": {"$ref": f"#/$defs/d{i + 1}"} for i in range(n)}
    defs[f"d{n}"] = {"type": "string"}
    return {"$ref": "#/$defs/d0", "$defs": defs}


def test_a_ref_chain_that_crashed_the_server_is_a_400_and_the_server_serves_on(
    default_model_server,
):
    """The red team's 1,000-``$ref`` chain, in ``response_format`` and in a forced tool's
    ``parameters``: a 400 naming the field, and the next request is answered."""
    sdk = openai.OpenAI(base_url=f"{default_model_server.url}/v1", api_key="unused", max_retries=0)
    chat = {
        "model": model_id(default_model_server),
        "messages": [{"role": "user", "content": "hi"}],
    }
    schema = {"name": "chain", "schema": ref_chain(1000)}
    with pytest.raises(openai.BadRequestError) as caught:
        sdk.chat.completions.create(
            **chat, response_format={"type": "json_schema", "json_schema": schema}
        )
    assert caught.value.body["param"] == "response_format"  # type: ignore[index]
    tool = {"type": "function", "function": {"name": "f", "parameters": ref_chain(1000)}}
    with pytest.raises(openai.BadRequestError) as caught:
        sdk.chat.completions.create(**chat, tools=[tool], tool_choice="required")
    assert caught.value.body["param"] == "tools"  # type: ignore[index]
    assert sdk.chat.completions.create(**chat, max_tokens=4).choices[0].message.content


def test_costly_schemas_together_cost_no_one_else_their_request(default_model_server):
    """Eight distinct schemas, each a matcher that takes a while to build, asked at once
    beside a plain stream: every request ends well and the engine is never restarted (their
    matchers are built off the engine's step)."""
    sdk = openai.OpenAI(base_url=f"{default_model_server.url}/v1", api_key="unused", max_retries=0)

    def costly(k: int) -> str | None:
        options = [
            {
                "type": "object",
                "properties": {f"k{k}_{i}": {"type": "integer"}},
                "required": [f"k{k}_{i}"],
            }
            for i in range(1500)
        ]
        reply = sdk.chat.completions.create(
            model=model_id(default_model_server),
            messages=[{"role": "user", "content": "Give a number."}],
            response_format={
                "type": "json_schema",
                "json_schema": {"name": f"s{k}", "schema": {"anyOf": options}},
            },
            max_tokens=16,
        )
        return reply.choices[0].finish_reason

    def plain() -> str | None:
        reply = sdk.chat.completions.create(
            model=model_id(default_model_server),
            messages=[{"role": "user", "content": "Count to ten."}],
            max_tokens=48,
        )
        return reply.choices[0].finish_reason

    with ThreadPoolExecutor(9) as pool:
        held = [pool.submit(costly, k) for k in range(8)]
        bystander = pool.submit(plain)
        assert bystander.result() in ("stop", "length")
        assert all(f.result() in ("stop", "length") for f in held)
    metrics = httpx.get(f"{default_model_server.url}/metrics").text
    assert "mlx_trio_engine_restarts_total 0.0" in metrics
