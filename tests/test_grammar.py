"""Constrained decoding (engine/vocabulary/grammar.py) on the tiny random model: whatever its
weights would say, a row held to a grammar says something the grammar accepts, on both lanes, and
the rows beside it decode exactly as they would alone."""

from __future__ import annotations

import json
import re

import pytest

from mlx_trio.engine.batch.batch import BatchEngine
from mlx_trio.engine.errors import InvalidRequestError
from mlx_trio.engine.generate import Engine
from mlx_trio.engine.outputs import RowOutput
from mlx_trio.engine.params import Grammar, SamplingParams

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "count": {"type": "integer"},
        "kind": {"type": "string", "enum": ["a", "b"]},
        "tags": {"type": "array", "items": {"type": "boolean"}, "maxItems": 2},
    },
    "required": ["name", "count", "kind", "tags"],
    "additionalProperties": False,
}


def run(batch: BatchEngine) -> dict[int, tuple[list[int], str, str | None]]:
    """Every row's tokens, text and finish reason, once all have ended."""
    out: dict[int, tuple[list[int], str, str | None]] = {}
    while batch.num_rows:
        for event in batch.step(2):
            if isinstance(event, RowOutput):
                tokens, text, _ = out.get(event.row, ([], "", None))
                delta = event.delta
                out[event.row] = (
                    tokens + list(delta.token_ids),
                    text + delta.text,
                    delta.finish_reason,
                )
    return out


def check_schema(value: object) -> None:
    assert isinstance(value, dict) and set(value) == {"name", "count", "kind", "tags"}
    assert isinstance(value["name"], str) and len(value["name"]) <= 12
    assert isinstance(value["count"], int) and value["kind"] in ("a", "b")
    assert all(isinstance(t, bool) for t in value["tags"]) and len(value["tags"]) <= 2


def test_a_row_held_to_a_schema_writes_json_that_validates_beside_free_rows(tiny_engine: Engine):
    greedy = SamplingParams(temperature=0, max_tokens=200, grammar=Grammar.json_schema(SCHEMA))
    sampled = SamplingParams(
        temperature=1.0, seed=7, max_tokens=200, grammar=Grammar.json_schema(SCHEMA)
    )
    free = SamplingParams(temperature=0, max_tokens=24)
    alone = BatchEngine(tiny_engine, max_batch=8)
    free_rows = [alone.add(tiny_engine.prepare(p, free)) for p in ("in the beginning", "then")]
    expected = run(alone)
    batch = BatchEngine(tiny_engine, max_batch=8)
    held = [batch.add(tiny_engine.prepare("the cat sat", p)) for p in (greedy, sampled)]
    mixed = [batch.add(tiny_engine.prepare(p, free)) for p in ("in the beginning", "then")]
    got = run(batch)
    for row in held:
        _, text, finish = got[row]
        assert finish == "stop", text
        check_schema(json.loads(text))
    # The free rows' greedy tokens are the same with the constrained rows beside them.
    assert [got[r][0] for r in mixed] == [expected[r][0] for r in free_rows]


def test_the_serial_lane_holds_a_row_to_a_regex(tiny_engine: Engine):
    params = SamplingParams(
        temperature=0, max_tokens=40, grammar=Grammar("regex", r"(yes|no), [0-9]{2,4}")
    )
    text = "".join(d.text for d in tiny_engine.generate(tiny_engine.prepare("answer", params)))
    assert re.fullmatch(r"(yes|no), [0-9]{2,4}", text), text


@pytest.mark.parametrize(
    ("grammar", "message"),
    [
        (Grammar("json_schema", '{"type": "objekt"}'), "objekt"),
        (Grammar("json_schema", "{not json"), "invalid json_schema"),
        (Grammar("regex", "(unclosed"), "invalid regex"),
    ],
)
def test_a_grammar_that_does_not_compile_is_refused_at_prepare(tiny_engine, grammar, message):
    with pytest.raises(InvalidRequestError, match=re.escape(message)) as caught:
        tiny_engine.prepare("hi", SamplingParams(grammar=grammar))
    assert caught.value.param == "grammar"


def test_a_grammar_needs_a_known_kind_and_its_text():
    with pytest.raises(InvalidRequestError, match="grammar kind"):
        Grammar("xml", "<a/>")  # type: ignore[arg-type]
    with pytest.raises(InvalidRequestError, match="needs its text"):
        Grammar("regex")


def test_parking_and_going_solo_leave_a_constrained_row_as_it_would_be(tiny_engine: Engine):
    # A row taken out of mlx-lm's batch (parked) or of generate_step (solo, then back) is fed
    # its last token again: its grammar must not see it twice (it would end the row early).
    params = SamplingParams(temperature=0, max_tokens=200, grammar=Grammar.json_schema(SCHEMA))
    alone = BatchEngine(tiny_engine, max_batch=8)
    row = alone.add(tiny_engine.prepare("the cat sat", params))
    expected = run(alone)[row]
    batch = BatchEngine(tiny_engine, max_batch=8)
    row = batch.add(tiny_engine.prepare("the cat sat", params))
    other = batch.add(tiny_engine.prepare("then", SamplingParams(temperature=0, max_tokens=30)))
    tokens: list[int] = []
    for step in range(400):
        if not batch.num_rows:
            break
        if step in (6, 14) and batch.can_park(row):
            batch.park(row)
            batch.resume(row)
        for event in batch.step(1):
            if isinstance(event, RowOutput) and event.row == row:
                tokens.extend(event.delta.token_ids)
    assert other != row and tokens == expected[0]
    check_schema(json.loads(expected[1]))


def test_a_held_row_beside_one_that_wants_logprobs_still_validates(tiny_engine: Engine):
    """A row that wants log-probabilities sends the batch through mlx-lm's own step, where
    each grammar masks its row alone; the held row's JSON validates either way."""
    held = SamplingParams(temperature=0, max_tokens=200, grammar=Grammar.json_schema(SCHEMA))
    wants = SamplingParams(temperature=0, max_tokens=24, logprobs=True)
    batch = BatchEngine(tiny_engine, max_batch=4)
    row = batch.add(tiny_engine.prepare("a b", held))
    batch.add(tiny_engine.prepare("c d", wants))
    _, text, reason = run(batch)[row]
    assert reason == "stop"
    check_schema(json.loads(text))
