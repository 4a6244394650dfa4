"""Response bodies and stream chunks in OpenAI's shapes, and its error shape."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

from ..actors.messages import Usage
from ..engine.outputs import TokenLogprob
from ..engine.vocabulary.reply import Called, Content, Piece, Reasoning
from ..engine.vocabulary.tools import ToolCall

Kind = Literal["chat", "text"]
TokenText = Callable[[int], str]


def error_body(
    message: str, *, type: str, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def usage_body(usage: Usage) -> dict[str, Any]:
    """OpenAI's usage; a session that speculated adds its drafts as OpenAI counts a predicted
    output's (``accepted_prediction_tokens``, ``rejected_prediction_tokens``) and, as an
    extension, ``drafted_tokens``."""
    body: dict[str, Any] = {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.total_tokens,
        "prompt_tokens_details": {"cached_tokens": usage.cached_tokens},
    }
    if usage.drafted_tokens:
        body["completion_tokens_details"] = {
            "accepted_prediction_tokens": usage.accepted_tokens,
            "rejected_prediction_tokens": usage.drafted_tokens - usage.accepted_tokens,
            "drafted_tokens": usage.drafted_tokens,
        }
    return body


def sum_usage(usages: list[Usage | None], *, choices_per_prompt: int) -> Usage:
    """The usage of a request's choices, in order, ``choices_per_prompt`` (``n``) to a prompt;
    None for a choice without usage. As OpenAI counts: each prompt's tokens once however many
    choices it has, summed over the prompts; every choice's completion tokens."""
    prompts = [
        next((u for u in usages[i : i + choices_per_prompt] if u is not None), None)
        for i in range(0, len(usages), choices_per_prompt)
    ]
    return Usage(
        prompt_tokens=sum(u.prompt_tokens for u in prompts if u is not None),
        completion_tokens=sum(u.completion_tokens for u in usages if u is not None),
        cached_tokens=sum(u.cached_tokens for u in prompts if u is not None),
        drafted_tokens=sum(u.drafted_tokens for u in usages if u is not None),
        accepted_tokens=sum(u.accepted_tokens for u in usages if u is not None),
        images=sum(u.images for u in prompts if u is not None),
        image_pixels=sum(u.image_pixels for u in prompts if u is not None),
    )


@dataclass
class Reply:
    """A whole chat reply, split: its content, reasoning and tool calls."""

    content: str = ""
    reasoning: str = ""
    calls: list[ToolCall] = field(default_factory=list)

    @classmethod
    def of(cls, pieces: list[Piece]) -> Reply:
        reply = cls()
        for piece in pieces:
            match piece:
                case Content(text=text):
                    reply.content += text
                case Reasoning(text=text):
                    reply.reasoning += text
                case Called(call=call):
                    reply.calls.append(call)
        return reply


def chat_logprobs(records: list[TokenLogprob], token_text: TokenText) -> dict[str, Any]:
    def entry(token: int, logprob: float) -> dict[str, Any]:
        text = token_text(token)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

    return {
        "content": [
            entry(r.token, r.logprob) | {"top_logprobs": [entry(token, lp) for token, lp in r.top]}
            for r in records
        ]
    }


def text_logprobs(
    records: list[TokenLogprob], token_text: TokenText, offset: int = 0
) -> dict[str, Any]:
    tokens = [token_text(r.token) for r in records]
    offsets = []
    for text in tokens:
        offsets.append(offset)
        offset += len(text)
    return {
        "tokens": tokens,
        "token_logprobs": [r.logprob for r in records],
        "top_logprobs": [{token_text(t): lp for t, lp in r.top} for r in records],
        "text_offset": offsets,
    }


def logprobs_body(
    kind: Kind, records: list[TokenLogprob] | None, token_text: TokenText
) -> dict[str, Any] | None:
    if records is None:
        return None
    return (
        chat_logprobs(records, token_text) if kind == "chat" else text_logprobs(records, token_text)
    )


def completion_body(
    kind: Kind,
    *,
    request_id: str,
    created: int,
    model: str,
    choices: list[dict[str, Any]],
    usage: Usage,
) -> dict[str, Any]:
    return {
        "id": request_id,
        "object": "chat.completion" if kind == "chat" else "text_completion",
        "created": created,
        "model": model,
        "choices": choices,
        "usage": usage_body(usage),
    }


def choice_body(
    kind: Kind,
    index: int,
    text: str,
    finish_reason: str | None,
    logprobs: Any,
    reply: Reply | None = None,
) -> dict[str, Any]:
    """``reply``: a chat reply split into content, reasoning and tool calls (else ``text`` is
    the content)."""
    if kind == "chat":
        message: dict[str, Any] = {"role": "assistant", "content": text}
        if reply is not None:
            message["content"] = reply.content if reply.content or not reply.calls else None
            if reply.reasoning:
                message["reasoning_content"] = reply.reasoning
            if reply.calls:
                message["tool_calls"] = [call.openai() for call in reply.calls]
        return {
            "index": index,
            "message": message,
            "finish_reason": finish_reason,
            "logprobs": logprobs,
        }
    return {"index": index, "text": text, "finish_reason": finish_reason, "logprobs": logprobs}


def chunk_body(
    kind: Kind,
    *,
    request_id: str,
    created: int,
    model: str,
    index: int,
    text: str | None = None,
    role: bool = False,
    finish_reason: str | None = None,
    logprobs: Any = None,
    reasoning: str | None = None,
    tool_call: tuple[int, ToolCall] | None = None,
) -> dict[str, Any]:
    """A chat chunk's delta holds ``text`` as its content, or ``reasoning`` (its
    ``reasoning_content``), or one ``tool_call`` (its index among the reply's calls, and it)."""
    if kind == "chat":
        delta: dict[str, Any] = {}
        if role:
            delta["role"] = "assistant"
        if text is not None:
            delta["content"] = text
        if reasoning is not None:
            delta["reasoning_content"] = reasoning
        if tool_call is not None:
            delta["tool_calls"] = [{"index": tool_call[0]} | tool_call[1].openai()]
        choice = {"index": index, "delta": delta, "finish_reason": finish_reason}
    else:
        choice = {"index": index, "text": text or "", "finish_reason": finish_reason}
    choice["logprobs"] = logprobs
    return {
        "id": request_id,
        "object": "chat.completion.chunk" if kind == "chat" else "text_completion",
        "created": created,
        "model": model,
        "choices": [choice],
    }


class TextChunks:
    """The SSE bytes of a stream's common chunk, one that carries only text (no logprobs, no
    finish reason): what ``chunk_body`` would give, encoded as the stream encodes it, from a
    template per choice, so that a token's chunk is not a dict built and encoded anew (the
    chunk's JSON was 12% of the event loop's time at 128 streams, design/030 section 6)."""

    def __init__(self, kind: Kind, *, request_id: str, created: int, model: str) -> None:
        self._kind = kind
        head = chunk_body(kind, request_id=request_id, created=created, model=model, index=0)
        del head["choices"]
        self._head = json.dumps(head, separators=(",", ":"))[:-1]  # the closing brace cut
        self._parts: dict[int, tuple[bytes, bytes]] = {}

    def __call__(self, index: int, text: str) -> bytes:
        if (parts := self._parts.get(index)) is None:
            opening = '"delta":{"content":' if self._kind == "chat" else '"text":'
            closing = "}" if self._kind == "chat" else ""
            prefix = f'data: {self._head},"choices":[{{"index":{index},{opening}'
            suffix = f'{closing},"finish_reason":null,"logprobs":null}}]}}\n\n'
            parts = self._parts[index] = (prefix.encode(), suffix.encode())
        return parts[0] + json.dumps(text).encode() + parts[1]


def usage_chunk(kind: Kind, *, request_id: str, created: int, model: str, usage: Usage) -> dict:
    return {
        "id": request_id,
        "object": "chat.completion.chunk" if kind == "chat" else "text_completion",
        "created": created,
        "model": model,
        "choices": [],
        "usage": usage_body(usage),
    }
