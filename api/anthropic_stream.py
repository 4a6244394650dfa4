"""The Messages API's two answers to one request: ``complete_message``, one message body once
the reply is done, and ``MessageStream``, Anthropic's event sequence as the session produces it:
``message_start``, ``ping``, each content block's ``content_block_start``, ``_delta``
(``text_delta``, ``thinking_delta``, ``input_json_delta``) and ``_stop``, then
``message_delta`` (``stop_reason``, usage) and ``message_stop``; a stream that fails part-way
ends with an ``error`` event. Prefill progress goes out as ``ping``. Both cancel the session
``consumer_closed`` when the client disconnects, as the chat endpoint's answers do
(``api/http_responses.py``, whose ``cancel_on_disconnect`` they share).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any, Literal

import trio
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.types import Send

from ..actors.messages import Completed, Progress, TextDelta, Usage
from ..engine.vocabulary.reply import Called, Content, Piece, Reasoning, ReplySplitter
from . import anthropic_format as fmt
from .http_errors import first_failure, outcome_error
from .http_exchange import Exchange
from .http_responses import SseResponse, cancel_on_disconnect
from .inprocess import SessionHandle
from .openai_format import Reply

Write = Callable[[str, dict[str, Any]], Awaitable[None]]
BlockKind = Literal["text", "thinking", "tool_use"]


@dataclass(frozen=True, slots=True)
class Turn:
    """One Messages request's exchange (one session) and what its ``stop_reason`` needs."""

    exchange: Exchange
    stops: tuple[str, ...]
    detokenize: Callable[[Sequence[int]], str]

    @property
    def handle(self) -> SessionHandle:
        return self.exchange.handles[0]

    @property
    def splitter(self) -> ReplySplitter:
        splitter = self.exchange.splitters[0]
        assert splitter is not None, "a Messages reply is always split"
        return splitter

    def stop_reason(self, token_ids: Sequence[int]) -> tuple[fmt.StopReason | None, str | None]:
        outcome = self.exchange.outcomes[0]
        if not isinstance(outcome, Completed):
            return None, None
        return fmt.stop_reason(
            outcome,
            made_calls=bool(self.splitter.calls),
            stops=self.stops,
            token_ids=token_ids,
            detokenize=self.detokenize,
        )


async def complete_message(request: Request, turn: Turn, headers: dict[str, str]) -> Response:
    """The non-streaming answer: the reply collected, then one message body (or the error of
    its failed or cancelled outcome). A client that disconnects first cancels the session
    ``consumer_closed``; cancelled, the handle is left closed."""
    ex = turn.exchange
    text = ""
    token_ids: list[int] = []
    async with trio.open_nursery() as nursery:
        nursery.start_soon(cancel_on_disconnect, request.receive, ex.handles)
        async for event in ex.events(0, turn.handle):
            if isinstance(event, TextDelta):
                text += event.text
                token_ids.extend(event.token_ids)
        nursery.cancel_scope.cancel()
    failure = first_failure(ex.outcomes)
    if failure is not None:
        error = outcome_error(failure)
        ex.log(error.status)
        return fmt.error_response(error)
    splitter = turn.splitter
    reply = Reply.of(splitter.feed(text) + splitter.finish())
    reason, sequence = turn.stop_reason(token_ids)
    ex.log(200)
    body = fmt.message_body(
        message_id=ex.request_id,
        model=ex.model,
        content=fmt.content_blocks(reply),
        stop_reason=reason,
        stop_sequence=sequence,
        usage=ex.usage(),
    )
    return JSONResponse(body, headers=headers)


class Blocks:
    """The content blocks of a streamed reply, opened and closed as its pieces come: text and
    thinking run on over pieces of their kind; each tool call is a block of its own."""

    def __init__(self, write: Write) -> None:
        self._write = write
        self._index = -1
        self._open: BlockKind | None = None

    async def write(self, pieces: list[Piece]) -> None:
        for piece in pieces:
            match piece:
                case Content(text=text):
                    await self._into("text", {"type": "text", "text": ""})
                    await self._delta({"type": "text_delta", "text": text})
                case Reasoning(text=text):
                    await self._into("thinking", fmt.thinking_block(""))
                    await self._delta({"type": "thinking_delta", "thinking": text})
                case Called(call=call):
                    await self.close()
                    await self._start("tool_use", fmt.tool_use_block(call, streamed=True))
                    await self._delta({"type": "input_json_delta", "partial_json": call.arguments})
                    await self.close()

    async def close(self) -> None:
        """End the open block, if one is."""
        if self._open is not None:
            await self._write("content_block_stop", {"index": self._index})
            self._open = None

    async def _into(self, kind: BlockKind, block: dict[str, Any]) -> None:
        if self._open != kind:
            await self.close()
            await self._start(kind, block)

    async def _start(self, kind: BlockKind, block: dict[str, Any]) -> None:
        self._index += 1
        self._open = kind
        await self._write("content_block_start", {"index": self._index, "content_block": block})

    async def _delta(self, delta: dict[str, Any]) -> None:
        await self._write("content_block_delta", {"index": self._index, "delta": delta})


class MessageStream(SseResponse):
    """An SSE response of Anthropic's events (see the module docstring)."""

    def __init__(
        self, turn: Turn, live: dict[str, list[SessionHandle]], headers: dict[str, str]
    ) -> None:
        super().__init__(turn.exchange, live, headers)
        self.turn = turn

    async def _stream(self, send: Send) -> None:
        turn, ex = self.turn, self.turn.exchange

        async def write(name: str, data: dict[str, Any]) -> None:
            body = fmt.sse_event(name, data)
            await send({"type": "http.response.body", "body": body, "more_body": True})

        prompt = Usage(prompt_tokens=len(turn.handle.prompt_tokens), completion_tokens=0)
        start = fmt.message_body(
            message_id=ex.request_id,
            model=ex.model,
            content=[],
            stop_reason=None,
            stop_sequence=None,
            usage=prompt,
        )
        await write("message_start", {"message": start})
        await write("ping", {})
        blocks = Blocks(write)
        token_ids: list[int] = []
        async with aclosing(ex.events(0, turn.handle)) as events:
            async for event in events:
                match event:
                    case TextDelta(text=text, token_ids=ids):
                        token_ids.extend(ids)
                        await blocks.write(turn.splitter.feed(text))
                    case Progress():
                        await write("ping", {})
                    case Completed():
                        await blocks.write(turn.splitter.finish())
        await blocks.close()
        failure = first_failure(ex.outcomes)
        if failure is not None:
            error = outcome_error(failure)
            await write("error", fmt.error_body(fmt.error_type(error.status), error.message))
            return
        reason, sequence = turn.stop_reason(token_ids)
        delta = {"stop_reason": reason, "stop_sequence": sequence}
        await write("message_delta", {"delta": delta, "usage": fmt.usage_body(ex.usage())})
        await write("message_stop", {})
