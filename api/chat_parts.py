"""The parts of a chat request body (pydantic): messages with their tool calls, the tools
offered and the choice among them, and ``response_format``; ``api/schemas.py`` assembles them.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Discriminator, Field, StrictBool, Tag

from ..engine.errors import InvalidRequestError
from ..engine.params import Grammar
from ..engine.vocabulary.images import ImageInput
from ..engine.vocabulary.prompt import ChatMessage, PlacedImage
from ..engine.vocabulary.tools import Tool, ToolCall
from .images import ImageRef


class Body(BaseModel):
    model_config = ConfigDict(extra="ignore")


class TextPart(Body):
    type: Literal["text"]
    text: str


class ImageURL(Body):
    url: str
    detail: str | None = None  # accepted; the model's processor sizes the image


class ImageURLPart(Body):
    type: Literal["image_url"]
    image_url: ImageURL


def _part_tag(value: Any) -> str | None:
    kind = value.get("type") if isinstance(value, dict) else getattr(value, "type", None)
    return {"text": "text_part", "image_url": "image_part"}.get(kind, "text_part")


# Tagged apart from the field names, which an error's parameter path is made of.
ContentPart = Annotated[
    Annotated[TextPart, Tag("text_part")] | Annotated[ImageURLPart, Tag("image_part")],
    Discriminator(_part_tag),
]


class CalledFunction(Body):
    name: str
    arguments: str


class MessageToolCall(Body):
    id: str
    type: Literal["function"] = "function"
    function: CalledFunction


class Message(Body):
    role: str
    content: str | list[ContentPart] | None = None
    tool_calls: list[MessageToolCall] | None = None
    tool_call_id: str | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content if isinstance(part, TextPart))

    def image_refs(self, where: str) -> list[ImageRef]:
        """This message's image parts, ``where`` being the message's own path."""
        if not isinstance(self.content, list):
            return []
        return [
            ImageRef(f"{where}.content.[{j}]", part.image_url.url)
            for j, part in enumerate(self.content)
            if isinstance(part, ImageURLPart)
        ]

    def chat_message(
        self, where: str = "", images: Mapping[str, ImageInput] | None = None
    ) -> ChatMessage:
        """The message for the engine; its image parts' bytes are in ``images`` by their path
        (``image_refs``), ``where`` being the message's."""
        calls = tuple(
            ToolCall(c.function.name, c.function.arguments, c.id) for c in self.tool_calls or ()
        )
        text, placed = self.text(), ()
        if isinstance(self.content, list) and images:
            text, placed = place_images(self.content, where, images)
        return ChatMessage(self.role, text, calls, self.tool_call_id, placed)


def place_images(
    parts: list[Any], where: str, images: Mapping[str, ImageInput]
) -> tuple[str, tuple[PlacedImage, ...]]:
    """The text of ``parts`` (those with ``text``) and their images from ``images`` (by
    ``{where}.content.[{j}]``), each placed before the text that follows it."""
    text: list[str] = []
    placed: list[PlacedImage] = []
    at = 0
    for j, part in enumerate(parts):
        image = images.get(f"{where}.content.[{j}]")
        if image is not None:
            placed.append(PlacedImage(at, image))
        elif isinstance(getattr(part, "text", None), str):
            text.append(part.text)
            at += len(part.text)
    return "".join(text), tuple(placed)


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
