"""The HTTP app's errors in OpenAI's shape, and what each failure maps to.

``HttpError`` is the one exception a handler raises for a client-visible error: a status, an
OpenAI error body (``type``, ``param``, ``code``) and any headers. ``refusal_error`` maps the
runtime's refusals (invalid request 400; overloaded, or the engine restarting, 503 with
``Retry-After``; closed 503);
``outcome_error`` maps a request's failed or cancelled outcome through ``OUTCOME_STATUS`` (why
each reason gets its status: design/005-http.md).
"""

from __future__ import annotations

from starlette.responses import JSONResponse

from ..actors.messages import Cancelled, Completed, Failed, Outcome
from ..engine.errors import (
    EngineUnavailableError,
    InvalidRequestError,
    OverloadedError,
    RuntimeClosedError,
)
from . import openai_format as fmt

OUTCOME_STATUS = {
    "deadline": (408, "timeout_error", "request_timeout"),
    "shutdown": (503, "server_error", "shutting_down"),
    "engine_fault": (503, "server_error", "engine_timeout"),  # a step hung: not "failed"
    "requested": (499, "invalid_request_error", "request_cancelled"),
    "consumer_closed": (499, "invalid_request_error", "client_closed"),
    "consumer_idle": (499, "invalid_request_error", "client_idle"),
}


class HttpError(Exception):
    """``body`` is OpenAI's; another API words the same error from ``message``, ``code`` and
    ``refusal`` (the runtime's error it stands for, if any)."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
        refusal: Exception | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.refusal = refusal
        self.body = fmt.error_body(message, type=type, param=param, code=code)
        self.headers = headers or {}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body, status_code=self.status, headers=self.headers)


def refusal_error(exc: Exception) -> HttpError:
    match exc:
        case InvalidRequestError():
            return HttpError(400, exc.message, param=exc.param, code=exc.code, refusal=exc)
        case OverloadedError():
            retry = max(1, round(exc.retry_after_s))
            return HttpError(
                503,
                exc.message,
                type="server_error",
                code="overloaded",
                headers={"Retry-After": str(retry)},
                refusal=exc,
            )
        case EngineUnavailableError():
            headers = {}
            if exc.retry_after_s is not None:
                headers["Retry-After"] = str(max(1, round(exc.retry_after_s)))
            return HttpError(503, exc.message, type="server_error", code=exc.code, headers=headers)
        case RuntimeClosedError():
            return HttpError(503, exc.message, type="server_error", code="shutting_down")
    raise exc


def first_failure(outcomes: list[Outcome | None]) -> Outcome | None:
    return next((o for o in outcomes if not isinstance(o, Completed)), None)


def outcome_error(outcome: Outcome | None) -> HttpError:
    match outcome:
        case Cancelled(reason=reason):
            status, kind, code = OUTCOME_STATUS[reason]
            return HttpError(status, f"the request was cancelled: {reason}", type=kind, code=code)
        case Failed(code=code, message=message):
            return HttpError(500, message, type="server_error", code=code)
    return HttpError(500, "the request ended without an outcome", type="server_error")
