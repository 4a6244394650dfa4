"""The Messages API's routes (``MessagesApi``): ``/v1/messages``, which checks a request,
submits its one session (``api/http_submit.py``: the model's served names, admission, the
prompt over the context refused before admission) and answers with a message or Anthropic's
event stream (``api/anthropic_stream.py``); and ``/v1/messages/count_tokens``. Their errors
are worded in Anthropic's shape by the app (``api/http.py``, ``anthropic_format``).
"""

from __future__ import annotations

from typing import Any, TypeVar

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from ..engine.errors import InvalidRequestError
from .anthropic_schemas import FIELD_NAMES, CountTokensRequest, MessagesRequest
from .anthropic_stream import MessageStream, Turn, complete_message
from .http_endpoints import MAX_MESSAGES
from .http_errors import HttpError, refusal_error
from .http_exchange import Exchange
from .http_input import parse, read_json
from .http_state import AppState
from .http_submit import check_model, runtime_of, submit

B = TypeVar("B", MessagesRequest, CountTokensRequest)


class MessagesApi:
    """The Messages API's handlers, over the app's state; ``build_app`` routes to them."""

    def __init__(self, state: AppState) -> None:
        self.state = state

    async def messages(self, request: Request) -> Response:
        body = await self._body(request, MessagesRequest)
        state = self.state
        images = await state.load_images(body.image_refs)
        chats = lambda: [body.chat(images)]  # noqa: E731
        submitted = await submit(state, request, body, chats, id_prefix="msg_")
        rt, request_id, handles = submitted.runtime, submitted.request_id, submitted.handles
        splitter = rt.reply_syntax().splitter(
            handles[0].prompt_tokens, body.tools_in_prompt, body.choice
        )
        exchange = Exchange(
            request_id,
            "chat",
            body.model,
            handles,
            rt.token_text,
            state.metrics,
            splitters=[splitter],
            endpoint="messages",
        )
        turn = Turn(exchange, body.stops, rt.detokenize)
        headers = {"X-Request-Id": request_id, "request-id": request_id}
        if body.stream:
            return MessageStream(turn, state.live, headers)
        state.live[request_id] = handles
        try:
            return await complete_message(request, turn, headers)
        finally:
            del state.live[request_id]

    async def count_tokens(self, request: Request) -> Response:
        """``{"input_tokens": N}``: the prompt's tokens as a request's would be, whatever its
        length (counting takes no admission permit)."""
        body = await self._body(request, CountTokensRequest)
        rt = runtime_of(self.state)
        check_model(self.state, rt, body.model)
        images = await self.state.load_images(body.image_refs)
        try:
            tokens = await rt.tokenize(body.chat(images))
        except InvalidRequestError as exc:
            raise refusal_error(exc.renamed({"prompt": "messages"})) from None
        return JSONResponse({"input_tokens": len(tokens)})

    async def _body(self, request: Request, schema: type[B]) -> B:
        """The request's body as ``schema``, its fields checked (a 400 naming the first field
        not served here)."""
        settings = self.state.settings
        data: dict[str, Any] = await read_json(
            request, self.state.body_limit(), settings.body_timeout_s
        )
        messages = data.get("messages")
        if isinstance(messages, list) and len(messages) > MAX_MESSAGES:  # before pydantic
            raise HttpError(
                400,
                f"messages: at most {MAX_MESSAGES} messages, got {len(messages)}",
                param="messages",
            )
        body = parse(schema, data, FIELD_NAMES)
        try:
            body.check_fields()
        except InvalidRequestError as exc:
            raise refusal_error(exc) from None
        return body
