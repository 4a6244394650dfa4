"""Grammars that broke the server (issue 34): a compiler crash costs one request, a costly
grammar is refused or built off the engine's step, and a matcher that cannot go on fails its
row instead of ending it as if complete."""

from __future__ import annotations

import json

import pytest

from mlx_trio.engine.batch.batch import BatchEngine
from mlx_trio.engine.errors import InvalidRequestError
from mlx_trio.engine.generate import Engine
from mlx_trio.engine.outputs import RowFailed, RowOutput
from mlx_trio.engine.params import Grammar, PreparedRequest, SamplingParams
from mlx_trio.engine.vocabulary.grammar_sandbox import GrammarSandbox, TokenizerSpec
from mlx_trio.engine.vocabulary.grammar_text import check_bounds
from mlx_trio.engine.vocabulary.tools import Tool
from tests.tiny import make_tokenizer


def ref_chain(n: int) -> dict:
    """``d0 -> d1 -> ... -> dn``, the red team's schema that crashed the server."""
    defs: dict = {f"d{i}": {"$ref": f"#/$defs/d{i + 1}"} for i in range(n)}
    defs[f"d{n}"] = {"type": "string"}
    return {"$ref": "#/$defs/d0", "$defs": defs}


def optional_properties(n: int) -> dict:
    return {"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(n)}}


def lark_chain(n: int) -> str:
    """``n`` chained rules: 3,000 overflowed the compiler's stack (a segmentation fault)."""
    return "start: r0\n" + "".join(f"r{i}: r{i + 1}\n" for i in range(n)) + f'r{n}: "x"\n'


@pytest.fixture(scope="module")
def sandbox():
    with_it = GrammarSandbox(TokenizerSpec.of(make_tokenizer()))
    yield with_it
    with_it.close()


def refusal(sandbox: GrammarSandbox, grammar: Grammar) -> str:
    with pytest.raises(InvalidRequestError) as caught:
        sandbox.check(grammar)
    assert caught.value.param == "grammar"
    return str(caught.value)


def test_a_long_ref_chain_is_refused_before_the_compiler_sees_it():
    with pytest.raises(InvalidRequestError, match=r"1001 \$refs, over the limit of 512"):
        check_bounds(Grammar.json_schema(ref_chain(1000)))
    with pytest.raises(InvalidRequestError, match=r"nested deeper than 64 levels"):
        deep: dict = {"type": "string"}
        for _ in range(100):
            deep = {"type": "array", "items": deep}
        check_bounds(Grammar.json_schema(deep))
    with pytest.raises(InvalidRequestError, match=r"bytes, over the limit of 262144"):
        check_bounds(Grammar("regex", "a" * 300_000))


def test_a_compiler_crash_costs_one_check_and_the_next_compiles():
    # A small stack makes the chain that overflowed the server's compiler overflow here too:
    # a real segmentation fault, in the child.
    small = GrammarSandbox(TokenizerSpec.of(make_tokenizer()), num_workers=1, stack_bytes=1 << 18)
    try:
        message = refusal(small, Grammar("lark", lark_chain(3000)))
        assert "crashed the grammar compiler" in message
        small.check(Grammar("regex", "[a-z]+"))  # a new child answers
    finally:
        small.close()


def test_a_grammar_too_costly_to_compile_is_refused_within_the_budget(sandbox):
    message = refusal(sandbox, Grammar.json_schema(optional_properties(8000)))
    assert "to compile: too costly" in message
    sandbox.check(Grammar.json_schema(optional_properties(10)))


@pytest.mark.parametrize(
    "schema",
    [
        {"$ref": "#/$defs/a", "$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}},
        optional_properties(1000),  # its matcher gives up right after the "{"
    ],
    ids=["ref cycle", "1,000 optional properties"],
)
def test_a_grammar_that_cannot_be_followed_is_refused(sandbox, schema):
    assert "the grammar cannot be followed" in refusal(sandbox, Grammar.json_schema(schema))


def test_the_engine_compiles_what_overflowed_a_default_stack(tiny_engine: Engine):
    batch = BatchEngine(tiny_engine, max_batch=4)
    params = SamplingParams(temperature=0, max_tokens=8, grammar=Grammar("lark", lark_chain(3000)))
    row = batch.add(PreparedRequest(prompt_tokens=(1, 2, 3), params=params))
    text = ""
    while batch.num_rows:
        for event in batch.step():
            if isinstance(event, RowOutput) and event.row == row:
                text += event.delta.text
    assert text == "x"


def test_a_grammar_is_built_off_the_step_and_one_that_gives_up_fails_its_row(
    tiny_engine: Engine,
):
    """A free row decodes on while the held row's matcher is built; that matcher gives up
    after the ``{`` (too many optional properties for a step), and its row fails: never a
    reply ended as if complete."""
    batch = BatchEngine(tiny_engine, max_batch=4)
    free = batch.add(PreparedRequest((5, 6, 7), SamplingParams(temperature=0, max_tokens=64)))
    batch.step()
    held_params = SamplingParams(
        temperature=0, max_tokens=64, grammar=Grammar.json_schema(optional_properties(3000))
    )
    held = batch.add(PreparedRequest((5, 6, 8), held_params))
    free_tokens_before_held = 0
    held_events: list[object] = []
    while batch.num_rows:
        for event in batch.step():
            if event.row == held:
                held_events.append(event)
            elif isinstance(event, RowOutput) and event.row == free and not held_events:
                free_tokens_before_held += len(event.delta.token_ids)
    assert free_tokens_before_held > 0
    failures = [e for e in held_events if isinstance(e, RowFailed)]
    assert len(failures) == 1 and "grammar could not go on" in failures[0].message
    assert not any(
        isinstance(e, RowOutput) and e.delta.finish_reason is not None for e in held_events
    )


@pytest.mark.parametrize(
    "parameters", [{"type": "array"}, [1], "x"], ids=["array schema", "a list", "a string"]
)
def test_a_tool_whose_parameters_are_not_an_object_schema_is_refused(parameters):
    with pytest.raises(InvalidRequestError, match=r"must be a JSON schema of an object") as caught:
        Tool("f", "", json.dumps(parameters))
    assert caught.value.param == "tools"


def test_a_tool_without_parameters_takes_no_arguments():
    assert json.loads(Tool.of("f").parameters) == {
        "type": "object",
        "properties": {},
        "additionalProperties": False,
    }
