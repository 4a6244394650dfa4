"""Tool calling and reasoning below HTTP: how a chat with tools becomes a prompt (the model's
template, or the generic format), the grammar a forced call is held to, and how a reply's text
splits into content, reasoning and calls however its deltas are cut."""

from __future__ import annotations

import json

import llguidance
import pytest
from mlx_lm.tool_parsers import json_tools

from mlx_trio.engine.batch.batch import BatchEngine
from mlx_trio.engine.errors import InvalidRequestError
from mlx_trio.engine.generate import Engine
from mlx_trio.engine.model.random_model import byte_level_tokenizer
from mlx_trio.engine.params import SamplingParams
from mlx_trio.engine.vocabulary.grammar import TOKENIZERS
from mlx_trio.engine.vocabulary.grammar_text import llguidance_grammar
from mlx_trio.engine.vocabulary.prompt import Chat, ChatMessage, encode_prompt
from mlx_trio.engine.vocabulary.reply import Called, Content, Reasoning, ReplySplitter, ReplySyntax
from mlx_trio.engine.vocabulary.tools import Tool, ToolCall, ToolChoice, call_grammar
from tests.test_grammar import run
from tests.tiny import MERGES, SPECIALS, make_tokenizer

WEATHER = Tool.of(
    "get_weather",
    "The weather in a city",
    {
        "type": "object",
        "properties": {
            "city": {"type": "string", "maxLength": 20},
            "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
        },
        "required": ["city", "unit"],
        "additionalProperties": False,
    },
)
TIME = Tool.of("get_time", "The time in a city", {"type": "object", "properties": {}})
CALL = ToolCall("get_weather", '{"city": "Paris", "unit": "celsius"}', "call_1")

# A template that renders tools itself (in the Hermes format, as Qwen2.5's does) and reads a
# flag from chat_template_kwargs.
TOOLS_TEMPLATE = (
    "{% if tools %}<|im_start|>system\nTOOLS:{% for t in tools %} {{ t.function.name }}"
    "{% endfor %}<|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}"
    "{% for c in m.tool_calls or [] %}<tool_call>{{ c.function.name }} "
    "{{ c.function.arguments.city }}</tool_call>{% endfor %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if open_thinking %}<think>\n{% endif %}{% endif %}"
)


def tokenizer_with(template: str, *, native_tools: bool = False):
    tokenizer = byte_level_tokenizer(
        [a + b for a, b in MERGES],
        [*SPECIALS, "<think>", "</think>"],
        eos_token="<|im_end|>",
        merges=MERGES,
        chat_template=template,
    )
    if native_tools:  # as mlx-lm's loader sets them for a template it infers json_tools for
        tokenizer._tool_parser = json_tools.parse_tool_call
        tokenizer._tool_call_start = json_tools.tool_call_start
        tokenizer._tool_call_end = json_tools.tool_call_end
    return tokenizer


def text_of(tokenizer, chat: Chat) -> str:
    return tokenizer.decode(encode_prompt(tokenizer, chat))


# -- prompts -------------------------------------------------------------------------------


def test_a_template_without_tools_gets_them_in_the_generic_format():
    tokenizer = make_tokenizer()
    chat = Chat(
        (
            ChatMessage("system", "Be brief."),
            ChatMessage("user", "Weather in Paris and Rome?"),
            ChatMessage("assistant", "", (CALL, ToolCall("get_time", "{}", "call_2"))),
            ChatMessage("tool", '{"temperature": 18}', tool_call_id="call_1"),
            ChatMessage("tool", '{"time": "12:00"}', tool_call_id="call_2"),
        ),
        (WEATHER, TIME),
    )
    text = text_of(tokenizer, chat)
    system = text.split("<|im_end|>")[0]
    assert system.startswith("<|im_start|>system\nBe brief.\n\n# Tools")
    assert json.dumps(WEATHER.openai()) in system and json.dumps(TIME.openai()) in system
    assert (
        '<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": '
        '{"city": "Paris", "unit": "celsius"}}\n</tool_call>\n<tool_call>\n'
        '{"name": "get_time", "arguments": {}}\n</tool_call><|im_end|>'
    ) in text
    # Both results in one user turn, after the calls.
    assert (
        '<|im_start|>user\n<tool_response>\n{"temperature": 18}\n</tool_response>\n'
        '<tool_response>\n{"time": "12:00"}\n</tool_response><|im_end|>'
    ) in text
    assert text.endswith("<|im_start|>assistant\n")


def test_a_template_with_tools_renders_them_itself():
    tokenizer = tokenizer_with(TOOLS_TEMPLATE, native_tools=True)
    chat = Chat(
        (ChatMessage("user", "Weather?"), ChatMessage("assistant", "", (CALL,))),
        (WEATHER, TIME),
    )
    text = text_of(tokenizer, chat)
    assert text.startswith("<|im_start|>system\nTOOLS: get_weather get_time<|im_end|>")
    assert "# Tools" not in text  # no generic instructions
    # The call's arguments reach the template as a value, as templates index them.
    assert "<tool_call>get_weather Paris</tool_call>" in text


def test_chat_template_kwargs_reach_the_template_and_reserved_names_are_refused():
    tokenizer = tokenizer_with(TOOLS_TEMPLATE)
    chat = (ChatMessage("user", "hi"),)
    assert text_of(tokenizer, Chat(chat, template_kwargs={"open_thinking": True})).endswith(
        "<|im_start|>assistant\n<think>\n"
    )
    assert text_of(tokenizer, Chat(chat)).endswith("<|im_start|>assistant\n")
    with pytest.raises(InvalidRequestError) as caught:
        Chat(chat, template_kwargs={"add_generation_prompt": False, "tokenize": False})
    assert caught.value.param == "chat_template_kwargs"
    assert "add_generation_prompt, tokenize" in caught.value.message


def test_a_template_that_refuses_the_messages_is_an_invalid_request():
    template = "{{ raise_exception('Conversation roles must alternate') }}"
    with pytest.raises(InvalidRequestError) as caught:
        encode_prompt(tokenizer_with(template), (ChatMessage("user", "hi"),))
    assert caught.value.param == "prompt"
    assert "roles must alternate" in caught.value.message


def test_a_tool_needs_an_openai_name():
    with pytest.raises(InvalidRequestError) as caught:
        Tool.of("get weather")
    assert caught.value.param == "tools"


# -- the grammar of a forced call ------------------------------------------------------------


def accepts(grammar_text: str, text: str) -> bool:
    """Whether llguidance's matcher over the tiny tokenizer accepts ``text`` whole."""
    tokenizer = make_tokenizer()
    matcher = llguidance.LLMatcher(TOKENIZERS.of(tokenizer), grammar_text, log_level=0)
    tokens = tokenizer.encode(text, add_special_tokens=False)
    return all(matcher.consume_token(t) for t in tokens) and matcher.is_accepting()


def call_text(name: str, arguments: dict) -> str:
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"


PARIS = {"city": "Paris", "unit": "celsius"}


def test_a_forced_call_must_name_an_offered_tool_with_arguments_that_match():
    grammar = llguidance_grammar(
        call_grammar([WEATHER, TIME], ToolChoice("required"), parallel=False)
    )
    assert accepts(grammar, call_text("get_weather", PARIS))
    assert accepts(grammar, call_text("get_time", {}))
    assert not accepts(grammar, call_text("get_news", {}))
    assert not accepts(grammar, call_text("get_weather", {"city": "Paris"}))  # unit required
    assert not accepts(grammar, call_text("get_weather", PARIS | {"unit": "kelvin"}))
    assert not accepts(grammar, "Paris is sunny.")
    two = call_text("get_weather", PARIS) + "\n" + call_text("get_time", {})
    assert not accepts(grammar, two)
    parallel = call_grammar([WEATHER, TIME], ToolChoice("required"), parallel=True)
    assert accepts(llguidance_grammar(parallel), two)


def test_a_call_follows_references_and_declares_its_arguments():
    """A Pydantic model's schema (its enum under ``$defs``, referenced) works as a tool's
    parameters, and a call holds to the properties declared, as OpenAI's strict mode does."""
    unit = {"enum": ["celsius", "fahrenheit"], "type": "string"}
    parameters = {
        "$defs": {"Unit": unit},
        "properties": {
            "city": {"type": "string"},
            "unit": {"$ref": "#/$defs/Unit"},
            "properties": {"type": "object", "properties": {"x": {"type": "integer"}}},
        },
        "required": ["city", "unit"],
        "type": "object",
    }
    tools = [Tool.of("weather", "", parameters), TIME]
    grammar = llguidance_grammar(call_grammar(tools, ToolChoice("required"), parallel=False))
    assert accepts(grammar, call_text("weather", PARIS))
    assert accepts(grammar, call_text("weather", PARIS | {"properties": {"x": 1}}))
    assert not accepts(grammar, call_text("weather", PARIS | {"unit": "kelvin"}))
    assert not accepts(grammar, call_text("weather", PARIS | {"date": "today"}))
    assert not accepts(grammar, call_text("weather", PARIS | {"properties": {"y": 1}}))
    assert accepts(grammar, call_text("get_time", {}))


def test_a_named_choice_allows_one_call_of_that_function():
    grammar = call_grammar([WEATHER, TIME], ToolChoice("function", "get_time"), parallel=True)
    assert accepts(llguidance_grammar(grammar), call_text("get_time", {}))
    assert not accepts(llguidance_grammar(grammar), call_text("get_weather", PARIS))
    twice = call_text("get_time", {}) + "\n" + call_text("get_time", {})
    assert not accepts(llguidance_grammar(grammar), twice)


def test_the_tiny_model_held_to_a_forced_call_makes_one_that_validates(tiny_engine: Engine):
    """Whatever its random weights would say, a row with a forced call's grammar writes a call
    that parses, names an offered tool and has arguments its schema accepts."""
    grammar = call_grammar([WEATHER, TIME], ToolChoice("required"), parallel=False)
    batch = BatchEngine(tiny_engine, max_batch=4)
    for seed in range(3):
        params = SamplingParams(temperature=1.0, seed=seed, max_tokens=300, grammar=grammar)
        batch.add(tiny_engine.prepare((ChatMessage("user", "hi"),), params))
    for _, text, reason in run(batch).values():
        assert reason == "stop", text
        pieces = ReplySyntax().splitter((), [WEATHER, TIME], ToolChoice("required")).feed(text)
        (called,) = pieces
        assert isinstance(called, Called)
        arguments = json.loads(called.call.arguments)
        if called.call.name == "get_weather":
            assert set(arguments) == {"city", "unit"} and len(arguments["city"]) <= 20
            assert arguments["unit"] in ("celsius", "fahrenheit")
        else:
            assert called.call.name == "get_time" and isinstance(arguments, dict)


# -- splitting a reply -------------------------------------------------------------------------


def split(splitter: ReplySplitter, text: str, cut: int) -> list:
    """The pieces of ``text`` fed in deltas of ``cut`` characters, merged where adjacent
    pieces are of one kind (how they are cut is the splitter's business)."""
    pieces = []
    for i in range(0, len(text), cut):
        pieces += splitter.feed(text[i : i + cut])
    pieces += splitter.finish()
    merged: list = []
    for piece in pieces:
        if merged and type(piece) is type(merged[-1]) and not isinstance(piece, Called):
            merged[-1] = type(piece)(merged[-1].text + piece.text)
        else:
            merged.append(piece)
    return merged


REPLY = (
    "<think>The user wants weather.</think>\n\nLet me look.\n"
    + call_text("get_weather", PARIS)
    + "\n"
    + call_text("get_time", {})
    + "\n"
)


@pytest.mark.parametrize("cut", [1, 2, 3, 5, 7, 11, 1000])
def test_a_reply_splits_the_same_however_its_deltas_are_cut(cut):
    syntax = ReplySyntax(think=("<think>", "</think>"))
    splitter = syntax.splitter((), [WEATHER, TIME], ToolChoice("auto"))
    pieces = split(splitter, REPLY, cut)
    assert pieces[:2] == [Reasoning("The user wants weather."), Content("Let me look.")]
    assert [(p.call.name, json.loads(p.call.arguments)) for p in pieces[2:]] == [
        ("get_weather", PARIS),
        ("get_time", {}),
    ]
    assert [c.name for c in splitter.calls] == ["get_weather", "get_time"]


def test_without_tools_a_call_is_content_and_without_thinking_a_think_block_too():
    text = "<think>hm</think>" + call_text("get_time", {})
    assert split(ReplySyntax().splitter(), text, 4) == [Content(text)]


def test_a_call_that_does_not_parse_or_does_not_end_is_kept_as_content():
    splitter = ReplySyntax().splitter((), [TIME])
    bad = "<tool_call>\nnot json\n</tool_call>"
    assert split(splitter, "A " + bad + " B", 3) == [Content("A " + bad + " B")]
    assert splitter.calls == []
    cut_off = '<tool_call>\n{"name": "get_ti'
    assert split(ReplySyntax().splitter((), [TIME]), cut_off, 3) == [Content(cut_off)]


def test_a_prompt_that_opens_a_think_block_starts_the_reply_as_reasoning():
    tokenizer = tokenizer_with(TOOLS_TEMPLATE)
    syntax = ReplySyntax.of(tokenizer)
    assert syntax.think == ("<think>", "</think>")
    chat = (ChatMessage("user", "hi"),)
    opened = encode_prompt(tokenizer, Chat(chat, template_kwargs={"open_thinking": True}))
    closed = encode_prompt(tokenizer, Chat(chat))
    assert syntax.opens_thinking(opened) and not syntax.opens_thinking(closed)
    assert split(syntax.splitter(opened), "so: 4</think>It is 4.", 2) == [
        Reasoning("so: 4"),
        Content("It is 4."),
    ]
    assert split(syntax.splitter(closed), "It is 4.", 2) == [Content("It is 4.")]


def test_a_model_with_its_own_tool_format_is_parsed_with_its_parser():
    syntax = ReplySyntax.of(tokenizer_with(TOOLS_TEMPLATE, native_tools=True))
    assert syntax.native_calls == ("<tool_call>", "</tool_call>")
    reply = 'Sure.<tool_call>{"name": "get_time", "arguments": {}}</tool_call>'
    pieces = split(syntax.splitter((), [TIME], ToolChoice("auto")), reply, 4)
    assert pieces[0] == Content("Sure.")
    assert pieces[1].call.name == "get_time" and json.loads(pieces[1].call.arguments) == {}


@pytest.mark.parametrize("key", ["self", "conversations", "kwargs", "not a name", "1x"])
def test_chat_template_kwargs_that_collide_with_the_calls_are_refused(key):
    """``{"self": 1}`` was a 500 (a TypeError of the call chain) that the openai SDK retried."""
    tokenizer = tokenizer_with(TOOLS_TEMPLATE)
    with pytest.raises(InvalidRequestError) as caught:
        text_of(tokenizer, Chat((ChatMessage("user", "hi"),), template_kwargs={key: 1}))
    assert caught.value.param == "chat_template_kwargs"
