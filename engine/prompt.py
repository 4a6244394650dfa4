"""Turning a request's prompt (plain text or chat messages) into token ids, with checks."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from mlx_lm.tokenizer_utils import TokenizerWrapper

from .errors import ContextLengthExceededError, InvalidRequestError

CHAT_ROLES = frozenset({"system", "user", "assistant", "developer", "tool"})


@dataclass(frozen=True, slots=True)
class ChatMessage:
    role: str
    content: str


Prompt = str | Sequence[ChatMessage]


def check_messages(messages: Sequence[ChatMessage | Mapping[str, str]]) -> list[ChatMessage]:
    """Validate chat messages; return them as :class:`ChatMessage` values."""
    if len(messages) == 0:
        raise InvalidRequestError("messages must not be empty", param="messages")
    checked = []
    for i, message in enumerate(messages):
        if isinstance(message, Mapping):
            role, content = message.get("role"), message.get("content")
        else:
            role, content = message.role, message.content
        if role not in CHAT_ROLES:
            raise InvalidRequestError(
                f"messages[{i}].role must be one of {sorted(CHAT_ROLES)}, got {role!r}",
                param=f"messages[{i}].role",
            )
        if not isinstance(content, str):
            raise InvalidRequestError(
                f"messages[{i}].content must be a string", param=f"messages[{i}].content"
            )
        checked.append(ChatMessage(role=role, content=content))
    return checked


def encode_prompt(tokenizer: TokenizerWrapper, prompt: Prompt) -> list[int]:
    """Token ids for a plain completion prompt (a string) or a chat (a list of messages).

    Chats go through the model's chat template with the generation prompt appended; a model
    without a template gets its messages joined one per line.
    """
    if isinstance(prompt, str):
        if prompt == "":
            raise InvalidRequestError("prompt must not be empty", param="prompt")
        ids = tokenizer.encode(prompt, add_special_tokens=True)
        return ids if ids else tokenizer.encode(prompt, add_special_tokens=False)
    messages = check_messages(prompt)
    as_dicts = [{"role": m.role, "content": m.content} for m in messages]
    if tokenizer.has_chat_template:
        return list(tokenizer.apply_chat_template(as_dicts, add_generation_prompt=True))
    text = "\n".join(f"{m.role}: {m.content}" for m in messages) + "\nassistant:"
    return tokenizer.encode(text, add_special_tokens=True)


def check_fits(num_prompt_tokens: int, max_tokens: int, context_length: int) -> None:
    """Raise :class:`ContextLengthExceededError` unless prompt + max_tokens fit the context."""
    if num_prompt_tokens + max_tokens > context_length:
        raise ContextLengthExceededError(
            f"This model's maximum context length is {context_length} tokens; the request "
            f"has {num_prompt_tokens} prompt tokens and asks for up to {max_tokens} more "
            f"({num_prompt_tokens + max_tokens} in all). Shorten the prompt or lower max_tokens."
        )
