"""The OpenAI-compatible HTTP app (Starlette on Hypercorn's Trio worker).

Every request is checked before any engine work and without an admission permit: body size
(413 before reading), UTF-8 and JSON (400), schema and ranges (400 with ``param``), model id
(404, configured ids only), context length (400, before any SSE byte). Overload answers 503 with
``Retry-After``. A client that disconnects, streaming or not, cancels its sessions
``consumer_closed``. Errors use OpenAI's shape; a stream that fails part-way sends an error event
and then ``[DONE]``. Why Starlette: design/005-http.md.
"""

from __future__ import annotations

import hmac
import logging
import time
import uuid
from collections.abc import AsyncGenerator, Callable, Sequence
from contextlib import aclosing
from dataclasses import asdict, dataclass, field
from typing import Any

import trio
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

from mlx_trio.actors.messages import (
    Cancelled,
    Completed,
    Event,
    Failed,
    GenerationRequest,
    Outcome,
    Progress,
    TextDelta,
    Usage,
    describe,
)
from mlx_trio.api import openai_format as fmt
from mlx_trio.api.http_errors import HttpError, first_failure, outcome_error, refusal_error
from mlx_trio.api.http_input import parse, read_json
from mlx_trio.api.http_state import AppState, HttpSettings
from mlx_trio.api.inprocess import RuntimeHandle, SessionHandle
from mlx_trio.api.metrics import Metrics
from mlx_trio.api.schemas import ChatCompletionRequest, CompletionRequest
from mlx_trio.engine.errors import (
    ContextLengthExceededError,
    InvalidRequestError,
    OverloadedError,
    RuntimeClosedError,
    RuntimeRefusal,
)
from mlx_trio.engine.outputs import TokenLogprob
from mlx_trio.engine.prompt import ChatMessage
from mlx_trio.engine.sampling_defaults import (
    applied,
)

logger = logging.getLogger("mlx_trio.http")


# -- generation --------------------------------------------------------------------------


@dataclass
class Exchange:
    """One HTTP generation request: its sessions, the outcomes they record on the way (with
    the metrics they feed), and its log line."""

    request_id: str
    kind: fmt.Kind
    model: str
    handles: list[SessionHandle]
    token_text: Callable[[int], str]
    metrics: Metrics
    n: int = 1  # choices to a prompt: handles[p * n : (p + 1) * n] share prompt p
    created: int = field(default_factory=lambda: int(time.time()))
    started: float = field(default_factory=time.perf_counter)
    outcomes: list[Outcome | None] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.outcomes = [None] * len(self.handles)

    def usage(self, *, of: type | tuple[type, ...] = Completed) -> Usage:
        """The usage of the sessions whose outcome is an ``of``: each prompt's tokens once,
        every choice's completion tokens."""
        usages = [o.usage if isinstance(o, of) else None for o in self.outcomes]
        return fmt.sum_usage(usages, choices_per_prompt=self.n)

    async def events(self, index: int, handle: SessionHandle) -> AsyncGenerator[Event, None]:
        """Session ``index``'s events, recording its outcome and metrics on the way; where the
        events end without the outcome (not sent to a slow reader), it is awaited and recorded.
        Cancelled or closed early, the handle is closed (which cancels a session without an
        outcome ``consumer_closed``) and no outcome is recorded."""
        metrics = self.metrics
        last_text_at: float | None = None
        async with handle:
            async for event in handle:
                if isinstance(event, TextDelta):
                    now = time.perf_counter()
                    if last_text_at is not None:
                        metrics.inter_token.observe(now - last_text_at)
                    last_text_at = now
                elif isinstance(event, Completed | Cancelled | Failed):
                    self.outcomes[index] = event
                    self._count(event)
                yield event
        if self.outcomes[index] is None:  # the handle was closed before its outcome arrived
            self.outcomes[index] = outcome = await handle.result()
            self._count(outcome)

    def _count(self, outcome: Outcome) -> None:
        metrics = self.metrics
        endpoint = "chat" if self.kind == "chat" else "completions"
        match outcome:
            case Completed(usage=usage, timings=timings):
                metrics.requests.labels(endpoint, "completed").inc()
                metrics.prompt_tokens.inc(usage.prompt_tokens)
                metrics.generated_tokens.inc(usage.completion_tokens)
                if timings.ttft_s is not None:
                    metrics.ttft.observe(timings.ttft_s)
            case Cancelled(reason=reason, usage=usage):
                metrics.requests.labels(endpoint, "cancelled").inc()
                metrics.cancellations.labels(reason).inc()
                metrics.generated_tokens.inc(usage.completion_tokens)
            case Failed():
                metrics.requests.labels(endpoint, "failed").inc()

    def log(self, status: int) -> None:
        """The request's one log line: its status, each choice's outcome, usage and timings."""
        done = [o for o in self.outcomes if o is not None]
        usage = self.usage(of=(Completed, Cancelled))
        ttfts = [o.timings.ttft_s for o in done if isinstance(o, Completed) and o.timings.ttft_s]
        summary = ",".join(describe(o) for o in done)
        logger.info(
            "%s status=%d outcome=%s prompt_tokens=%d completion_tokens=%d ttft=%s total=%.3fs",
            self.request_id,
            status,
            summary,
            usage.prompt_tokens,
            usage.completion_tokens,
            f"{min(ttfts):.3f}s" if ttfts else "-",
            time.perf_counter() - self.started,
        )


class Api:
    def __init__(self, state: AppState) -> None:
        self.state = state

    @property
    def settings(self) -> HttpSettings:
        return self.state.settings

    async def _read(self, request: Request) -> dict[str, Any]:
        return await read_json(request, self.settings.max_body_bytes, self.settings.body_timeout_s)

    def _runtime(self) -> RuntimeHandle:
        if self.state.runtime is None:
            raise HttpError(503, "the model is loading", type="server_error", code="loading")
        return self.state.runtime

    async def chat(self, request: Request) -> Response:
        body = parse(ChatCompletionRequest, await self._read(request))
        return await self._generate(request, "chat", body, 1, lambda: [body.chat()])

    async def completions(self, request: Request) -> Response:
        body = parse(CompletionRequest, await self._read(request))
        return await self._generate(request, "text", body, body.num_prompts, body.prompts)

    def _check_choices(self, num_prompts: int, n: int) -> None:
        """At most ``max_n`` choices (prompts x ``n``): each takes an admission slot."""
        max_n = self.settings.max_n
        if num_prompts == 1 and not 1 <= n <= max_n:
            raise HttpError(400, f"n must be between 1 and {max_n}, got {n}", param="n")
        if n < 1:
            raise HttpError(400, f"n must be at least 1, got {n}", param="n")
        if num_prompts > max_n:
            raise HttpError(
                400,
                f"prompt may hold at most {max_n} prompts on this server, got {num_prompts}",
                param="prompt",
            )
        if num_prompts * n > max_n:
            raise HttpError(
                400,
                f"a request may ask for at most {max_n} choices (prompts x n) on this server, "
                f"got {num_prompts} prompts x n={n}",
                param="n",
            )

    async def _generate(
        self,
        request: Request,
        kind: fmt.Kind,
        body: ChatCompletionRequest | CompletionRequest,
        num_prompts: int,
        prompts: Callable[[], Sequence[str | tuple[ChatMessage, ...]]],
    ) -> Response:
        """``prompts`` (``num_prompts`` of them, each to get ``n`` choices) raises
        ``InvalidRequestError`` for a bad prompt; it is called after the cheaper checks."""
        rt = self._runtime()
        if body.model not in (self.state.model_id, rt.model_id):
            raise HttpError(
                404,
                f"The model '{body.model}' does not exist; this server serves '{rt.model_id}'",
                param="model",
                code="model_not_found",
            )
        self._check_choices(num_prompts, body.n)
        request_id = ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex[:24]
        timeout = body.timeout if body.timeout is not None else self.settings.request_timeout_s
        try:
            generations = [
                GenerationRequest(
                    prompt,
                    body.params(
                        default_max_tokens=self.settings.default_max_tokens,
                        seed_offset=i,
                        defaults=self.settings.sampling.over(rt.sampling_defaults),
                    ),
                    timeout_s=timeout,
                    request_id=f"{request_id}/{p * body.n + i}",
                )
                for p, prompt in enumerate(prompts())
                for i in range(body.n)
            ]
            handles = await rt.submit_all(generations)
        except (InvalidRequestError, OverloadedError, RuntimeClosedError) as exc:
            if isinstance(exc, RuntimeRefusal):  # labelled "overloaded" or "shutting_down"
                self.state.metrics.refusals.labels(exc.code).inc()
            if kind == "text" and isinstance(exc, ContextLengthExceededError):
                exc.param = "prompt"  # the engine names a chat's field, "messages"
            raise refusal_error(exc) from None
        exchange = Exchange(
            request_id, kind, body.model, handles, rt.token_text, self.state.metrics, n=body.n
        )
        headers = {"X-Request-Id": request_id}
        if body.stream:
            return EventStream(exchange, self.state.live, body.include_usage, headers)
        self.state.live[request_id] = handles
        try:
            return await self._complete(request, exchange, headers)
        finally:
            del self.state.live[request_id]

    async def _complete(self, request: Request, ex: Exchange, headers: dict[str, str]) -> Response:
        texts = [""] * len(ex.handles)
        logprobs: list[list[TokenLogprob] | None] = [None] * len(ex.handles)

        async def collect(index: int, handle: SessionHandle) -> None:
            async for event in ex.events(index, handle):
                if isinstance(event, TextDelta):
                    texts[index] += event.text
                    if event.logprobs is not None:
                        logprobs[index] = (logprobs[index] or []) + list(event.logprobs)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(_cancel_on_disconnect, request.receive, ex.handles)
            async with trio.open_nursery() as sessions:
                for index, handle in enumerate(ex.handles):
                    sessions.start_soon(collect, index, handle)
            nursery.cancel_scope.cancel()

        failure = first_failure(ex.outcomes)
        if failure is not None:
            error = outcome_error(failure)
            ex.log(error.status)
            return JSONResponse(error.body, status_code=error.status, headers=headers)
        choices = [
            fmt.choice_body(
                ex.kind,
                i,
                texts[i],
                outcome.finish_reason if isinstance(outcome, Completed) else None,
                fmt.logprobs_body(ex.kind, logprobs[i], ex.token_text),
            )
            for i, outcome in enumerate(ex.outcomes)
        ]
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

    # -- the other endpoints ----------------------------------------------------------------

    async def models(self, request: Request) -> Response:
        ids = [self.state.model_id] if self.state.model_id else []
        rt = self.state.runtime
        defaults = applied(self.state.sampling_layers(rt)) if rt is not None else {}
        extra = {
            "sampling_defaults": {
                name: {"value": value, "source": source}
                for name, (value, source) in defaults.items()
            }
        }
        return JSONResponse(
            {
                "object": "list",
                "data": [
                    {"id": i, "object": "model", "created": 0, "owned_by": "mlx-trio", **extra}
                    for i in ids
                ],
            }
        )

    async def health(self, request: Request) -> Response:
        stats = self.state.statistics()
        if stats is None:
            return JSONResponse({"status": "loading"}, status_code=503)
        if not stats.is_healthy:
            return JSONResponse(
                {
                    "status": "unhealthy",
                    "engine_faults": stats.engine_faults,
                    "stuck_steps": stats.stuck_steps,
                },
                status_code=503,
            )
        if stats.is_closed:
            return JSONResponse({"status": "shutting_down"}, status_code=503)
        return JSONResponse({"status": "ok"})

    async def metrics(self, request: Request) -> Response:
        return Response(
            self.state.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8"
        )

    async def stats(self, request: Request) -> Response:
        stats = self.state.statistics()
        if stats is None:
            raise HttpError(503, "the model is loading", type="server_error", code="loading")
        return JSONResponse(asdict(stats))

    async def cancel(self, request: Request) -> Response:
        request_id = request.path_params["request_id"]
        handles = self.state.live.get(request_id)
        if not handles:
            raise HttpError(404, f"no running or queued request '{request_id}'", param="request_id")
        for handle in handles:
            handle.cancel_nowait("requested")
        return JSONResponse({"id": request_id, "object": "request.cancelled"})


async def _cancel_on_disconnect(receive: Receive, handles: list[SessionHandle]) -> None:
    """Wait for the client to go away; then cancel its sessions ``consumer_closed``."""
    while (await receive())["type"] != "http.disconnect":
        pass
    for handle in handles:
        handle.cancel_nowait("consumer_closed")


class EventStream:
    """An SSE response: chunks as the sessions produce them, then ``[DONE]``."""

    def __init__(
        self,
        exchange: Exchange,
        live: dict[str, list[SessionHandle]],
        include_usage: bool,
        headers: dict[str, str],
    ) -> None:
        """``live``: the running requests by id, where this one is listed while it streams (so
        that it can be cancelled by id)."""
        self.ex = exchange
        self.live = live
        self.include_usage = include_usage
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
                nursery.start_soon(_cancel_on_disconnect, receive, ex.handles)
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
        ex = self.ex

        async def write(data: dict[str, Any] | bytes) -> None:
            body = data if isinstance(data, bytes) else fmt.sse(data)
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
        await write(fmt.SSE_DONE)

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
        match event:
            case TextDelta(text=text, logprobs=records):
                logprobs = fmt.logprobs_body(
                    ex.kind, list(records) if records is not None else None, ex.token_text
                )
                await write(chunk(index, text=text, logprobs=logprobs))
            case Progress(done=done, total=total):
                await write(f": prefill {done}/{total}\n\n".encode())
            case Completed(finish_reason=reason):
                await write(
                    chunk(index, text=None if ex.kind == "chat" else "", finish_reason=reason)
                )


# -- the app -----------------------------------------------------------------------------


MAX_HEADER_BYTES = 16 * 1024


class EdgeMiddleware:
    """Checks made before routing: 431 for request heads over 16 KiB (h11 only catches heads
    that arrive in pieces), and, with an API key, 401 ``invalid_api_key`` unless the bearer
    token matches (compared in constant time). /health stays open. An exception that escapes
    the app (a bug: the app has answered 500 ``server_error`` if it could) is logged here with
    its traceback, once, and goes no further."""

    def __init__(self, app: ASGIApp, api_key: str | None) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode() if api_key else None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        error = self._check(scope)
        if error is not None:
            await error.response()(scope, receive, send)
            return
        try:
            await self.app(scope, receive, send)
        except Exception:
            logger.exception("%s %s failed", scope["method"], scope["path"])

    def _check(self, scope: Scope) -> HttpError | None:
        headers = scope["headers"]
        if sum(len(k) + len(v) + 4 for k, v in headers) > MAX_HEADER_BYTES:
            return HttpError(431, f"request headers are over {MAX_HEADER_BYTES} bytes")
        if self.expected is None or scope["path"] == "/health":
            return None
        given = dict(headers).get(b"authorization", b"")
        if hmac.compare_digest(given, self.expected):
            return None
        return HttpError(
            401,
            "Incorrect or missing API key: send 'Authorization: Bearer <key>'",
            code="invalid_api_key",
        )


def build_app(state: AppState) -> ASGIApp:
    api = Api(state)

    async def http_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, HttpError)
        return exc.response()

    async def starlette_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        return HttpError(exc.status_code, str(exc.detail)).response()

    async def internal_error(request: Request, exc: Exception) -> Response:
        """Anything else a handler raises: a bug, answered in OpenAI's shape (Starlette's own
        answer is text/plain) and logged by ``EdgeMiddleware``."""
        message = "the server failed to handle the request; see its log"
        return HttpError(500, message, type="server_error", code="internal_error").response()

    app = Starlette(
        routes=[
            Route("/v1/chat/completions", api.chat, methods=["POST"]),
            Route("/v1/completions", api.completions, methods=["POST"]),
            Route("/v1/models", api.models, methods=["GET"]),
            Route("/v1/stats", api.stats, methods=["GET"]),
            Route("/v1/requests/{request_id}/cancel", api.cancel, methods=["POST"]),
            Route("/health", api.health, methods=["GET"]),
            Route("/metrics", api.metrics, methods=["GET"]),
        ],
        exception_handlers={
            HttpError: http_error,
            HTTPException: starlette_error,
            Exception: internal_error,
        },
    )
    return EdgeMiddleware(app, state.settings.api_key)
