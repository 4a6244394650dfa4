"""Anthropic Messages API bodies: a message, its content blocks and usage, its ``stop_reason``,
the stream's events, and Anthropic's error shape (``{"type": "error", "error": {...}}``), into
which any ``HttpError`` of a route under ``/v1/messages`` is worded (``error_response``).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from typing import Any, Literal

from starlette.responses import JSONResponse

from ..actors.messages import Completed, Usage
from ..engine.errors import ContextLengthExceededError
from ..engine.vocabulary.tools import ToolCall
from .http_errors import HttpError
from .openai_format import Reply

MESSAGES_PATH = "/v1/messages"
OVERLOADED_STATUS = 529  # Anthropic's status for an overloaded API; its clients retry it

StopReason = Literal["end_turn", "max_tokens", "stop_sequence", "tool_use"]

# Anthropic's error type for each status; any other 4xx is invalid_request_error, 5xx api_error.
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    408: "timeout_error",
    413: "request_too_large",
    429: "rate_limit_error",
    OVERLOADED_STATUS: "overloaded_error",
}


def is_messages_path(path: str) -> bool:
    """Whether ``path`` is one of the Messages API's routes (its errors are Anthropic's)."""
    return path == MESSAGES_PATH or path.startswith(MESSAGES_PATH + "/")


def error_body(type: str, message: str) -> dict[str, Any]:
    return {"type": "error", "error": {"type": type, "message": message}}


def error_response(error: HttpError) -> JSONResponse:
    """``error`` in Anthropic's shape: overload is 529 ``overloaded_error`` (with its
    Retry-After), a prompt over the context in Anthropic's words (which clients read)."""
    status = OVERLOADED_STATUS if error.code == "overloaded" else error.status
    return JSONResponse(
        error_body(error_type(status), anthropic_message(error)),
        status_code=status,
        headers=error.headers,
    )


def error_type(status: int) -> str:
    default = "api_error" if status >= 500 else "invalid_request_error"
    return ERROR_TYPES.get(status, default)


def anthropic_message(error: HttpError) -> str:
    """The error's message, or Anthropic's own words for a prompt over the context:
    ``prompt is too long: N tokens > M maximum`` (Claude Code reads the counts to compact)."""
    exc = error.refusal
    if not isinstance(exc, ContextLengthExceededError) or exc.context_length is None:
        return error.message
    limit = exc.context_length
    if exc.num_prompt_tokens is None:  # refused by its characters, before it was tokenized
        at_least = (exc.num_chars or 0) // 32
        return f"prompt is too long: {at_least} tokens > {limit} maximum (at least, by its length)"
    if exc.num_prompt_tokens > limit or exc.max_tokens is None:
        return f"prompt is too long: {exc.num_prompt_tokens} tokens > {limit} maximum"
    return (
        f"input length and `max_tokens` exceed context limit: {exc.num_prompt_tokens} + "
        f"{exc.max_tokens} > {limit}, decrease input length or `max_tokens` and try again"
    )


def usage_body(usage: Usage) -> dict[str, Any]:
    """Anthropic counts the prompt's tokens read from the cache apart from ``input_tokens``:
    the prompt is their sum."""
    return {
        "input_tokens": usage.prompt_tokens - usage.cached_tokens,
        "output_tokens": usage.completion_tokens,
        "cache_read_input_tokens": usage.cached_tokens,
        "cache_creation_input_tokens": 0,
    }


def tool_use_id(call: ToolCall) -> str:
    """Anthropic's ``toolu_`` id for a call (the same one each time it is asked)."""
    return "toolu_" + call.id.removeprefix("call_")


def tool_use_block(call: ToolCall, *, streamed: bool = False) -> dict[str, Any]:
    """A ``tool_use`` block; ``streamed``: its ``input`` empty, to come as JSON deltas."""
    arguments = call.parsed_arguments()
    if not isinstance(arguments, dict):
        arguments = {"arguments": arguments}
    return {
        "type": "tool_use",
        "id": tool_use_id(call),
        "name": call.name,
        "input": {} if streamed else arguments,
    }


def thinking_block(text: str) -> dict[str, Any]:
    """A thinking block; its ``signature`` (which Anthropic's clients require) is empty: no
    one here verifies it."""
    return {"type": "thinking", "thinking": text, "signature": ""}


def content_blocks(reply: Reply) -> list[dict[str, Any]]:
    blocks = [thinking_block(reply.reasoning)] if reply.reasoning else []
    if reply.content:
        blocks.append({"type": "text", "text": reply.content})
    blocks.extend(tool_use_block(call) for call in reply.calls)
    return blocks


def message_body(
    *,
    message_id: str,
    model: str,
    content: list[dict[str, Any]],
    stop_reason: StopReason | None,
    stop_sequence: str | None,
    usage: Usage,
) -> dict[str, Any]:
    return {
        "id": message_id,
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": content,
        "stop_reason": stop_reason,
        "stop_sequence": stop_sequence,
        "usage": usage_body(usage),
    }


def stop_reason(
    outcome: Completed,
    *,
    made_calls: bool,
    stops: Sequence[str],
    token_ids: Sequence[int],
    detokenize: Callable[[Sequence[int]], str],
) -> tuple[StopReason, str | None]:
    """Why the reply ended, and the stop sequence that ended it. A stop string ended it where
    ``stop`` came with every generated token delivered: an end-of-sequence token is counted
    and not delivered, the token that completes a stop string is delivered (its text cut).
    Which string: the first in the text of the tokens (``detokenize``)."""
    if outcome.finish_reason == "length":
        return "max_tokens", None
    if made_calls:
        return "tool_use", None
    if stops and outcome.usage.completion_tokens == outcome.committed_tokens:
        text = detokenize(token_ids)
        found = [(text.find(s), i) for i, s in enumerate(stops) if s in text]
        if found:
            return "stop_sequence", stops[min(found)[1]]
    return "end_turn", None


def sse_event(name: str, data: dict[str, Any]) -> bytes:
    """One event of Anthropic's stream: its name, and its JSON (whose ``type`` is the name)."""
    payload = json.dumps({"type": name, **data}, separators=(",", ":"), ensure_ascii=False)
    return f"event: {name}\ndata: {payload}\n\n".encode()
