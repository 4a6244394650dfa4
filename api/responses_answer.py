"""How a response answers: ``respond``, the response object once the reply is done, or
``ResponseEventStream``, the Responses API's typed SSE events as the reply is made
(``response.created``, ``response.in_progress``, each item's events, then
``response.completed``, ``response.incomplete`` or ``response.failed``; each event numbered by
its ``sequence_number``). Both cancel the session ``consumer_closed`` when the client
disconnects (``http_responses.cancel_on_disconnect``), and both record the outcome, metrics and
log line through the ``Exchange``.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Any

import trio
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.types import Send

from ..actors.messages import Cancelled, Completed, Event, Failed, Progress, TextDelta
from ..engine.vocabulary.prompt import ChatMessage
from ..engine.vocabulary.reply import ReplySplitter, ReplySyntax
from ..engine.vocabulary.tools import ToolCall
from .http_errors import first_failure, outcome_error
from .http_exchange import Exchange
from .http_responses import SseResponse, cancel_on_disconnect, sse
from .inprocess import SessionHandle
from .responses_format import Output, Status, response_body, usage_body
from .responses_schemas import ResponsesRequest
from .responses_store import StoredResponse, stored


class ReasoningTokens:
    """How many of a reply's tokens are thinking: those from the thinking block's start (or
    the reply's, where the prompt opened the block) to its end, both markers counted."""

    def __init__(self, syntax: ReplySyntax, prompt_tokens: Sequence[int]) -> None:
        self.markers = syntax.think_ids
        self.is_thinking = syntax.opens_thinking(prompt_tokens)
        self.count = 0
        self._tail: tuple[int, ...] = ()

    def feed(self, token_ids: Sequence[int]) -> None:
        if self.markers is None:
            return
        start, end = self.markers
        for token in token_ids:
            self._tail = (*self._tail, token)[-max(len(start), len(end)) :]
            if self.is_thinking:
                self.count += 1
                self.is_thinking = self._tail[-len(end) :] != end
            elif self._tail[-len(start) :] == start:
                self.is_thinking = True
                self.count += len(start)


@dataclass
class ResponseRun:
    """One response as its session's events arrive: its output items, its thinking tokens,
    and, once done, its object (kept with ``keep`` where the request asked to store it)."""

    ex: Exchange
    body: ResponsesRequest
    splitter: ReplySplitter
    reasoning: ReasoningTokens
    turns: tuple[ChatMessage, ...]  # what it answers, without the instructions
    owner: int | None  # the API key's index, for the store
    keep: Callable[[str, StoredResponse], None]
    output: Output = field(init=False)

    def __post_init__(self) -> None:
        self.output = Output(self.body.namespace_of)

    @property
    def response_id(self) -> str:
        return self.ex.request_id

    def on_event(self, event: Event) -> list[dict[str, Any]]:
        """The stream events that ``event`` makes."""
        match event:
            case TextDelta(text=text, token_ids=token_ids):
                self.reasoning.feed(token_ids)
                return self.output.add(self.splitter.feed(text))
            case Completed(finish_reason=reason):
                events = self.output.add(self.splitter.finish())
                return events + self.output.close(
                    "incomplete" if reason == "length" else "completed"
                )
            case Cancelled() | Failed():
                return self.output.close("incomplete")
        return []

    def snapshot(self, status: Status) -> dict[str, Any]:
        """The response object as it stands, without usage (``response.created``)."""
        return response_body(
            self.body,
            response_id=self.response_id,
            created=self.ex.created,
            status=status,
            output=[],
        )

    def finish(self) -> dict[str, Any]:
        """The response object once the outcome is in; a completed one is stored if asked."""
        outcome = self.ex.outcomes[0]
        usage = usage_body(self.ex.usage(of=(Completed, Cancelled)), self.reasoning.count)
        status: Status = "completed"
        error = incomplete = None
        match outcome:
            case Completed(finish_reason="length"):
                status, incomplete = "incomplete", "max_output_tokens"
            case Completed():
                pass
            case _:
                status = "failed"
                # The Responses API's codes are a closed set: ours goes in the message.
                failure = outcome_error(outcome).body["error"]
                message = f"{failure['message']} ({failure['code']})"
                error = {"code": "server_error", "message": message}
        body = response_body(
            self.body,
            response_id=self.response_id,
            created=self.ex.created,
            status=status,
            output=self.output.items,
            usage=usage,
            error=error,
            incomplete_reason=incomplete,
        )
        if self.body.store and status != "failed":
            self.keep(self.response_id, stored(self.owner, (*self.turns, self.reply()), body))
        return body

    def reply(self) -> ChatMessage:
        """The reply as the assistant's turn, for a follow-up's history."""
        calls = tuple(ToolCall(c["name"], c["arguments"], c["call_id"]) for c in self.output.calls)
        return ChatMessage("assistant", self.output.text(), calls)


async def respond(request: Request, run: ResponseRun, headers: dict[str, str]) -> Response:
    """The response object once the reply is done, or the error of its failed outcome. A
    client that disconnects first cancels the session ``consumer_closed``. Cancelled, it
    leaves the handle closed, which cancels a session without an outcome."""
    ex = run.ex
    async with trio.open_nursery() as nursery:
        nursery.start_soon(cancel_on_disconnect, request.receive, ex.handles)
        async with aclosing(ex.events(0, ex.handles[0])) as events:
            async for event in events:
                run.on_event(event)
        nursery.cancel_scope.cancel()
    failure = first_failure(ex.outcomes)
    if failure is not None:
        error = outcome_error(failure)
        ex.log(error.status)
        return JSONResponse(error.body, status_code=error.status, headers=headers)
    body = run.finish()
    ex.log(200)
    return JSONResponse(body, headers=headers)


class ResponseEventStream(SseResponse):
    """The SSE answer: the Responses API's events as the reply is made."""

    def __init__(
        self, run: ResponseRun, live: dict[str, list[SessionHandle]], headers: dict[str, str]
    ) -> None:
        super().__init__(run.ex, live, headers)
        self.run = run
        self.sequence_number = 0

    async def _stream(self, send: Send) -> None:
        run = self.run

        async def write(events: list[dict[str, Any]] | bytes) -> None:
            if isinstance(events, bytes):
                body = events
            else:
                body = b"".join(self._framed(event) for event in events)
            if body:
                await send({"type": "http.response.body", "body": body, "more_body": True})

        await write(
            [
                {"type": "response.created", "response": run.snapshot("in_progress")},
                {"type": "response.in_progress", "response": run.snapshot("in_progress")},
            ]
        )
        await self._events(write)
        body = run.finish()
        kind = {"completed": "completed", "incomplete": "incomplete"}.get(body["status"], "failed")
        await write([{"type": f"response.{kind}", "response": body}])

    async def _events(
        self, write: Callable[[list[dict[str, Any]] | bytes], Awaitable[None]]
    ) -> None:
        ex = self.run.ex
        async with aclosing(ex.events(0, ex.handles[0])) as events:
            async for event in events:
                if isinstance(event, Progress):
                    await write(f": prefill {event.done}/{event.total}\n\n".encode())
                else:
                    await write(self.run.on_event(event))

    def _framed(self, event: dict[str, Any]) -> bytes:
        """One event as SSE, numbered, with its type as the SSE event name (as OpenAI's)."""
        numbered = event | {"sequence_number": self.sequence_number}
        self.sequence_number += 1
        return f"event: {event['type']}\n".encode() + sse(numbered)
