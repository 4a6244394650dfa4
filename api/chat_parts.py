"""The parts of a chat request body (pydantic): messages with their tool calls, the tools
offered and the choice among them, and ``response_format``; ``api/schemas.py`` assembles them.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool

from ..engine.errors import InvalidRequestError
from ..engine.params import Grammar
from ..engine.vocabulary.prompt import ChatMessage
from ..engine.vocabulary.tools import Tool, ToolCall


class Body(BaseModel):
    model_config = ConfigDict(extra="ignore")


class TextPart(Body):
    type: Literal["text"]
    text: str


class CalledFunction(Body):
    name: str
    arguments: str


class MessageToolCall(Body):
    id: str
    type: Literal["function"] = "function"
    function: CalledFunction


class Message(Body):
    role: str
    content: str | list[TextPart] | None = None
    tool_calls: list[MessageToolCall] | None = None
    tool_call_id: str | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)

    def chat_message(self) -> ChatMessage:
        calls = tuple(
            ToolCall(c.function.name, c.function.arguments, c.id) for c in self.tool_calls or ()
        )
        return ChatMessage(self.role, self.text(), calls, self.tool_call_id)


class FunctionSpec(Body):
    name: str
    description: str = ""
    parameters: dict[str, Any] | None = None
    strict: StrictBool | None = None


class ToolSpec(Body):
    type: Literal["function"]
    function: FunctionSpec

    def tool(self) -> Tool:
        f = self.function
        return Tool.of(f.name, f.description, f.parameters)


class FunctionName(Body):
    name: str


class NamedToolChoice(Body):
    type: Literal["function"]
    function: FunctionName


class JsonSchemaFormat(Body):
    name: str = "response"
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: StrictBool | None = None


class ResponseFormat(Body):
    """OpenAI's ``response_format``: ``text``, ``json_object`` or ``json_schema`` (always held
    to strictly here, whatever ``strict`` says)."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    def grammar(self) -> Grammar | None:
        match self.type:
            case "json_object":
                return Grammar("json_object")
            case "json_schema":
                if self.json_schema is None or self.json_schema.schema_ is None:
                    raise InvalidRequestError(
                        "response_format of type json_schema needs json_schema.schema",
                        param="response_format.json_schema",
                    )
                return Grammar("json_schema", json.dumps(self.json_schema.schema_))
        return None
