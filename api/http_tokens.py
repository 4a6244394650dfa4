"""``/tokenize`` and ``/detokenize`` in vLLM's shapes: a prompt (``prompt``, or chat
``messages`` rendered by the model's template as a chat request's would be) to its token ids,
counted against the model's context; token ids back to text. Neither takes an admission
permit: tokenizing runs in a worker thread beside the engine, as a request's does.
"""

from __future__ import annotations

from typing import Any

from pydantic import StrictBool, StrictInt
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from ..engine.errors import InvalidRequestError
from ..engine.vocabulary.prompt import Chat, Prompt
from .chat_parts import Body, Message, ToolSpec
from .http_errors import refusal_error
from .http_input import parse
from .http_state import AppState
from .http_submit import check_model, runtime_of

MAX_TOKEN_IDS = 1_000_000  # a /detokenize body's ids (its body is bounded too)


class TokenizeRequest(Body):
    """vLLM's two forms in one: ``prompt`` as a completion's, or ``messages`` (with their
    ``tools``) as a chat's, the reply's opening included as a request's is."""

    model: str | None = None
    prompt: str | None = None
    messages: list[Message] | None = None
    tools: list[ToolSpec] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    return_token_strs: StrictBool = False

    def prompt_of(self) -> Prompt:
        if (self.prompt is None) == (self.messages is None):
            raise InvalidRequestError("send one of prompt or messages", param="prompt")
        if self.messages is None:
            assert self.prompt is not None
            return self.prompt
        if not self.messages:
            raise InvalidRequestError("messages must not be empty", param="messages")
        tools = tuple(spec.tool() for spec in self.tools or ())
        messages = tuple(m.chat_message() for m in self.messages)
        return Chat(messages, tools, self.chat_template_kwargs or {})


class DetokenizeRequest(Body):
    model: str | None = None
    tokens: list[StrictInt]


async def tokenize(state: AppState, request: Request, data: dict[str, Any]) -> Response:
    body = parse(TokenizeRequest, data)
    rt = runtime_of(state)
    if body.model is not None:
        check_model(state, rt, body.model)
    try:
        prompt = body.prompt_of()
    except InvalidRequestError as exc:
        raise refusal_error(exc) from None
    try:
        tokens = await rt.tokenize(prompt)
    except InvalidRequestError as exc:  # the engine's name for either form is "prompt"
        raise refusal_error(exc.renamed({"prompt": "messages"} if body.messages else {})) from None
    answer: dict[str, Any] = {
        "count": len(tokens),
        "max_model_len": rt.context_length,
        "tokens": tokens,
        "token_strs": [rt.token_text(t) for t in tokens] if body.return_token_strs else None,
    }
    return JSONResponse(answer)


async def detokenize(state: AppState, request: Request, data: dict[str, Any]) -> Response:
    body = parse(DetokenizeRequest, data)
    rt = runtime_of(state)
    if body.model is not None:
        check_model(state, rt, body.model)
    if len(body.tokens) > MAX_TOKEN_IDS:
        raise refusal_error(
            InvalidRequestError(f"at most {MAX_TOKEN_IDS} token ids", param="tokens")
        )
    try:
        return JSONResponse({"prompt": rt.detokenize(body.tokens)})
    except InvalidRequestError as exc:
        raise refusal_error(exc) from None
