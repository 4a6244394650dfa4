"""The two ways a generation answers: ``complete``, one JSON body once every choice is done,
and ``EventStream``, an SSE response of chunks as the sessions produce them, then ``[DONE]``
(a stream that fails part-way sends an error event first; prefill progress goes out as SSE
comments). Both cancel the request's sessions ``consumer_closed`` when the client disconnects.
The bodies' shapes are ``api/openai_format.py``'s; the SSE framing is here.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from contextlib import aclosing
from typing import Any

import trio
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.types import Receive, Scope, Send

from ..actors.messages import Completed, Event, Progress, TextDelta
from ..engine.outputs import TokenLogprob
from ..engine.vocabulary.reply import Called, Content, Piece, Reasoning
from . import openai_format as fmt
from .http_errors import first_failure, outcome_error
from .http_exchange import Exchange
from .inprocess import SessionHandle


def sse(data: dict[str, Any] | str) -> bytes:
    payload = data if isinstance(data, str) else json.dumps(data, separators=(",", ":"))
    return f"data: {payload}\n\n".encode()


SSE_DONE = sse("[DONE]")


async def cancel_on_disconnect(receive: Receive, handles: list[SessionHandle]) -> None:
    """Wait for the client to go away; then cancel its sessions ``consumer_closed``."""
    while (await receive())["type"] != "http.disconnect":
        pass
    for handle in handles:
        handle.cancel_nowait("consumer_closed")


async def complete(request: Request, ex: Exchange, headers: dict[str, str]) -> Response:
    """The non-streaming answer: every choice collected, then one JSON body (or the first
    failed choice's error). A client that disconnects first cancels the sessions
    ``consumer_closed``. Cancelled, it leaves every handle closed, which cancels a session
    without an outcome ``consumer_closed``."""
    texts = [""] * len(ex.handles)
    logprobs: list[list[TokenLogprob] | None] = [None] * len(ex.handles)

    async def collect(index: int, handle: SessionHandle) -> None:
        async for event in ex.events(index, handle):
            if isinstance(event, TextDelta):
                texts[index] += event.text
                if event.logprobs is not None:
                    logprobs[index] = (logprobs[index] or []) + list(event.logprobs)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(cancel_on_disconnect, request.receive, ex.handles)
        async with trio.open_nursery() as sessions:
            for index, handle in enumerate(ex.handles):
                sessions.start_soon(collect, index, handle)
        nursery.cancel_scope.cancel()

    failure = first_failure(ex.outcomes)
    if failure is not None:
        error = outcome_error(failure)
        ex.log(error.status)
        return JSONResponse(error.body, status_code=error.status, headers=headers)
    choices = []
    for i, outcome in enumerate(ex.outcomes):
        splitter = ex.splitters[i]
        reply = None
        if splitter is not None:
            reply = fmt.Reply.of(splitter.feed(texts[i]) + splitter.finish())
        reason = outcome.finish_reason if isinstance(outcome, Completed) else None
        choices.append(
            fmt.choice_body(
                ex.kind,
                i,
                texts[i],
                ex.finish_reason(i, reason),
                fmt.logprobs_body(ex.kind, logprobs[i], ex.token_text),
                reply,
            )
        )
    usage = ex.usage()
    ex.log(200)
    return JSONResponse(
        fmt.completion_body(
            ex.kind,
            request_id=ex.request_id,
            created=ex.created,
            model=ex.model,
            choices=choices,
            usage=usage,
        ),
        headers=headers,
    )


class SseResponse:
    """An SSE answer to one exchange: the stream's head, the body ``_stream`` writes, and the
    end; a client that disconnects cancels the sessions ``consumer_closed``. Listed in ``live``
    (the running requests by id) while it streams, so that it can be cancelled by id; logged
    once, with 499 for a client gone. Each API's stream is one of these."""

    def __init__(
        self, exchange: Exchange, live: dict[str, list[SessionHandle]], headers: dict[str, str]
    ) -> None:
        self.ex = exchange
        self.live = live
        self.headers = headers

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        ex = self.ex
        self.live[ex.request_id] = ex.handles
        headers = [
            (b"content-type", b"text/event-stream; charset=utf-8"),
            (b"cache-control", b"no-cache"),
            *[(k.lower().encode(), v.encode()) for k, v in self.headers.items()],
        ]
        status = 200
        try:
            await send({"type": "http.response.start", "status": 200, "headers": headers})
            async with trio.open_nursery() as nursery:
                nursery.start_soon(cancel_on_disconnect, receive, ex.handles)
                await self._stream(send)
                nursery.cancel_scope.cancel()
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        except OSError:
            status = 499
            for handle in ex.handles:
                handle.cancel_nowait("consumer_closed")
        finally:
            del self.live[ex.request_id]
            ex.log(status)

    async def _stream(self, send: Send) -> None:
        """Write the body's events (``more_body``), until the sessions end."""
        raise NotImplementedError


class EventStream(SseResponse):
    """OpenAI's SSE response: chunks as the sessions produce them, then ``[DONE]``."""

    def __init__(
        self,
        exchange: Exchange,
        live: dict[str, list[SessionHandle]],
        include_usage: bool,
        headers: dict[str, str],
    ) -> None:
        super().__init__(exchange, live, headers)
        self.include_usage = include_usage
        # Logprobs of tokens whose text a reply splitter holds, by choice, until it is sent.
        self._held_logprobs: dict[int, list[TokenLogprob]] = {}
        ex = exchange
        self._text_chunks = fmt.TextChunks(
            ex.kind, request_id=ex.request_id, created=ex.created, model=ex.model
        )

    async def _stream(self, send: Send) -> None:
        ex = self.ex

        async def write(data: dict[str, Any] | bytes) -> None:
            body = data if isinstance(data, bytes) else sse(data)
            await send({"type": "http.response.body", "body": body, "more_body": True})

        def chunk(index: int, **kwargs: Any) -> dict[str, Any]:
            return fmt.chunk_body(
                ex.kind,
                request_id=ex.request_id,
                created=ex.created,
                model=ex.model,
                index=index,
                **kwargs,
            )

        if ex.kind == "chat":
            for index in range(len(ex.handles)):
                await write(chunk(index, role=True, text=""))
        if len(ex.handles) == 1:  # the common case: no task between the session and the socket
            async with aclosing(ex.events(0, ex.handles[0])) as events:
                async for event in events:
                    await self._write_event(write, chunk, 0, event)
        else:
            await self._merge(write, chunk)
        failure = first_failure(ex.outcomes)
        if failure is not None:
            await write(outcome_error(failure).body)
        elif self.include_usage:
            usage = ex.usage()
            await write(
                fmt.usage_chunk(
                    ex.kind,
                    request_id=ex.request_id,
                    created=ex.created,
                    model=ex.model,
                    usage=usage,
                )
            )
        await write(SSE_DONE)

    async def _merge(
        self, write: Callable[[dict[str, Any] | bytes], Any], chunk: Callable[..., dict[str, Any]]
    ) -> None:
        """Write the events of several choices (``n`` > 1) as each session produces them."""
        ex = self.ex
        merged_send, merged = trio.open_memory_channel[tuple[int, Event]](0)

        async def pump(index: int, handle: SessionHandle, out: trio.MemorySendChannel) -> None:
            async with out:
                async for event in ex.events(index, handle):
                    await out.send((index, event))

        async with trio.open_nursery() as nursery, merged:
            async with merged_send:
                for index, handle in enumerate(ex.handles):
                    nursery.start_soon(pump, index, handle, merged_send.clone())
            async for index, event in merged:
                await self._write_event(write, chunk, index, event)

    async def _write_event(
        self,
        write: Callable[[dict[str, Any] | bytes], Any],
        chunk: Callable[..., dict[str, Any]],
        index: int,
        event: Event,
    ) -> None:
        ex = self.ex
        splitter = ex.splitters[index]
        match event:
            case TextDelta(text=text, logprobs=records):
                held = self._held_logprobs
                if records is not None:
                    held[index] = held.get(index, []) + list(records)
                if splitter is None:
                    await self._write_text(write, chunk, index, text)
                else:
                    await self._write_pieces(write, chunk, index, splitter.feed(text))
            case Progress(done=done, total=total):
                await write(f": prefill {done}/{total}\n\n".encode())
            case Completed(finish_reason=reason):
                if splitter is not None:
                    await self._write_pieces(write, chunk, index, splitter.finish())
                await write(
                    chunk(
                        index,
                        text=None if ex.kind == "chat" else "",
                        finish_reason=ex.finish_reason(index, reason),
                    )
                )

    async def _write_text(
        self,
        write: Callable[[dict[str, Any] | bytes], Any],
        chunk: Callable[..., dict[str, Any]],
        index: int,
        text: str,
    ) -> None:
        """A chunk of ``text``, with the logprobs held if any (else from the template)."""
        if (logprobs := self._logprobs(index)) is None:
            await write(self._text_chunks(index, text))
        else:
            await write(chunk(index, text=text, logprobs=logprobs))

    def _logprobs(self, index: int) -> Any:
        """The logprobs body of the tokens not yet sent with a chunk (None: none asked)."""
        records = self._held_logprobs.pop(index, None)
        return fmt.logprobs_body(self.ex.kind, records, self.ex.token_text)

    async def _write_pieces(
        self,
        write: Callable[[dict[str, Any] | bytes], Any],
        chunk: Callable[..., dict[str, Any]],
        index: int,
        pieces: list[Piece],
    ) -> None:
        """A chunk for each piece of a split reply; the logprobs held go with the first."""
        for piece in pieces:
            match piece:
                case Content(text=text):
                    await self._write_text(write, chunk, index, text)
                case Reasoning(text=text):
                    await write(chunk(index, reasoning=text, logprobs=self._logprobs(index)))
                case Called(call=call, index=number):
                    logprobs = self._logprobs(index)
                    await write(chunk(index, tool_call=(number, call), logprobs=logprobs))
