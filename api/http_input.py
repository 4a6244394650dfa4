"""Reading a request: its body under the size limit and the body deadline (413, 408), as
UTF-8 (400) holding a JSON object (400, ``api/json_body.py``'s rules), parsed into its pydantic
schema (400 naming the deepest parameter that failed). Each failure is an ``HttpError``.
"""

from __future__ import annotations

from typing import Any, TypeVar

import trio
from pydantic import BaseModel, ValidationError
from starlette.requests import Request

from ..engine.errors import InvalidRequestError
from . import json_body
from .http_errors import HttpError, refusal_error
from .schemas import error_param


async def read_json(request: Request, limit: int, timeout_s: float) -> dict[str, Any]:
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > limit:
        raise HttpError(413, f"request body is over the {limit} byte limit")
    body = bytearray()
    with trio.move_on_after(timeout_s) as deadline:
        async for chunk in request.stream():
            body += chunk
            if len(body) > limit:
                raise HttpError(413, f"request body is over the {limit} byte limit")
    if deadline.cancelled_caught:
        raise HttpError(408, f"the request body did not arrive within {timeout_s:g} s")
    try:
        data = json_body.loads(body.decode("utf-8"))
    except UnicodeDecodeError:
        raise HttpError(400, "request body is not valid UTF-8") from None
    except InvalidRequestError as exc:
        raise refusal_error(exc) from None
    if not isinstance(data, dict):
        raise HttpError(400, "request body must be a JSON object")
    return data


M = TypeVar("M", bound=BaseModel)


def parse(model: type[M], data: dict[str, Any], fields: frozenset[str] | None = None) -> M:
    """``data`` as a ``model``; an error names its parameter by ``fields`` (the field names of
    the API's bodies: ``field_names.fields_of``; None: the OpenAI chat and completion bodies')."""
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise _validation_error(exc, fields) from None


def _validation_error(exc: ValidationError, fields: frozenset[str] | None) -> HttpError:
    """One error for the deepest parameter that failed (where a value failed each member of a
    union, the member it got furthest into), with what each member expected there."""
    params = [error_param(e["loc"], fields) for e in exc.errors()]
    param = max(params, key=lambda p: 0 if p is None else p.count(".") + 1)
    messages = [e["msg"] for e, p in zip(exc.errors(), params, strict=True) if p == param]
    text = " or ".join(dict.fromkeys(messages))
    return HttpError(400, f"{param}: {text}" if param else text, param=param)
