"""Anthropic Messages API request bodies (pydantic) and their translation to a ``Chat``.

``system`` (a string or text blocks) becomes the system message; a user turn's ``text`` blocks
its content and each ``tool_result`` a ``tool`` message answering its ``tool_use_id``; an
assistant turn's ``tool_use`` blocks its calls (``thinking`` blocks it sent back are dropped).
``tools`` with ``input_schema`` are offered as the chat endpoint offers its functions, and
``tool_choice`` ``any`` or ``tool`` is held by the same grammar as OpenAI's ``required``.
``image`` blocks (base64, or a URL where the server fetches them) go to a vision model
(design/031-images.md). A block or field that would change what is generated and is not served
here (``document``, server tools, ``mcp_servers``, ...) gets a 400 naming it; ``cache_control``
and the fields that change nothing here (``metadata``, ``service_tier``,
``context_management``) are accepted; any other field is ignored and logged once.
design/026-messages-api.md lists them all.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping
from typing import Annotated, Any, ClassVar, Literal

from pydantic import ConfigDict, Discriminator, Field, StrictBool, StrictInt, Tag

from ..engine.errors import InvalidRequestError
from ..engine.params import Grammar, SamplingParams
from ..engine.vocabulary.images import ImageInput
from ..engine.vocabulary.prompt import Chat, ChatMessage, PlacedImage
from ..engine.vocabulary.sampling_defaults import NO_DEFAULTS, SamplingDefaults
from ..engine.vocabulary.tools import Tool, ToolCall, ToolChoice, call_grammar, check_choice
from .anthropic_tools import ThinkingSpec, ToolChoiceSpec, ToolDefinition
from .chat_parts import Body
from .field_names import fields_of, format_param, log_ignored
from .images import ImageBlock, ImageRef, ImageSource
from .schemas import Number, SpeculativeOptions

# Anthropic's fields that change nothing here (metadata, routing, caching that is automatic
# here, context editing that matters only past the context): accepted, ignored.
NO_EFFECT_FIELDS = frozenset(
    {
        "metadata",
        "service_tier",
        "context_management",
        "cache_control",
        "inference_geo",
        "speed",
        "diagnostics",
        "user_profile_id",
        "workspace_id",
    }
)
# Anthropic's fields that would change what is generated, not served here: a 400 when set.
UNSUPPORTED_FIELDS = frozenset({"mcp_servers", "container"})
# What each block type the API defines becomes where it is not served (a 400 naming it).
KNOWN_BLOCKS = ("text", "tool_use", "tool_result", "thinking", "redacted_thinking", "image")


class TextBlock(Body):
    type: Literal["text"]
    text: str


class OtherBlock(Body):
    """A block of a type not served here (``document``, server tools' blocks...):
    parsed to be named in the 400 that refuses it."""

    type: str


def _block_tag(value: Any) -> str:
    kind = value.get("type") if isinstance(value, dict) else getattr(value, "type", None)
    return f"{kind}_block" if kind in KNOWN_BLOCKS else "other_block"


ResultPart = Annotated[
    Annotated[TextBlock, Tag("text_block")] | Annotated[OtherBlock, Tag("other_block")],
    Discriminator(lambda v: "text_block" if _block_tag(v) == "text_block" else "other_block"),
]


class ToolUseBlock(Body):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any] = Field(default_factory=dict)


class ToolResultBlock(Body):
    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[ResultPart] | None = None
    is_error: StrictBool = False


class ThinkingBlock(Body):
    """A thinking block sent back with an assistant turn: dropped from the prompt."""

    type: Literal["thinking", "redacted_thinking"]


Block = Annotated[
    Annotated[TextBlock, Tag("text_block")]
    | Annotated[ToolUseBlock, Tag("tool_use_block")]
    | Annotated[ToolResultBlock, Tag("tool_result_block")]
    | Annotated[ThinkingBlock, Tag("thinking_block")]
    | Annotated[ThinkingBlock, Tag("redacted_thinking_block")]
    | Annotated[ImageBlock, Tag("image_block")]
    | Annotated[OtherBlock, Tag("other_block")],
    Discriminator(_block_tag),
]


def refuse_block(block: OtherBlock, path: list[int | str]) -> InvalidRequestError:
    param = format_param(path)
    return InvalidRequestError(
        f"{param}: content blocks of type {block.type[:40]!r} are not supported by this "
        "server yet (it serves text, image, tool_use, tool_result and thinking blocks)",
        param=param,
        code="unsupported",
    )


class InputMessage(Body):
    """A turn; ``system`` mid-conversation (a beta Claude Code uses) is a system message there."""

    role: Literal["user", "assistant", "system"]
    content: str | list[Block]

    def image_refs(self, index: int) -> list[ImageRef]:
        if isinstance(self.content, str):
            return []
        return [
            block.ref(format_param(["messages", index, "content", at]) or "")
            for at, block in enumerate(self.content)
            if isinstance(block, ImageBlock)
        ]

    def chat_messages(
        self, index: int, images: Mapping[str, ImageInput] | None = None
    ) -> list[ChatMessage]:
        """This turn as chat messages: a user turn's tool results each a ``tool`` message, in
        order with its text and images (their bytes in ``images`` by block path); an
        assistant turn's text and calls as one message."""
        if isinstance(self.content, str):
            return [ChatMessage(self.role, self.content)]
        out: list[ChatMessage] = []
        texts: list[str] = []
        calls: list[ToolCall] = []
        placed: list[PlacedImage] = []
        for at, block in enumerate(self.content):
            match block:
                case TextBlock(text=text):
                    texts.append(text)
                case ImageBlock():
                    where = format_param(["messages", index, "content", at]) or ""
                    if images is not None and where in images:
                        placed.append(PlacedImage(sum(map(len, texts)), images[where]))
                case ToolUseBlock(id=call_id, name=name, input=arguments):
                    calls.append(ToolCall(name, json.dumps(arguments, ensure_ascii=False), call_id))
                case ToolResultBlock():
                    if texts or placed:
                        out.append(ChatMessage(self.role, "".join(texts), images=tuple(placed)))
                        texts, placed = [], []
                    path: list[int | str] = ["messages", index, "content", at, "content"]
                    out.append(
                        ChatMessage("tool", _result_text(block, path), (), block.tool_use_id)
                    )
                case OtherBlock():
                    raise refuse_block(block, ["messages", index, "content", at])
        if texts or calls or placed or not out:
            out.append(ChatMessage(self.role, "".join(texts), tuple(calls), images=tuple(placed)))
        return out


def _result_text(block: ToolResultBlock, path: list[int | str]) -> str:
    content = block.content
    if content is None:
        text = ""
    elif isinstance(content, str):
        text = content
    else:
        parts = []
        for at, part in enumerate(content):
            if isinstance(part, OtherBlock):
                raise refuse_block(part, [*path, at])
            parts.append(part.text)
        text = "\n".join(parts)
    return f"Error: {text}" if block.is_error else text


class _Conversation(Body):
    """What a Messages request and a count_tokens request share: the prompt. Its undeclared
    fields are kept (``model_extra``) to be checked."""

    model_config = ConfigDict(extra="allow")
    unsupported: ClassVar[frozenset[str]] = UNSUPPORTED_FIELDS

    model: str
    messages: list[InputMessage]
    system: str | list[TextBlock] | None = None
    tools: list[ToolDefinition] | None = None
    tool_choice: ToolChoiceSpec | None = None
    thinking: ThinkingSpec | None = None

    def check_fields(self) -> None:
        """Raise ``InvalidRequestError`` naming the first field sent that is not served here;
        log, once per name, fields Anthropic does not define."""
        for name, value in (self.model_extra or {}).items():
            if name in self.unsupported:
                if value:
                    raise InvalidRequestError(
                        f"{name} is not supported by this server yet",
                        param=name,
                        code="unsupported",
                    )
            elif name in ("output_config", "output_format"):
                pass  # the format is read by ``output_schema``; ``effort`` changes nothing
            elif name not in NO_EFFECT_FIELDS:
                log_ignored(name, "Anthropic's Messages API")
        check_choice(self.offered_tools, self.choice)

    @functools.cached_property
    def offered_tools(self) -> tuple[Tool, ...]:
        return tuple(spec.tool(i) for i, spec in enumerate(self.tools or ()))

    @functools.cached_property
    def choice(self) -> ToolChoice:
        """``tool_choice`` as OpenAI's: ``any`` is ``required``, ``tool`` a named function;
        by default ``auto`` with tools, else ``none``."""
        spec = self.tool_choice
        match spec:
            case None:
                return ToolChoice("auto" if self.tools else "none")
            case ToolChoiceSpec(type="any"):
                return ToolChoice("required")
            case ToolChoiceSpec(type="tool"):
                if not spec.name:
                    raise InvalidRequestError(
                        "tool_choice of type tool needs a name", param="tool_choice.name"
                    )
                return ToolChoice("function", spec.name)
        return ToolChoice(spec.type)

    @property
    def tools_in_prompt(self) -> tuple[Tool, ...]:
        return self.offered_tools if self.choice.mode != "none" else ()

    def image_refs(self) -> list[ImageRef]:
        return [ref for i, message in enumerate(self.messages) for ref in message.image_refs(i)]

    def chat(self, images: Mapping[str, ImageInput] | None = None) -> Chat:
        """The chat for the engine, its image blocks' bytes from ``images`` (by block path)."""
        if not self.messages:
            raise InvalidRequestError("messages must not be empty", param="messages")
        if self.messages[-1].role == "assistant":
            raise InvalidRequestError(
                "messages: a final assistant turn (a prefill to continue) is not supported by "
                "this server yet; end with a user turn",
                param="messages",
                code="unsupported",
            )
        turns = [
            m for i, message in enumerate(self.messages) for m in message.chat_messages(i, images)
        ]
        system = (
            self.system
            if isinstance(self.system, str)
            else "\n\n".join(block.text for block in self.system or ())
        )
        if system:
            turns.insert(0, ChatMessage("system", system))
        kwargs = {} if self.thinking is None else self.thinking.template_kwargs()
        return Chat(tuple(turns), self.tools_in_prompt, kwargs)


def output_schema(extra: Mapping[str, Any]) -> tuple[str, dict[str, Any]] | None:
    """Structured output asked for, as (the field that asked, its JSON schema):
    ``output_config.format`` or the older ``output_format``, each ``{"type": "json_schema",
    "schema": {...}}``; None for neither. Any other shape is a 400 naming the field."""
    config = extra.get("output_config")
    found = [
        ("output_config.format", config.get("format") if isinstance(config, dict) else None),
        ("output_format", extra.get("output_format")),
    ]
    for param, given in found:
        if given is None:
            continue
        if not isinstance(given, dict) or given.get("type") != "json_schema":
            raise InvalidRequestError(
                f"{param}: only type json_schema is served", param=f"{param}.type"
            )
        schema = given.get("schema")
        if not isinstance(schema, dict):
            raise InvalidRequestError(
                f"{param}: a json_schema format needs its schema as an object",
                param=f"{param}.schema",
            )
        return param, schema
    return None


class CountTokensRequest(_Conversation):
    """``/v1/messages/count_tokens``: the prompt a Messages request would send."""


class MessagesRequest(_Conversation):
    """``/v1/messages``. A ``SubmitBody`` (``api/http_submit.py``): one choice (``n``), the
    deadline (``timeout``) and prompt-cache salt as the chat endpoint's extensions."""

    max_tokens: StrictInt
    temperature: Number | None = None
    top_p: Number | None = None
    top_k: StrictInt | None = None
    stop_sequences: list[str] | None = None
    stream: StrictBool = False
    timeout: Number | None = Field(default=None, gt=0, description="seconds; mlx-trio extension")
    cache_salt: str | None = Field(default=None, min_length=1, max_length=256)
    speculative: SpeculativeOptions | None = None  # mlx-trio extension, as chat's

    @property
    def n(self) -> int:
        return 1

    @property
    def stops(self) -> tuple[str, ...]:
        return tuple(self.stop_sequences or ())

    def check_fields(self) -> None:
        super().check_fields()
        self.output_format  # noqa: B018  (a malformed format is a 400 here, before admission)

    @functools.cached_property
    def output_format(self) -> tuple[str, dict[str, Any]] | None:
        """Structured output: the field that asked for it and its JSON schema."""
        return output_schema(self.model_extra or {})

    @functools.cached_property
    def grammar(self) -> Grammar | None:
        """A forced tool call's grammar (``tool_choice`` ``any`` or ``tool``), or the output
        format's JSON schema; both at once cannot hold one reply (a 400)."""
        choice, output = self.choice, self.output_format
        if choice.forces_call and output is not None:
            raise InvalidRequestError(
                f"a forced tool call (tool_choice any or tool) and {output[0]} cannot hold one "
                "reply together",
                param="tool_choice",
            )
        if output is not None:
            return Grammar.json_schema(output[1])
        if not choice.forces_call:
            return None
        parallel = not (self.tool_choice and self.tool_choice.disable_parallel_tool_use)
        return call_grammar(self.offered_tools, choice, parallel=parallel)

    def params(
        self,
        *,
        default_max_tokens: int,
        seed_offset: int = 0,
        defaults: SamplingDefaults = NO_DEFAULTS,
    ) -> SamplingParams:
        """The request's values, ``defaults`` for the sampling fields omitted; ``max_tokens``
        is required, so ``default_max_tokens`` goes unused."""
        return defaults.params(
            grammar=self.grammar,
            max_tokens=self.max_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            stop=self.stops,
            speculative=self.speculative.speculation() if self.speculative else None,
        )

    def field_names(self) -> Mapping[str, str]:
        grammar = self.output_format[0] if self.output_format is not None else "tools"
        return {"prompt": "messages", "grammar": grammar, "stop": "stop_sequences"}


FIELD_NAMES = fields_of(
    MessagesRequest,
    InputMessage,
    TextBlock,
    ImageBlock,
    ImageSource,
    OtherBlock,
    ToolUseBlock,
    ToolResultBlock,
    ToolDefinition,
    ToolChoiceSpec,
    ThinkingSpec,
)
