"""What every generating endpoint does before it answers: check the model name against the
names served, check the choices asked for, build each choice's runtime request from the body,
and submit them together. The chat and text completions use it, and so do the Messages and
Responses APIs: a body says how through ``SubmitBody``.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from starlette.requests import Request

from ..actors.messages import GenerationRequest
from ..engine.errors import InvalidRequestError, RuntimeRefusal
from ..engine.params import SamplingParams
from ..engine.vocabulary.prompt import Prompt
from ..engine.vocabulary.sampling_defaults import SamplingDefaults
from .http_errors import HttpError, refusal_error
from .http_state import API_KEY_STATE, AppState
from .inprocess import RuntimeHandle, SessionHandle

MAX_ECHOED_MODEL = 64  # characters of an unknown model's name said back


class SubmitBody(Protocol):
    """A request body that asks for generations: its model name, how many choices to each
    prompt, its deadline and prompt-cache salt, each choice's sampling parameters, and its
    own names for the engine's request fields (for the errors)."""

    @property
    def model(self) -> str: ...

    @property
    def n(self) -> int: ...

    @property
    def timeout(self) -> float | None: ...

    @property
    def cache_salt(self) -> str | None: ...

    def params(
        self, *, default_max_tokens: int, seed_offset: int, defaults: SamplingDefaults
    ) -> SamplingParams: ...

    def field_names(self) -> Mapping[str, str]: ...


@dataclass(frozen=True, slots=True)
class Submitted:
    request_id: str
    runtime: RuntimeHandle
    handles: list[SessionHandle]


def runtime_of(state: AppState) -> RuntimeHandle:
    """The runtime, or 503 ``loading`` while the model loads."""
    if state.runtime is None:
        raise HttpError(503, "the model is loading", type="server_error", code="loading")
    return state.runtime


def check_model(state: AppState, rt: RuntimeHandle, name: str) -> None:
    """404 ``model_not_found`` unless ``name`` is one of the names served (the model's, or
    a LoRA adapter's)."""
    names = state.model_names(rt) + tuple(a.name for a in rt.adapters)
    if name in names:
        return
    # Named back as OpenAI does, cut to a length that cannot bloat the answer or a log.
    named = name if len(name) <= MAX_ECHOED_MODEL else name[: MAX_ECHOED_MODEL - 3] + "..."
    served = ", ".join(f"'{n}'" for n in names)
    raise HttpError(
        404,
        f"The model '{named}' does not exist; this server serves {served}",
        param="model",
        code="model_not_found",
    )


def cache_salt(request: Request, asked: str | None) -> str | None:
    """A request's prompt-cache partition: the API key it came with (by its place among the
    server's keys), and the ``cache_salt`` it asked for; None, the shared one, for neither.
    So with several keys, ``cached_tokens`` never tells one key's client what another's sent."""
    key = request.scope.get("state", {}).get(API_KEY_STATE)
    parts = [f"key {key}" if key is not None else "", f"salt {asked}" if asked else ""]
    return "; ".join(p for p in parts if p) or None


def choose_adapter(state: AppState, rt: RuntimeHandle, body: SubmitBody) -> str | None:
    """The LoRA adapter a request runs with (None: the base model): the model it names, if
    that is an adapter (vLLM's convention), or the one named by mlx_lm.server's ``adapters``
    field (a served adapter's name or its directory). 404 for a model not served; 400
    ``adapter_not_found`` for an ``adapters`` field that names no served adapter, or another
    adapter than the model."""
    check_model(state, rt, body.model)
    served = {a.name: a for a in rt.adapters}
    chosen = body.model if body.model in served else None
    asked: str | None = getattr(body, "adapters", None)
    if asked is None:
        return chosen
    match = served.get(asked) or next(
        (a for a in served.values() if _same_directory(a.path, asked)), None
    )
    if match is None:
        names = ", ".join(f"'{n}'" for n in served) or "none"
        raise HttpError(
            400,
            f"adapters: no served adapter is named or stored at {asked[:MAX_ECHOED_MODEL]!r} "
            f"(served adapters: {names})",
            param="adapters",
            code="adapter_not_found",
        )
    if chosen is not None and match.name != chosen:
        raise HttpError(
            400,
            f"adapters: {match.name!r} differs from the adapter the model names ({chosen!r})",
            param="adapters",
        )
    return match.name


def _same_directory(path: str, asked: str) -> bool:
    try:
        return Path(asked).expanduser().resolve() == Path(path).resolve()
    except (OSError, ValueError):
        return False


async def submit(
    state: AppState,
    request: Request,
    body: SubmitBody,
    prompts: Callable[[], Sequence[Prompt]],
    *,
    id_prefix: str,
) -> Submitted:
    """``body.n`` choices to each of ``prompts()`` submitted together, as ``id_prefix`` plus a
    new id; a refusal (a bad prompt or parameters, overload, a restarting engine) is raised
    as an ``HttpError`` that names the body's own field. ``prompts`` is called after the model
    check, so a costly prompt is built only for a request that can run."""
    rt = runtime_of(state)
    adapter = choose_adapter(state, rt, body)
    settings = state.settings
    request_id = id_prefix + uuid.uuid4().hex[:24]
    timeout = body.timeout if body.timeout is not None else settings.request_timeout_s
    salt = cache_salt(request, body.cache_salt)
    defaults = settings.sampling.over(rt.sampling_defaults)
    try:
        generations = [
            GenerationRequest(
                prompt,
                body.params(
                    default_max_tokens=settings.default_max_tokens,
                    seed_offset=i,
                    defaults=defaults,
                ),
                timeout_s=timeout,
                request_id=f"{request_id}/{p * body.n + i}",
                cache_salt=salt,
                adapter=adapter,
            )
            for p, prompt in enumerate(prompts())
            for i in range(body.n)
        ]
        handles = await rt.submit_all(generations)
    except (InvalidRequestError, RuntimeRefusal) as exc:
        if isinstance(exc, RuntimeRefusal):  # labelled by its code: overloaded, ...
            state.metrics.refusals.labels(exc.code).inc()
        if isinstance(exc, InvalidRequestError):
            exc = exc.renamed(body.field_names())
        raise refusal_error(exc) from None
    if adapter is not None:
        state.adapter_requests[adapter] += len(handles)
    return Submitted(request_id, rt, handles)
