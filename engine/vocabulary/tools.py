"""Tool calling: the tools a chat offers, the calls a reply makes, and the generic format for
models whose chat template has no tools.

Where a model's template renders tools (mlx-lm infers a tool parser for it: ``has_tool_calling``
on its tokenizer), the template renders them and the model's own format is parsed. Where it
does not (the default model's), the tools go into the system message in the format below, the
one Qwen2.5 and Hermes models are trained on, and calls are parsed from it::

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

Tool results come back as ``<tool_response>`` blocks in a user turn. A call that must be made
(``tool_choice`` ``required`` or a named function) is held by a grammar (:func:`call_grammar`)
to this format, whatever the model's own, with arguments that match the tool's schema.

Pure Python: the HTTP edge builds and checks these before anything is admitted.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

from ..errors import InvalidRequestError
from ..params import Grammar
from .grammar_text import check_bounds

CALL_START = "<tool_call>"
CALL_END = "</tool_call>"
RESPONSE_START = "<tool_response>"
RESPONSE_END = "</tool_response>"
NAME_PATTERN = re.compile(r"^[A-Za-z0-9_-]{1,64}$")  # OpenAI's rule for a function's name
# A function given no ``parameters`` takes none (OpenAI: "an empty parameter list").
NO_ARGUMENTS: dict[str, Any] = {"type": "object", "properties": {}, "additionalProperties": False}
# The arguments' JSON on one line with fixed separators (as ``engine/vocabulary/grammar.py``'s
# JSON_LAYOUT).
CALL_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}

GENERIC_INSTRUCTIONS = """\
# Tools

You may call one or more functions to assist with the user query.

You are provided with function signatures within <tools></tools> XML tags:
<tools>
{tools}
</tools>

For each function call, return a json object with function name and arguments within \
<tool_call></tool_call> XML tags:
<tool_call>
{{"name": <function-name>, "arguments": <args-json-object>}}
</tool_call>"""


@dataclass(frozen=True, slots=True)
class Tool:
    """A function the model may call: ``parameters`` is its arguments' JSON schema, as JSON
    text (so that the value stays frozen): an object's; by default, no arguments."""

    name: str
    description: str = ""
    parameters: str = json.dumps(NO_ARGUMENTS)

    def __post_init__(self) -> None:
        if not NAME_PATTERN.match(self.name):
            raise InvalidRequestError(
                "a tool's name must be 1 to 64 letters, digits, underscores or dashes, "
                f"got {self.name[:80]!r}",
                param="tools",
            )
        try:
            schema = json.loads(self.parameters)
        except json.JSONDecodeError:
            schema = None
        kind = schema.get("type", "object") if isinstance(schema, dict) else None
        if kind != "object":  # arguments are a JSON object: a call of anything else is no call
            raise InvalidRequestError(
                f"the parameters of tool {self.name!r} must be a JSON schema of an object "
                f'({{"type": "object", ...}}), got {self.parameters[:80]}',
                param="tools",
            )
        try:  # a forced call compiles it: the same bounds as a response_format's schema
            check_bounds(Grammar("json_schema", self.parameters))
        except InvalidRequestError as exc:
            raise InvalidRequestError(
                f"the parameters of tool {self.name!r}: {exc.message}", param="tools"
            ) from None

    @classmethod
    def of(cls, name: str, description: str = "", parameters: dict | None = None) -> Tool:
        """A tool; ``parameters`` None: it takes no arguments."""
        schema = NO_ARGUMENTS if parameters is None else parameters
        return cls(name, description, json.dumps(schema))

    def openai(self) -> dict[str, Any]:
        """As OpenAI's ``tools`` entry, which chat templates read."""
        function: dict[str, Any] = {"name": self.name}
        if self.description:
            function["description"] = self.description
        function["parameters"] = json.loads(self.parameters)
        return {"type": "function", "function": function}


@dataclass(frozen=True, slots=True)
class ToolCall:
    """A call a reply made: ``arguments`` as JSON text, as OpenAI sends them."""

    name: str
    arguments: str
    id: str = ""

    def __post_init__(self) -> None:
        if not self.id:
            object.__setattr__(self, "id", "call_" + uuid.uuid4().hex[:24])

    def openai(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }

    def parsed_arguments(self) -> Any:
        """The arguments as a value (chat templates take them so); text that is not JSON is
        passed as it is."""
        try:
            return json.loads(self.arguments)
        except json.JSONDecodeError:
            return self.arguments


@dataclass(frozen=True, slots=True)
class ToolChoice:
    """OpenAI's ``tool_choice``: ``none``, ``auto``, ``required``, or ``function`` with the
    ``name`` of the one function to call."""

    mode: Literal["none", "auto", "required", "function"] = "auto"
    name: str | None = None

    @property
    def forces_call(self) -> bool:
        return self.mode in ("required", "function")


def check_choice(tools: Sequence[Tool], choice: ToolChoice) -> None:
    """Raise ``InvalidRequestError`` for a choice the tools cannot meet."""
    if choice.mode in ("auto", "none"):
        return
    if not tools:
        raise InvalidRequestError(f"tool_choice {choice.mode!r} needs tools", param="tool_choice")
    if choice.mode == "function" and choice.name not in {t.name for t in tools}:
        raise InvalidRequestError(
            f"tool_choice names the function {choice.name!r}, which is not among the tools",
            param="tool_choice",
        )
    names = [t.name for t in tools]
    if len(set(names)) != len(names):
        raise InvalidRequestError("tools must have distinct names", param="tools")


def call_grammar(tools: Sequence[Tool], choice: ToolChoice, *, parallel: bool) -> Grammar:
    """The grammar a forced reply is held to, in the generic format: one call of the named
    function (as vLLM's named choice), or one call (with ``parallel``, one or more) of any of
    ``tools``; with arguments that match the tool's schema."""
    offered = [t for t in tools if choice.mode != "function" or t.name == choice.name]

    def option(tool: Tool, at: str) -> dict[str, Any]:
        arguments = _rebased(json.loads(tool.parameters), at + "/properties/arguments")
        return {
            "type": "object",
            "properties": {"name": {"const": tool.name}, "arguments": arguments},
            "required": ["name", "arguments"],
            "additionalProperties": False,
        }

    schema: dict[str, Any]
    if len(offered) == 1:
        schema = option(offered[0], "")
    else:
        schema = {"anyOf": [option(t, f"/anyOf/{i}") for i, t in enumerate(offered)]}
    schema = schema | {"x-guidance": CALL_LAYOUT}
    calls = 'call ("\\n" call)*' if parallel and choice.mode == "required" else "call"
    lark = (
        f"start: {calls}\n"
        f'call: "{CALL_START}\\n" arguments "\\n{CALL_END}"\n'
        f"arguments: %json {json.dumps(schema)}\n"
    )
    return Grammar("lark", lark)


SCHEMA_MAPS = frozenset({"properties", "patternProperties", "$defs", "definitions"})


def _rebased(schema: Any, at: str, *, is_map: bool = False) -> Any:
    """A tool's arguments schema as a forced call holds to it: its local references
    (``#/$defs/Unit``, as Pydantic writes them) made to point into it where it now sits, at
    the JSON pointer ``at`` of a larger schema; and an object that declares its properties
    and says nothing of others closed to others (as OpenAI's strict mode asks: a function
    takes the arguments it declares). ``is_map``: ``schema`` maps names to schemas."""
    if isinstance(schema, list):
        return [_rebased(item, at) for item in schema]
    if not isinstance(schema, dict):
        return schema
    if is_map:
        return {name: _rebased(value, at) for name, value in schema.items()}
    out = {}
    for key, value in schema.items():
        if key == "$ref" and isinstance(value, str) and value.startswith("#"):
            out[key] = f"#{at}{value[1:]}"
        else:
            out[key] = _rebased(value, at, is_map=key in SCHEMA_MAPS)
    if "properties" in out and "additionalProperties" not in out:
        out["additionalProperties"] = False
    return out


def generic_instructions(tools: Sequence[Tool]) -> str:
    """The system text that offers ``tools`` in the generic format."""
    listed = "\n".join(json.dumps(t.openai(), ensure_ascii=False) for t in tools)
    return GENERIC_INSTRUCTIONS.format(tools=listed)


def generic_call_text(call: ToolCall) -> str:
    """A call as the generic format writes it, for an assistant turn in the history."""
    body = {"name": call.name, "arguments": call.parsed_arguments()}
    return f"{CALL_START}\n{json.dumps(body, ensure_ascii=False)}\n{CALL_END}"


def parse_generic_call(text: str, tools: Any = None) -> dict[str, Any]:
    """The text between the markers, as ``{"name", "arguments"}`` (mlx-lm's tool parsers'
    shape); raises ``ValueError`` where it is not a call."""
    value = json.loads(text.strip())
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        raise ValueError("a tool call must be a JSON object with a name")
    return {"name": value["name"], "arguments": value.get("arguments", {})}
