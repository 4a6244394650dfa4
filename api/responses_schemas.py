"""OpenAI's Responses API request body (pydantic), and its translation to the runtime's chat.

``input`` is a string or a list of items: messages (``input_text`` / ``output_text`` parts),
``function_call`` and ``function_call_output`` items, and ``reasoning`` items passed back
(accepted, not rendered: the templates served drop a past turn's thinking). They become one
:class:`Chat`: ``instructions`` and the leading system and developer messages as its one
system message, a call as an assistant turn's tool call, its output as a ``tool`` turn.
What is implemented, accepted without effect, or refused: design/025-responses-api.md.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Mapping, Sequence
from typing import Annotated, Any, Literal

from pydantic import Discriminator, Field, StrictBool, StrictInt, Tag

from ..engine.errors import ImageError, InvalidRequestError
from ..engine.params import Grammar, SamplingParams
from ..engine.vocabulary.images import ImageInput
from ..engine.vocabulary.prompt import Chat, ChatMessage
from ..engine.vocabulary.sampling_defaults import NO_DEFAULTS, SamplingDefaults
from ..engine.vocabulary.tools import Tool, ToolCall, ToolChoice, call_grammar, check_choice
from .chat_parts import Body, JsonSchemaFormat, ResponseFormat, place_images
from .field_names import fields_of
from .images import ImageRef
from .responses_tools import (
    FunctionChoice,
    FunctionTool,
    NamespaceTool,
    ToolSpec,
    check_tools,
    type_of,
)
from .schemas import NO_EFFECT_FIELDS, ReasoningEffort, _Request, effort_kwargs

# Fields of the Responses API that change nothing here (storage hints, routing, what to echo).
NO_EFFECT_RESPONSES_FIELDS = NO_EFFECT_FIELDS | {
    "include",
    "client_metadata",
    "prompt_cache_retention",
    "stream_options",
}
# Fields of the Responses API that ask for what this server does not do: 400 naming them.
UNSUPPORTED_RESPONSES_FIELDS = frozenset(
    {"conversation", "prompt", "max_tool_calls", "top_logprobs", "context_management"}
)


TextKind = Literal["input_text", "output_text", "text", "summary_text", "reasoning_text"]
TEXT_KINDS = frozenset(TextKind.__args__)


class InputText(Body):
    type: TextKind
    text: str


class InputImage(Body):
    """An image (design/031-images.md): ``image_url`` a ``data:`` URL, or ``http(s)`` where
    the server fetches; ``detail`` is accepted (the model's processor sizes the image)."""

    type: Literal["input_image"]
    image_url: str | None = None
    file_id: str | None = None
    detail: str | None = None

    def ref(self, where: str) -> ImageRef:
        if self.image_url is None:
            raise ImageError(where, "images by file_id are not served; send image_url")
        return ImageRef(where, self.image_url)


class OtherPart(Body):
    """A content part of a type not served (``input_file``, ...)."""

    type: str


def _part_kind(value: Any) -> str:
    kind = type_of(value)
    return "text_part" if kind in TEXT_KINDS else "image_part" if kind == "input_image" else "other"


Part = Annotated[
    Annotated[InputText, Tag("text_part")]
    | Annotated[InputImage, Tag("image_part")]
    | Annotated[OtherPart, Tag("other")],
    Discriminator(_part_kind),
]


class MessageItem(Body):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[Part]


class FunctionCallItem(Body):
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str


class FunctionCallOutputItem(Body):
    type: Literal["function_call_output"]
    call_id: str
    output: str | list[Part]


class ReasoningItem(Body):
    type: Literal["reasoning"]


class OtherItem(Body):
    """An input item of a type not served (``item_reference``, ``local_shell_call``, ...)."""

    type: str


ITEM_TAGS = {
    "message": "message_item",
    "function_call": "function_call_item",
    "function_call_output": "function_call_output_item",
    "reasoning": "reasoning_item",
}


def _item_kind(value: Any) -> str:
    return ITEM_TAGS.get(type_of(value) or "message", "other")  # a message may omit its type


Item = Annotated[
    Annotated[MessageItem, Tag("message_item")]
    | Annotated[FunctionCallItem, Tag("function_call_item")]
    | Annotated[FunctionCallOutputItem, Tag("function_call_output_item")]
    | Annotated[ReasoningItem, Tag("reasoning_item")]
    | Annotated[OtherItem, Tag("other")],
    Discriminator(_item_kind),
]


class TextFormat(Body):
    """``text.format``: ``text``, ``json_object``, or ``json_schema`` with the schema beside
    its name (the Responses API's flat form of chat's ``response_format``)."""

    type: Literal["text", "json_object", "json_schema"]
    name: str = "response"
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    description: str | None = None
    strict: StrictBool | None = None

    def grammar(self) -> Grammar | None:
        if self.type == "json_schema" and self.schema_ is None:
            raise InvalidRequestError(
                "text.format of type json_schema needs a schema", param="text.format.schema"
            )
        schema = JsonSchemaFormat(name=self.name, schema=self.schema_)
        return ResponseFormat(type=self.type, json_schema=schema).grammar()


class TextOptions(Body):
    format: TextFormat | None = None
    verbosity: str | None = None  # accepted; no effect


class ReasoningOptions(Body):
    effort: ReasoningEffort | None = None
    summary: str | None = None  # accepted; reasoning comes back whole, as reasoning_text


class ResponsesRequest(_Request):
    """A ``POST /v1/responses`` body. Sampling fields are chat's (``_Sampling``), so vLLM's
    extensions (``top_k``, ``min_p``, ``timeout``, ``cache_salt``, ...) work here too."""

    unsupported = UNSUPPORTED_RESPONSES_FIELDS
    no_effect = NO_EFFECT_RESPONSES_FIELDS

    input: str | list[Item]
    instructions: str | None = None
    tools: list[ToolSpec] | None = None
    tool_choice: Literal["none", "auto", "required"] | FunctionChoice | None = None
    parallel_tool_calls: StrictBool = True
    max_output_tokens: StrictInt | None = None
    text: TextOptions | None = None
    reasoning: ReasoningOptions | None = None
    store: StrictBool = True
    previous_response_id: str | None = None
    background: StrictBool = False
    truncation: Literal["auto", "disabled"] = "disabled"

    def check_fields(self) -> None:
        super().check_fields()
        if self.n != 1:
            raise InvalidRequestError("n: a response has one output; send n 1", param="n")
        if self.background:
            raise InvalidRequestError(
                "background responses are not supported by this server",
                param="background",
                code="unsupported",
            )
        if self.truncation == "auto":  # nothing is dropped from a prompt silently
            raise InvalidRequestError(
                "truncation 'auto' is not supported: a prompt over the context is refused",
                param="truncation",
                code="unsupported",
            )
        check_tools(self.tools or ())
        check_choice(self.offered_tools, self.choice)
        if self.choice.forces_call and self.text_format is not None:
            raise InvalidRequestError(
                "a forced tool call (tool_choice required or a function) and a text.format "
                "other than text cannot hold one reply together",
                param="tool_choice",
            )

    @functools.cached_property
    def functions(self) -> tuple[FunctionTool, ...]:
        """The function tools, those of namespaces included."""
        found: list[FunctionTool] = []
        for tool in self.tools or ():
            nested = tool.tools if isinstance(tool, NamespaceTool) else [tool]
            found += [t for t in nested if isinstance(t, FunctionTool)]
        return tuple(found)

    @functools.cached_property
    def namespace_of(self) -> dict[str, str]:
        """Each namespaced function's namespace, by the function's name."""
        return {
            t.name: tool.name
            for tool in self.tools or ()
            if isinstance(tool, NamespaceTool)
            for t in tool.tools
            if isinstance(t, FunctionTool)
        }

    @functools.cached_property
    def offered_tools(self) -> tuple[Tool, ...]:
        return tuple(Tool.of(t.name, t.description or "", t.parameters) for t in self.functions)

    @functools.cached_property
    def choice(self) -> ToolChoice:
        """``tool_choice`` as sent, else ``auto`` with tools, else ``none``."""
        match self.tool_choice:
            case FunctionChoice(name=name):
                return ToolChoice("function", name)
            case None:
                return ToolChoice("auto" if self.tools else "none")
            case mode:
                return ToolChoice(mode)

    @property
    def text_format(self) -> TextFormat | None:
        """``text.format`` where it asks for JSON (``text`` asks for nothing)."""
        fmt = self.text.format if self.text is not None else None
        return fmt if fmt is not None and fmt.type != "text" else None

    @functools.cached_property
    def grammar(self) -> Grammar | None:
        if self.choice.forces_call:
            return call_grammar(self.offered_tools, self.choice, parallel=self.parallel_tool_calls)
        return None if self.text_format is None else self.text_format.grammar()

    def image_refs(self) -> list[ImageRef]:
        """``input``'s image parts."""
        if isinstance(self.input, str):
            return []
        return [
            part.ref(f"input.[{i}].content.[{j}]")
            for i, item in enumerate(self.input)
            if isinstance(item, MessageItem) and isinstance(item.content, list)
            for j, part in enumerate(item.content)
            if isinstance(part, InputImage)
        ]

    def messages(self, images: Mapping[str, ImageInput] | None = None) -> list[ChatMessage]:
        """``input`` as chat turns (without ``instructions``): what a later response that
        names this one continues from, with this one's output. Its image parts' bytes are
        in ``images`` by part path."""
        if isinstance(self.input, str):
            return [ChatMessage("user", self.input)]
        return input_messages(self.input, images or {})

    def chat_turns(
        self, history: Sequence[ChatMessage], images: Mapping[str, ImageInput] | None = None
    ) -> tuple[tuple[ChatMessage, ...], Chat]:
        """The turns a response to this body answers (``history``, a previous response's
        turns, then ``input``'s; what a follow-up continues from), and the chat to generate
        from."""
        turns = (*history, *self.messages(images))
        return turns, self.chat(turns)

    def chat(self, turns: Iterable[ChatMessage]) -> Chat:
        """The chat to generate from: ``instructions``, then ``turns`` (a previous response's,
        then ``messages()``)."""
        turns = list(turns)
        if self.instructions:
            turns.insert(0, ChatMessage("system", self.instructions))
        if not turns:
            raise InvalidRequestError("input must not be empty", param="input")
        tools = self.offered_tools if self.choice.mode != "none" else ()
        effort = self.reasoning.effort if self.reasoning is not None else None
        return Chat(tuple(one_system_turn(turns)), tools, effort_kwargs(effort))

    def params(
        self,
        *,
        default_max_tokens: int,
        seed_offset: int = 0,
        defaults: SamplingDefaults = NO_DEFAULTS,
    ) -> SamplingParams:
        limits = (self.max_output_tokens, self.max_tokens, defaults.max_tokens)
        return self.sampling_params(
            max_tokens=next((v for v in limits if v is not None), default_max_tokens),
            logprobs=False,
            top_logprobs=0,
            seed_offset=seed_offset,
            defaults=defaults,
            grammar=self.grammar,
        )

    def field_names(self) -> Mapping[str, str]:
        names = {
            "prompt": "input",
            "grammar": "tools" if self.choice.forces_call else "text.format",
        }
        if self.max_tokens is None:
            names["max_tokens"] = "max_output_tokens"
        return names


# What a validation error's location keeps (``http_input.parse``).
RESPONSES_FIELDS = fields_of(
    ResponsesRequest,
    InputText,
    InputImage,
    MessageItem,
    FunctionCallItem,
    FunctionCallOutputItem,
    FunctionTool,
    NamespaceTool,
    FunctionChoice,
    TextFormat,
    TextOptions,
    ReasoningOptions,
)


def part_text(content: str | list[Any], param: str, *, keep: type | None = None) -> str:
    """A message's or an output's text (``param`` names it): its text parts joined; other
    parts, but those of type ``keep`` (a message's images), are refused."""
    if isinstance(content, str):
        return content
    texts = []
    for i, part in enumerate(content):
        if keep is not None and isinstance(part, keep):
            continue
        if not isinstance(part, InputText):
            raise InvalidRequestError(
                f"{param}.[{i}]: content of type {part.type!r} is not supported by this "
                "server; send text",
                param=f"{param}.[{i}].type",
                code="unsupported",
            )
        texts.append(part.text)
    return "".join(texts)


def input_messages(items: list[Any], images: Mapping[str, ImageInput]) -> list[ChatMessage]:
    """Input items as chat turns: consecutive calls join the assistant turn before them (or
    make one), each output is a ``tool`` turn, reasoning items are left out; a message's
    image parts come from ``images`` by part path."""
    turns: list[ChatMessage] = []
    for i, item in enumerate(items):
        match item:
            case MessageItem(role=role, content=content):
                where = f"input.[{i}]"
                text, placed = part_text(content, f"{where}.content", keep=InputImage), ()
                if isinstance(content, list) and images:
                    text, placed = place_images(content, where, images)
                role = "system" if role == "developer" else role
                turns.append(ChatMessage(role, text, images=placed))
            case FunctionCallItem(call_id=call_id, name=name, arguments=arguments):
                call = ToolCall(name, arguments, call_id)
                last = turns[-1] if turns else None
                if last is not None and last.role == "assistant":
                    turns[-1] = ChatMessage("assistant", last.content, (*last.tool_calls, call))
                else:
                    turns.append(ChatMessage("assistant", "", (call,)))
            case FunctionCallOutputItem(call_id=call_id, output=output):
                text = part_text(output, f"input.[{i}].output")
                turns.append(ChatMessage("tool", text, tool_call_id=call_id))
            case ReasoningItem():
                pass
            case OtherItem(type=kind):
                raise InvalidRequestError(
                    f"input.[{i}]: items of type {kind!r} are not supported by this server",
                    param=f"input.[{i}].type",
                    code="unsupported",
                )
    return turns


def one_system_turn(turns: list[ChatMessage]) -> list[ChatMessage]:
    """The leading system turns (``instructions``, developer messages) as one: templates
    that place a system message read only the first."""
    lead = 0
    while lead < len(turns) and turns[lead].role == "system":
        lead += 1
    if lead < 2:
        return turns
    joined = "\n\n".join(t.content for t in turns[:lead] if t.content)
    return [ChatMessage("system", joined), *turns[lead:]]
