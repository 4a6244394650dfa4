"""Turning a request's prompt (plain text, chat messages, or a :class:`Chat` with tools) into
token ids, with checks."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from mlx_lm.tokenizer_utils import TokenizerWrapper

from ..errors import ContextLengthExceededError, InvalidRequestError
from .images import ImageInput
from .tools import (
    RESPONSE_END,
    RESPONSE_START,
    Tool,
    ToolCall,
    generic_call_text,
    generic_instructions,
)

CHAT_ROLES = frozenset({"system", "user", "assistant", "developer", "tool"})
# apply_chat_template's own arguments: a request's chat_template_kwargs may not set them.
RESERVED_TEMPLATE_KWARGS = frozenset(
    {
        "conversation",
        "messages",
        "tools",
        "documents",
        "add_generation_prompt",
        "continue_final_message",
        "tokenize",
        "padding",
        "truncation",
        "max_length",
        "return_tensors",
        "return_dict",
        "return_assistant_tokens_mask",
        "tokenizer_kwargs",
        "chat_template",
        # the parameters of the calls between (mlx-lm's wrapper, transformers' renderer)
        "self",
        "cls",
        "conversations",
        "kwargs",
        "args",
    }
)


@dataclass(frozen=True, slots=True)
class ChatMessage:
    """One turn. An assistant turn may carry the ``tool_calls`` it made; a ``tool`` turn is
    the result of the call ``tool_call_id``. ``images``: the images among its ``content``,
    each with the character of the text it comes before (``PlacedImage``)."""

    role: str
    content: str
    tool_calls: tuple[ToolCall, ...] = ()
    tool_call_id: str | None = None
    images: tuple[PlacedImage, ...] = ()


@dataclass(frozen=True, slots=True)
class PlacedImage:
    """An image of a message, before the character ``at`` of its text."""

    at: int
    image: ImageInput


@dataclass(frozen=True, slots=True)
class Chat:
    """Chat messages with what else the chat template gets: the ``tools`` the model may call
    and ``template_kwargs`` (a request's ``chat_template_kwargs``, e.g.
    ``{"enable_thinking": False}``)."""

    messages: tuple[ChatMessage, ...]
    tools: tuple[Tool, ...] = ()
    template_kwargs: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        odd = [k for k in self.template_kwargs if not (isinstance(k, str) and k.isidentifier())]
        if odd:  # a template's variables are names
            raise InvalidRequestError(
                f"chat_template_kwargs keys must be names, got {odd[0]!r}",
                param="chat_template_kwargs",
            )
        reserved = sorted(RESERVED_TEMPLATE_KWARGS & set(self.template_kwargs))
        if reserved:
            raise InvalidRequestError(
                f"chat_template_kwargs may not set {', '.join(reserved)}",
                param="chat_template_kwargs",
            )


Prompt = str | Sequence[ChatMessage] | Chat


def check_messages(messages: Sequence[ChatMessage | Mapping[str, Any]]) -> list[ChatMessage]:
    """Validate chat messages; return them as :class:`ChatMessage` values."""
    if len(messages) == 0:
        raise InvalidRequestError("prompt must not be empty", param="prompt")
    checked = []
    for i, message in enumerate(messages):
        if isinstance(message, Mapping):
            role, content = message.get("role"), message.get("content")
            message = ChatMessage(role, content)  # type: ignore[arg-type]  (checked below)
        role, content = message.role, message.content
        if role not in CHAT_ROLES:
            raise InvalidRequestError(
                f"prompt[{i}].role must be one of {sorted(CHAT_ROLES)}, got {role!r}",
                param=f"prompt[{i}].role",
            )
        if not isinstance(content, str):
            raise InvalidRequestError(
                f"prompt[{i}].content must be a string", param=f"prompt[{i}].content"
            )
        checked.append(message)
    return checked


def prompt_images(prompt: Prompt) -> list[ImageInput]:
    """The images of a chat prompt's messages, in order (none for a text prompt)."""
    if isinstance(prompt, str):
        return []
    messages = prompt.messages if isinstance(prompt, Chat) else prompt
    return [placed.image for m in messages for placed in getattr(m, "images", ())]


def encode_prompt(tokenizer: TokenizerWrapper, prompt: Prompt) -> list[int]:
    """Token ids for a plain completion prompt (a string) or a chat (a list of messages).

    Chats go through the model's chat template with the generation prompt appended; a model
    without a template gets its messages joined one per line. Tools go to a template that
    renders them, else into the system message in the generic format
    (``engine/vocabulary/tools.py``).
    """
    if isinstance(prompt, str):
        if prompt == "":
            raise InvalidRequestError("prompt must not be empty", param="prompt")
        ids = tokenizer.encode(prompt, add_special_tokens=True)
        return ids if ids else tokenizer.encode(prompt, add_special_tokens=False)
    return render_chat(tokenizer, prompt, tokenize=True)


def render_chat(
    tokenizer: TokenizerWrapper, prompt: Sequence[ChatMessage] | Chat, *, tokenize: bool
) -> Any:
    """A chat through the model's template (see :func:`encode_prompt`): its token ids, or
    with ``tokenize`` false its text (where a processor still has images to put in)."""
    chat = prompt if isinstance(prompt, Chat) else Chat(tuple(prompt))
    messages = check_messages(chat.messages)
    native = tokenizer.has_chat_template and tokenizer.has_tool_calling
    if not native and (chat.tools or any(m.tool_calls or m.role == "tool" for m in messages)):
        messages = generic_tool_turns(messages, chat.tools)
    if not tokenizer.has_chat_template:
        text = "\n".join(f"{m.role}: {m.content}" for m in messages) + "\nassistant:"
        return tokenizer.encode(text, add_special_tokens=True) if tokenize else text
    kwargs = dict(chat.template_kwargs)
    if native and chat.tools:
        kwargs["tools"] = [t.openai() for t in chat.tools]
    try:
        return (list if tokenize else str)(
            tokenizer.apply_chat_template(
                [template_message(m) for m in messages],
                add_generation_prompt=True,
                tokenize=tokenize,
                **kwargs,
            )
        )
    except TypeError as exc:  # a key that is a parameter of some call on the way
        if not chat.template_kwargs or "argument" not in str(exc):
            raise
        raise InvalidRequestError(
            f"chat_template_kwargs may not set what the template call takes itself ({exc})",
            param="chat_template_kwargs",
        ) from None
    except Exception as exc:  # jinja2's errors, raised by the model's own template
        if type(exc).__module__.split(".")[0] != "jinja2":
            raise
        raise InvalidRequestError(
            f"the model's chat template refused the messages: {exc}", param="prompt"
        ) from None


def template_message(message: ChatMessage) -> dict[str, Any]:
    """A message as chat templates read it (OpenAI's shape, a call's arguments as a value)."""
    out: dict[str, Any] = {"role": message.role, "content": message.content}
    if message.images:
        out["content"] = content_parts(message)
    if message.tool_calls:
        out["tool_calls"] = [
            {
                "id": call.id,
                "type": "function",
                "function": {"name": call.name, "arguments": call.parsed_arguments()},
            }
            for call in message.tool_calls
        ]
    if message.tool_call_id is not None:
        out["tool_call_id"] = message.tool_call_id
    return out


def content_parts(message: ChatMessage) -> list[dict[str, str]]:
    """A message with images as a list of parts, as vision models' templates read it:
    ``{"type": "text", "text": ...}`` and ``{"type": "image"}``, in the order sent."""
    parts: list[dict[str, str]] = []
    done = 0
    for placed in message.images:
        if placed.at > done:
            parts.append({"type": "text", "text": message.content[done : placed.at]})
            done = placed.at
        parts.append({"type": "image"})
    if done < len(message.content):
        parts.append({"type": "text", "text": message.content[done:]})
    return parts


def generic_tool_turns(messages: list[ChatMessage], tools: Sequence[Tool]) -> list[ChatMessage]:
    """The messages in the generic tool format, for a template without tools: the tools in the
    system message, calls as ``<tool_call>`` blocks in the assistant's turns, results as
    ``<tool_response>`` blocks in a user turn (one for consecutive results)."""
    turns: list[ChatMessage] = []
    for message in messages:
        if message.role == "tool":
            block = f"{RESPONSE_START}\n{message.content}\n{RESPONSE_END}"
            if turns and turns[-1].role == "user" and turns[-1].content.endswith(RESPONSE_END):
                turns[-1] = ChatMessage("user", turns[-1].content + "\n" + block)
            else:
                turns.append(ChatMessage("user", block))
        elif message.tool_calls:
            calls = [generic_call_text(call) for call in message.tool_calls]
            text = "\n".join(([message.content] if message.content else []) + calls)
            turns.append(ChatMessage("assistant", text))
        else:
            turns.append(message)
    if tools:
        offered = generic_instructions(tools)
        if turns and turns[0].role == "system":
            turns[0] = ChatMessage("system", turns[0].content + "\n\n" + offered)
        else:
            turns.insert(0, ChatMessage("system", offered))
    return turns


# No tokenizer here spends more than this many characters a token on average: a prompt of more
# characters than the context's tokens times this is over the context before it is rendered.
MAX_CHARS_PER_TOKEN = 32


def check_length_before_rendering(prompt: Prompt, context_length: int) -> None:
    """Raise :class:`ContextLengthExceededError` for a prompt whose text alone is far over the
    context, before its template is rendered and it is tokenized (seconds for 60,000 small
    messages, all holding the GIL)."""
    if isinstance(prompt, str):
        num_chars = len(prompt)
    else:
        messages = prompt.messages if isinstance(prompt, Chat) else prompt
        num_chars = sum(len(getattr(m, "content", "") or "") for m in messages)
    if num_chars > context_length * MAX_CHARS_PER_TOKEN:
        raise ContextLengthExceededError(
            f"This model's maximum context length is {context_length} tokens; the request's "
            f"prompt has {num_chars} characters, far more than that many tokens can hold. "
            "Shorten the prompt.",
            num_chars=num_chars,
            context_length=context_length,
        )


def check_fits(num_prompt_tokens: int, max_tokens: int, context_length: int) -> None:
    """Raise :class:`ContextLengthExceededError` unless prompt + max_tokens fit the context."""
    if num_prompt_tokens + max_tokens > context_length:
        raise ContextLengthExceededError(
            f"This model's maximum context length is {context_length} tokens; the request "
            f"has {num_prompt_tokens} prompt tokens and asks for up to {max_tokens} more "
            f"({num_prompt_tokens + max_tokens} in all). Shorten the prompt or lower max_tokens.",
            num_prompt_tokens=num_prompt_tokens,
            max_tokens=max_tokens,
            context_length=context_length,
        )
