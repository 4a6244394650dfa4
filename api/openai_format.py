"""Response bodies and stream chunks in OpenAI's shapes, and its error shape."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal

from ..actors.messages import Usage
from ..engine.outputs import TokenLogprob

Kind = Literal["chat", "text"]
TokenText = Callable[[int], str]


def error_body(
    message: str, *, type: str, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def usage_body(usage: Usage) -> dict[str, Any]:
    return {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.total_tokens,
        "prompt_tokens_details": {"cached_tokens": usage.cached_tokens},
    }


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
    )


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
    kind: Kind, index: int, text: str, finish_reason: str | None, logprobs: Any
) -> dict[str, Any]:
    if kind == "chat":
        message = {"role": "assistant", "content": text}
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
) -> dict[str, Any]:
    if kind == "chat":
        delta: dict[str, Any] = {}
        if role:
            delta["role"] = "assistant"
        if text is not None:
            delta["content"] = text
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


def usage_chunk(kind: Kind, *, request_id: str, created: int, model: str, usage: Usage) -> dict:
    return {
        "id": request_id,
        "object": "chat.completion.chunk" if kind == "chat" else "text_completion",
        "created": created,
        "model": model,
        "choices": [],
        "usage": usage_body(usage),
    }
