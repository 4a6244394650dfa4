"""The Responses API's endpoints (``ResponsesApi``): ``POST /v1/responses``, which checks a
body, builds its chat (continuing a stored response that ``previous_response_id`` names),
submits it through ``http_submit`` and answers with ``responses_answer``; and
``GET``/``DELETE /v1/responses/{id}`` for the responses kept in its ``ResponseStore``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from ..engine.errors import InvalidRequestError
from ..engine.vocabulary.prompt import ChatMessage
from .http_endpoints import MAX_MESSAGES
from .http_errors import HttpError, refusal_error
from .http_exchange import Exchange
from .http_input import parse, read_json
from .http_state import API_KEY_STATE, AppState
from .http_submit import submit
from .responses_answer import ReasoningTokens, ResponseEventStream, ResponseRun, respond
from .responses_schemas import RESPONSES_FIELDS, ResponsesRequest
from .responses_store import ResponseStore

T = TypeVar("T")


def key_index(request: Request) -> int | None:
    """Which of the server's API keys the request came with (None: keys are not asked for)."""
    return request.scope.get("state", {}).get(API_KEY_STATE)


class ResponsesApi:
    """The Responses API's handlers, over the app's state and the responses kept."""

    def __init__(self, state: AppState, store: ResponseStore | None = None) -> None:
        self.state = state
        self.store = store or ResponseStore()

    async def create(self, request: Request) -> Response:
        settings = self.state.settings
        data = await read_json(request, self.state.body_limit(), settings.body_timeout_s)
        items = data.get("input")
        if isinstance(items, list) and len(items) > MAX_MESSAGES:  # before pydantic
            raise HttpError(
                400, f"input: at most {MAX_MESSAGES} items, got {len(items)}", param="input"
            )
        body = parse(ResponsesRequest, data, RESPONSES_FIELDS)
        owner = key_index(request)
        history = self._history(body, owner)
        images = await self.state.load_images(body.image_refs)
        turns, chat = self._checked(body, lambda: body.chat_turns(history, images))
        submitted = await submit(self.state, request, body, lambda: [chat], id_prefix="resp_")
        rt, handle = submitted.runtime, submitted.handles[0]
        exchange = Exchange(
            submitted.request_id,
            "chat",
            body.model,
            submitted.handles,
            rt.token_text,
            self.state.metrics,
            endpoint="responses",
        )
        syntax = rt.reply_syntax()
        run = ResponseRun(
            exchange,
            body,
            syntax.splitter(handle.prompt_tokens, body.offered_tools, body.choice),
            ReasoningTokens(syntax, handle.prompt_tokens),
            turns,
            owner,
            self.store.put,
        )
        headers = {"X-Request-Id": submitted.request_id}
        if body.stream:
            return ResponseEventStream(run, self.state.live, headers)
        self.state.live[submitted.request_id] = submitted.handles
        try:
            return await respond(request, run, headers)
        finally:
            del self.state.live[submitted.request_id]

    def _history(self, body: ResponsesRequest, owner: int | None) -> tuple[ChatMessage, ...]:
        """The turns of the stored response the body continues from (none: it names none);
        404 where none is kept by that id for this API key."""
        previous = body.previous_response_id
        if previous is None:
            return ()
        stored = self.store.get(previous, owner)
        if stored is None:
            raise HttpError(
                404,
                f"Previous response with id '{previous[:64]}' not found.",
                param="previous_response_id",
                code="previous_response_not_found",
            )
        return stored.turns

    @staticmethod
    def _checked(body: ResponsesRequest, build: Callable[[], T]) -> T:
        """``body``'s fields checked, then ``build()``; a refusal is a 400 naming the field."""
        try:
            body.check_fields()
            return build()
        except InvalidRequestError as exc:
            raise refusal_error(exc.renamed(body.field_names())) from None

    async def get(self, request: Request) -> Response:
        response_id = request.path_params["response_id"]
        stored = self.store.get(response_id, key_index(request))
        if stored is None:
            raise self._not_found(response_id)
        return JSONResponse(stored.body)

    async def delete(self, request: Request) -> Response:
        response_id = request.path_params["response_id"]
        if not self.store.delete(response_id, key_index(request)):
            raise self._not_found(response_id)
        return JSONResponse({"id": response_id, "object": "response", "deleted": True})

    @staticmethod
    def _not_found(response_id: str) -> HttpError:
        return HttpError(
            404,
            f"Response with id '{response_id[:64]}' not found.",
            param="response_id",
            code="not_found",
        )
