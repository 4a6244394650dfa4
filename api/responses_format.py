"""The Responses API's shapes: the response object (``response_body``), its usage, and its
output items built as a reply's pieces arrive (``Output``), with the stream events that build
them (each event a dict without its ``sequence_number``, which the stream numbers).

A reply's pieces become items in order: text a ``message`` item with one ``output_text``
part, thinking a ``reasoning`` item with one ``reasoning_text`` part, each call a
``function_call`` item. An item is open while its pieces come and is done when another kind of
piece comes or the reply ends.
"""

from __future__ import annotations

import copy
import uuid
from collections.abc import Mapping
from typing import Any, Literal

from ..actors.messages import Usage
from ..engine.vocabulary.reply import Called, Content, Piece, Reasoning
from ..engine.vocabulary.tools import ToolCall
from .responses_schemas import ResponsesRequest
from .responses_tools import FunctionChoice, FunctionTool, NamespaceTool

Status = Literal["completed", "incomplete", "failed", "in_progress"]
ItemStatus = Literal["completed", "incomplete"]
Event = dict[str, Any]


def new_id(prefix: str) -> str:
    return prefix + uuid.uuid4().hex[:24]


def usage_body(usage: Usage, reasoning_tokens: int) -> dict[str, Any]:
    return {
        "input_tokens": usage.prompt_tokens,
        # cache writes are not tracked per request: 0 (design/025-responses-api.md)
        "input_tokens_details": {"cached_tokens": usage.cached_tokens, "cache_write_tokens": 0},
        "output_tokens": usage.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
        "total_tokens": usage.total_tokens,
    }


def response_body(
    body: ResponsesRequest,
    *,
    response_id: str,
    created: int,
    status: Status,
    output: list[dict[str, Any]],
    usage: dict[str, Any] | None = None,
    error: dict[str, Any] | None = None,
    incomplete_reason: str | None = None,
) -> dict[str, Any]:
    """The response object: what was asked (as the request said it) and what came of it."""
    text_format = body.text.format if body.text is not None else None
    reasoning = body.reasoning
    return {
        "id": response_id,
        "object": "response",
        "created_at": created,
        "status": status,
        "error": error,
        "incomplete_details": None if incomplete_reason is None else {"reason": incomplete_reason},
        "instructions": body.instructions,
        "max_output_tokens": body.max_output_tokens,
        "model": body.model,
        "output": output,
        "parallel_tool_calls": body.parallel_tool_calls,
        "previous_response_id": body.previous_response_id,
        "reasoning": {
            "effort": reasoning.effort if reasoning else None,
            "summary": reasoning.summary if reasoning else None,
        },
        "store": body.store,
        "temperature": body.temperature,
        "text": {
            "format": (
                text_format.model_dump(by_alias=True, exclude_none=True)
                if text_format is not None
                else {"type": "text"}
            )
        },
        "tool_choice": (
            body.tool_choice.model_dump()
            if isinstance(body.tool_choice, FunctionChoice)
            else body.choice.mode
        ),
        "tools": [
            t.model_dump(exclude_none=True)
            for t in body.tools or ()
            if isinstance(t, FunctionTool | NamespaceTool)
        ],
        "top_p": body.top_p,
        "truncation": body.truncation,
        "usage": usage,
        "metadata": {},
        "user": None,
    }


def call_item(
    call: ToolCall,
    status: str = "completed",
    item_id: str | None = None,
    namespace: str | None = None,
) -> dict:
    """A ``function_call`` item; ``namespace``: the namespace tool the function came in."""
    item = {
        "id": item_id or new_id("fc_"),
        "type": "function_call",
        "status": status,
        "call_id": call.id,
        "name": call.name,
        "arguments": call.arguments,
    }
    return item | {"namespace": namespace} if namespace else item


class Output:
    """A reply's output items, built from its pieces (``add``) until it ends (``close``);
    each call returns the stream events for what it built."""

    def __init__(self, namespace_of: Mapping[str, str] | None = None) -> None:
        """``namespace_of``: the namespace of each namespaced function, by name."""
        self.namespace_of = namespace_of or {}
        self.items: list[dict[str, Any]] = []
        self._open: dict[str, Any] | None = None  # the item that pieces of its kind extend
        self._texts: list[str] = []  # the open item's text so far

    @property
    def calls(self) -> list[dict[str, Any]]:
        return [item for item in self.items if item["type"] == "function_call"]

    def text(self) -> str:
        """The text of the message items (``output_text``, as the SDK joins it)."""
        return "".join(
            part["text"]
            for item in self.items
            if item["type"] == "message"
            for part in item["content"]
        )

    def add(self, pieces: list[Piece]) -> list[Event]:
        events: list[Event] = []
        for piece in pieces:
            match piece:
                case Content(text=text):
                    events += self._extend("message", text)
                case Reasoning(text=text):
                    events += self._extend("reasoning", text)
                case Called(call=call):
                    events += self._close("completed")
                    events += self._call(call)
        return events

    def close(self, status: ItemStatus) -> list[Event]:
        """The reply has ended: the open item is done, with ``status``."""
        return self._close(status)

    def _extend(self, kind: Literal["message", "reasoning"], text: str) -> list[Event]:
        events: list[Event] = []
        if self._open is None or self._open["type"] != kind:
            events += self._close("completed")
            events += self._start(kind)
        assert self._open is not None
        self._texts.append(text)
        where = self._where(self._open)
        if kind == "message":
            events.append(
                {"type": "response.output_text.delta", **where, "delta": text, "logprobs": []}
            )
        else:
            events.append({"type": "response.reasoning_text.delta", **where, "delta": text})
        return events

    def _where(self, item: dict[str, Any]) -> dict[str, Any]:
        return {"item_id": item["id"], "output_index": len(self.items) - 1, "content_index": 0}

    def _start(self, kind: Literal["message", "reasoning"]) -> list[Event]:
        item: dict[str, Any]
        if kind == "message":
            item = {
                "id": new_id("msg_"),
                "type": "message",
                "role": "assistant",
                "status": "in_progress",
                "content": [],
            }
            part = {"type": "output_text", "text": "", "annotations": []}
        else:
            item = {"id": new_id("rs_"), "type": "reasoning", "summary": [], "content": []}
            part = {"type": "reasoning_text", "text": ""}
        self.items.append(item)
        self._open, self._texts = item, []
        added = {"type": "response.output_item.added", "output_index": len(self.items) - 1}
        events = [added | {"item": copy.deepcopy(item)}]
        item["content"].append(part)
        where = self._where(item)
        events.append({"type": "response.content_part.added", **where, "part": dict(part)})
        return events

    def _close(self, status: ItemStatus) -> list[Event]:
        item = self._open
        if item is None:
            return []
        self._open = None
        text = "".join(self._texts)
        part = item["content"][0]
        part["text"] = text
        where = self._where(item)
        if item["type"] == "message":
            item["status"] = status
            done = {"type": "response.output_text.done", **where, "text": text, "logprobs": []}
        else:
            done = {"type": "response.reasoning_text.done", **where, "text": text}
        index = where["output_index"]
        return [
            done,
            {"type": "response.content_part.done", **where, "part": dict(part)},
            {
                "type": "response.output_item.done",
                "output_index": index,
                "item": copy.deepcopy(item),
            },
        ]

    def _call(self, call: ToolCall) -> list[Event]:
        item = call_item(call, namespace=self.namespace_of.get(call.name))
        self.items.append(item)
        index = len(self.items) - 1
        where = {"item_id": item["id"], "output_index": index}
        return [
            {
                "type": "response.output_item.added",
                "output_index": index,
                "item": item | {"status": "in_progress", "arguments": ""},
            },
            {"type": "response.function_call_arguments.delta", **where, "delta": call.arguments},
            {
                "type": "response.function_call_arguments.done",
                **where,
                "name": call.name,
                "arguments": call.arguments,
            },
            {"type": "response.output_item.done", "output_index": index, "item": dict(item)},
        ]
