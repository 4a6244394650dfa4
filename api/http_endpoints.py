"""The HTTP endpoints (``Api``): chat and text completions, which check a request (model id,
choices against ``max_n``), submit its sessions and hand them to a JSON or SSE answer; and
``/v1/models``, ``/health``, ``/metrics``, ``/v1/stats`` and cancel by request id.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import asdict
from typing import Any, TypeVar

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from ..engine.errors import InvalidRequestError
from ..engine.vocabulary.prompt import Chat
from ..engine.vocabulary.reply import ReplySplitter
from ..engine.vocabulary.sampling_defaults import applied
from . import http_tokens
from . import openai_format as fmt
from .http_errors import HttpError, refusal_error
from .http_exchange import Exchange
from .http_input import parse, read_json
from .http_responses import EventStream, complete
from .http_state import AppState, HttpSettings
from .http_submit import check_model, runtime_of, submit
from .inprocess import RuntimeHandle, SessionHandle
from .schemas import ChatCompletionRequest, CompletionRequest

B = TypeVar("B", ChatCompletionRequest, CompletionRequest)

MAX_MESSAGES = 4096  # a chat's messages; each costs validation and template rendering


class Api:
    """The request handlers, over the app's state; ``build_app`` routes to them."""

    def __init__(self, state: AppState) -> None:
        self.state = state

    @property
    def settings(self) -> HttpSettings:
        return self.state.settings

    async def _read(self, request: Request) -> dict[str, Any]:
        limit = self.state.body_limit()
        return await read_json(request, limit, self.settings.body_timeout_s)

    async def chat(self, request: Request) -> Response:
        data = await self._read(request)
        messages = data.get("messages")
        if isinstance(messages, list) and len(messages) > MAX_MESSAGES:  # before pydantic
            raise HttpError(
                400,
                f"messages: at most {MAX_MESSAGES} messages, got {len(messages)}",
                param="messages",
            )
        body = checked(parse(ChatCompletionRequest, data))
        images = await self.state.load_images(body.image_refs)
        return await self._generate(request, "chat", body, 1, lambda: [body.chat(images)])

    async def completions(self, request: Request) -> Response:
        body = checked(parse(CompletionRequest, await self._read(request)))
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
        prompts: Callable[[], Sequence[str | Chat]],
    ) -> Response:
        """``prompts`` (``num_prompts`` of them, each to get ``n`` choices) raises
        ``InvalidRequestError`` for a bad prompt; it is called after the cheaper checks."""
        check_model(self.state, runtime_of(self.state), body.model)
        self._check_choices(num_prompts, body.n)
        prefix = "chatcmpl-" if kind == "chat" else "cmpl-"
        submitted = await submit(self.state, request, body, prompts, id_prefix=prefix)
        rt, request_id, handles = submitted.runtime, submitted.request_id, submitted.handles
        exchange = Exchange(
            request_id,
            kind,
            body.model,
            handles,
            rt.token_text,
            self.state.metrics,
            n=body.n,
            splitters=splitters(rt, body, handles),
        )
        headers = {"X-Request-Id": request_id}
        if body.stream:
            return EventStream(exchange, self.state.live, body.include_usage, headers)
        self.state.live[request_id] = handles
        try:
            return await complete(request, exchange, headers)
        finally:
            del self.state.live[request_id]

    # -- the other endpoints ----------------------------------------------------------------

    async def tokenize(self, request: Request) -> Response:
        return await http_tokens.tokenize(self.state, request, await self._read(request))

    async def detokenize(self, request: Request) -> Response:
        return await http_tokens.detokenize(self.state, request, await self._read(request))

    async def models(self, request: Request) -> Response:
        rt = self.state.runtime
        ids = list(self.state.model_names(rt)) if rt is not None else []
        defaults = applied(self.state.sampling_layers(rt)) if rt is not None else {}
        extra: dict[str, object] = {
            "sampling_defaults": {
                name: {"value": value, "source": source}
                for name, (value, source) in defaults.items()
            }
        }
        if (stats := self.state.statistics()) is not None:
            extra["batch_mode"] = stats.batch_mode  # batch, serial (caches that cannot merge), off
        if rt is not None:
            extra["weights"] = rt.weights  # dequantized at load on CUDA, say
        # OpenAI's list and model fields, and Anthropic's beside them (``type``, ``display_name``,
        # ``created_at``, the page's ``has_more`` and ids): each SDK reads its own.
        return JSONResponse(
            {
                "object": "list",
                "data": [
                    {
                        "id": i,
                        "object": "model",
                        "created": 0,
                        "owned_by": "mlx-trio",
                        "type": "model",
                        "display_name": i,
                        "created_at": "1970-01-01T00:00:00Z",
                        **extra,
                    }
                    for i in ids
                ]
                + [
                    {
                        "id": a.name,
                        "object": "model",
                        "created": 0,
                        "owned_by": "mlx-trio",
                        "type": "model",
                        "display_name": a.name,
                        "created_at": "1970-01-01T00:00:00Z",
                        # vLLM's fields for a LoRA adapter: the base model it runs over.
                        "parent": ids[0] if ids else None,
                        "adapter": {"rank": a.rank, "scale": a.scale, "layers": a.layers},
                        **extra,
                    }
                    for a in (rt.adapters if rt is not None else ())
                ],
                "has_more": False,
                "first_id": ids[0] if ids else None,
                "last_id": ids[-1] if ids else None,
            }
        )

    async def health(self, request: Request) -> Response:
        stats = self.state.statistics()
        if stats is None:
            return JSONResponse({"status": "loading"}, status_code=503)
        engine = stats.engine
        if not engine.is_up:  # restarting, or down for good
            body = {"status": f"engine_{engine.condition}", "cause": engine.last_cause}
            return JSONResponse(body | {"restarts": engine.restarts}, status_code=503)
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
        rt = self.state.runtime
        adapters = [
            {
                "name": a.name,
                "rank": a.rank,
                "scale": a.scale,
                "layers": a.layers,
                "requests": self.state.adapter_requests[a.name],
            }
            for a in (rt.adapters if rt is not None else ())
        ]
        scheme = rt.kv_scheme if rt is not None else None
        return JSONResponse(asdict(stats) | {"adapters": adapters, "kv_scheme": scheme})

    async def cancel(self, request: Request) -> Response:
        request_id = request.path_params["request_id"]
        handles = self.state.live.get(request_id)
        if not handles:
            raise HttpError(404, f"no running or queued request '{request_id}'", param="request_id")
        for handle in handles:
            handle.cancel_nowait("requested")
        return JSONResponse({"id": request_id, "object": "request.cancelled"})


def splitters(
    rt: RuntimeHandle, body: ChatCompletionRequest | CompletionRequest, handles: list[SessionHandle]
) -> list[ReplySplitter | None]:
    """A reply splitter for each chat choice whose model thinks in blocks or that was offered
    tools; None where the text is all content (completions, and most chats)."""
    syntax = rt.reply_syntax()
    if not isinstance(body, ChatCompletionRequest) or not (syntax.think or body.tools):
        return [None] * len(handles)
    tools, choice = body.offered_tools, body.choice
    return [syntax.splitter(h.prompt_tokens, tools, choice) for h in handles]


def checked(body: B) -> B:
    """``body``, once its fields are ones this server implements (else a 400 naming one)."""
    try:
        body.check_fields()
    except InvalidRequestError as exc:
        raise refusal_error(exc) from None
    return body
