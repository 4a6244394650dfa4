"""The OpenAI-compatible HTTP app (Starlette on Hypercorn's Trio worker).

Every request is checked before any engine work and without an admission permit: body size
(413 before reading), UTF-8 and JSON (400), schema and ranges (400 with ``param``), model id
(404, configured ids only), context length (400, before any SSE byte). Overload answers 503 with
``Retry-After``. A client that disconnects, streaming or not, cancels its sessions
``consumer_closed``. Errors use OpenAI's shape (Anthropic's on the Messages API's routes,
``api/anthropic_format.py``); a stream that fails part-way sends an error event and then
``[DONE]``. Why Starlette: design/005-http.md.

This module assembles the app (``build_app``): the routes to ``Api``'s endpoints
(``http_endpoints``), the exception handlers that answer in OpenAI's error shape
(``http_errors``), and ``EdgeMiddleware``, the checks made before routing. What the app serves
from is ``http_state``; reading a body, ``http_input``; one generation request,
``http_exchange``; its JSON or SSE answer, ``http_responses``.
"""

from __future__ import annotations

import hmac
import logging

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

from . import anthropic_format
from .anthropic_endpoints import MessagesApi
from .http_endpoints import Api
from .http_errors import HttpError
from .http_state import API_KEY_STATE, AppState
from .responses_endpoints import ResponsesApi

logger = logging.getLogger("mlx_trio.http")


MAX_HEADER_BYTES = 16 * 1024


class EdgeMiddleware:
    """Checks made before routing: 431 for request heads over 16 KiB (h11 only catches heads
    that arrive in pieces), and, with API keys, 401 ``invalid_api_key`` unless the bearer
    token, or the ``x-api-key`` header (Anthropic's), is one of them (each compared in
    constant time); the request's ``state`` then says
    which (``API_KEY_STATE``: its index), for the prompt cache's partition. /health stays
    open. An exception that escapes the app (a bug: the app has answered 500 ``server_error``
    if it could) is logged here with its traceback, once, and goes no further."""

    def __init__(self, app: ASGIApp, api_keys: tuple[str, ...]) -> None:
        self.app = app
        self.expected = [key.encode() for key in api_keys]

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        error = self._check(scope)
        if error is not None:
            log_refusal(scope["method"], scope["path"], error)
            await error_response(scope["path"], error)(scope, receive, send)
            return
        try:
            await self.app(scope, receive, send)
        except Exception:
            logger.exception("%s %s failed", scope["method"], scope["path"])

    def _check(self, scope: Scope) -> HttpError | None:
        headers = scope["headers"]
        if b"%2f" in scope.get("raw_path", b"").lower():
            # Routing sees the decoded path, where a proxy's rule sees this one: neither wins.
            return HttpError(404, "Not Found: an encoded '/' in the path", code="not_found")
        if sum(len(k) + len(v) + 4 for k, v in headers) > MAX_HEADER_BYTES:
            return HttpError(431, f"request headers are over {MAX_HEADER_BYTES} bytes")
        if not self.expected or scope["path"] == "/health":
            return None
        sent = dict(headers)
        bearer = sent.get(b"authorization", b"")
        given = [bearer.removeprefix(b"Bearer ")] if bearer.startswith(b"Bearer ") else []
        given += [sent[b"x-api-key"]] if b"x-api-key" in sent else []
        for index, expected in enumerate(self.expected):
            if any([hmac.compare_digest(key, expected) for key in given]):
                scope.setdefault("state", {})[API_KEY_STATE] = index
                return None
        return HttpError(
            401,
            "Incorrect or missing API key: send 'Authorization: Bearer <key>' or "
            "'x-api-key: <key>'",
            code="invalid_api_key",
        )


def error_response(path: str, error: HttpError) -> Response:
    """``error`` in the shape of the API ``path`` belongs to: Anthropic's for the Messages
    API's routes, else OpenAI's."""
    if anthropic_format.is_messages_path(path):
        return anthropic_format.error_response(error)
    return error.response()


def log_refusal(method: str, path: str, error: HttpError) -> None:
    """A refused request's one log line (an admitted one's is ``Exchange.log``'s)."""
    body = error.body.get("error", {})
    logger.info(
        "%s %s status=%d outcome=refused type=%s param=%s code=%s",
        method,
        path,
        error.status,
        body.get("type"),
        body.get("param"),
        body.get("code"),
    )


def build_app(state: AppState) -> ASGIApp:
    api = Api(state)
    responses = ResponsesApi(state)
    messages = MessagesApi(state)

    async def http_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, HttpError)
        log_refusal(request.method, request.url.path, exc)
        return error_response(request.url.path, exc)

    async def starlette_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        error = HttpError(exc.status_code, str(exc.detail))
        log_refusal(request.method, request.url.path, error)
        return error_response(request.url.path, error)

    async def internal_error(request: Request, exc: Exception) -> Response:
        """Anything else a handler raises: a bug, answered in OpenAI's shape (Starlette's own
        answer is text/plain) and logged by ``EdgeMiddleware``."""
        message = "the server failed to handle the request; see its log"
        error = HttpError(500, message, type="server_error", code="internal_error")
        return error_response(request.url.path, error)

    app = Starlette(
        routes=[
            Route("/v1/chat/completions", api.chat, methods=["POST"]),
            Route("/v1/completions", api.completions, methods=["POST"]),
            Route("/v1/responses", responses.create, methods=["POST"]),
            Route("/v1/responses/{response_id}", responses.get, methods=["GET"]),
            Route("/v1/responses/{response_id}", responses.delete, methods=["DELETE"]),
            Route("/v1/messages", messages.messages, methods=["POST"]),
            Route("/v1/messages/count_tokens", messages.count_tokens, methods=["POST"]),
            Route("/v1/models", api.models, methods=["GET"]),
            Route("/tokenize", api.tokenize, methods=["POST"]),
            Route("/detokenize", api.detokenize, methods=["POST"]),
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
    edge = EdgeMiddleware(app, state.settings.api_keys)
    origins = state.settings.allowed_origins
    if not origins:
        return edge
    # Outside the key check: a browser's preflight carries no key, and a 401 needs CORS headers
    # for the page to read it.
    return CORSMiddleware(
        edge,
        allow_origins=list(origins),
        allow_methods=["*"],
        allow_headers=["*"],
        expose_headers=["X-Request-Id", "Retry-After"],
        max_age=600,
    )
