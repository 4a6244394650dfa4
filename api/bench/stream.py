"""One streaming chat-completion request, measured as the client sees it.

It sends the request, reads the server-sent events (``data: {...}`` lines up to
``data: [DONE]``) and records when each non-empty content delta arrives. Anything that goes
wrong becomes the request's error kind instead of an exception.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import httpx
import trio

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class RequestResult:
    """One streaming request as the client saw it.

    ``ttft_s``: request sent to first non-empty content delta (None if none arrived).
    ``inter_token_s``: gaps between successive content chunks. ``completion_tokens``: from the
    usage chunk if the server sent one, else the number of content chunks (for a failed
    request, what arrived before it failed). ``error``: None, or
    a kind: ``http_<status>``, ``connect_error``, ``read_error``, ``write_error``,
    ``protocol_error``, ``timeout``, ``stream_error``, ``bad_json``, ``missing_done``,
    ``run_timeout``; ``detail`` says more. ``late``: one of a scenario's late streams
    (``scenarios.Stream``); ``sent_s``: when it was sent, in seconds from the run's start.
    """

    client: int
    index: int
    ttft_s: float | None
    inter_token_s: tuple[float, ...]
    completion_tokens: int
    elapsed_s: float
    error: str | None = None
    detail: str | None = None
    late: bool = False
    sent_s: float | None = None

    def to_json(self) -> dict[str, object]:
        """The fields a results file keeps for each request (not the per-token gaps)."""
        return {
            "client": self.client,
            "ttft_s": self.ttft_s,
            "completion_tokens": self.completion_tokens,
            "elapsed_s": self.elapsed_s,
            "error": self.error,
            "detail": self.detail,
            "late": self.late,
            "sent_s": self.sent_s,
        }

    @property
    def is_ok(self) -> bool:
        return self.error is None


class _StreamFailed(Exception):
    """A request failed in a way the client names (``kind``)."""

    def __init__(self, kind: str, detail: str) -> None:
        super().__init__(f"{kind}: {detail}")
        self.kind = kind
        self.detail = detail


def _content_of(chunk: dict) -> str:
    choices = chunk.get("choices") or []
    if not choices:
        return ""
    delta = choices[0].get("delta") or {}
    return delta.get("content") or ""


@dataclass(slots=True)
class StreamProgress:
    """What one request has measured so far; kept when the request fails or times out.

    ``on_first``: called when its first content arrives (a scenario's late streams wait for
    the first streams' first tokens)."""

    started: float
    ttft_s: float | None = None
    gaps: list[float] = field(default_factory=list)
    num_chunks: int = 0
    usage_tokens: int | None = None
    last: float | None = None
    on_first: Callable[[], None] | None = None

    def content_arrived(self) -> None:
        now = time.perf_counter()
        if self.last is None:
            self.ttft_s = now - self.started
            if self.on_first is not None:
                self.on_first()
        else:
            self.gaps.append(now - self.last)
        self.last = now
        self.num_chunks += 1

    @property
    def completion_tokens(self) -> int:
        return self.usage_tokens if self.usage_tokens is not None else self.num_chunks


async def _stream_one(client: httpx.AsyncClient, body: dict, progress: StreamProgress) -> None:
    """Send one streaming request and read it to ``[DONE]``, recording into ``progress``.

    Raises _StreamFailed for a non-200 status, an ``error`` object, bad JSON or no ``[DONE]``;
    httpx errors pass through. Cancelled: the connection is closed; ``progress`` keeps what
    arrived.
    """
    async with client.stream("POST", "/v1/chat/completions", json=body) as response:
        if response.status_code != 200:
            text = (await response.aread()).decode(errors="replace")[:200]
            raise _StreamFailed(f"http_{response.status_code}", text)
        async for line in response.aiter_lines():
            if not line.startswith("data:"):
                continue  # blank separators, ": keepalive" comments, event names
            data = line[len("data:") :].strip()
            if data == "[DONE]":
                return
            try:
                chunk = json.loads(data)
            except json.JSONDecodeError as exc:
                raise _StreamFailed("bad_json", f"{exc}: {data[:100]!r}") from None
            if not isinstance(chunk, dict):
                raise _StreamFailed("bad_json", f"not an object: {data[:100]!r}")
            if "error" in chunk:
                raise _StreamFailed("stream_error", json.dumps(chunk["error"])[:200])
            if usage := chunk.get("usage"):
                progress.usage_tokens = usage.get("completion_tokens", progress.usage_tokens)
            if _content_of(chunk):
                progress.content_arrived()
    raise _StreamFailed("missing_done", f"stream ended after {progress.num_chunks} chunks")


def _error_kind(exc: httpx.HTTPError) -> str:
    match exc:
        case httpx.TimeoutException():
            return "timeout"
        case httpx.ConnectError():
            return "connect_error"
        case httpx.ReadError():
            return "read_error"
        case httpx.WriteError():
            return "write_error"
        case httpx.RemoteProtocolError():
            return "protocol_error"
        case _:
            return type(exc).__name__


async def run_request(
    client: httpx.AsyncClient,
    *,
    client_id: int,
    index: int,
    body: dict,
    timeout_s: float,
    timeout_kind: str = "timeout",
    late: bool = False,
    on_first: Callable[[], None] | None = None,
    run_started: float | None = None,
) -> RequestResult:
    """One request, bounded by ``timeout_s``; every failure becomes a failed RequestResult.

    Running out of time is error ``timeout_kind``. A failed request keeps what it measured
    before failing (TTFT, gaps, chunks received). ``late`` is recorded in the result, and the
    send time from ``run_started`` (``time.perf_counter()``), if given; ``on_first`` is called
    when the first content arrives.
    Cancelled from outside: the cancellation propagates and the connection is closed.
    """
    progress = StreamProgress(started=time.perf_counter(), on_first=on_first)
    error: str | None = None
    detail: str | None = None
    with trio.move_on_after(timeout_s) as scope:
        try:
            await _stream_one(client, body, progress)
        except _StreamFailed as exc:
            error, detail = exc.kind, exc.detail
        except httpx.HTTPError as exc:
            error, detail = _error_kind(exc), str(exc) or type(exc).__name__
    if scope.cancelled_caught:
        error, detail = timeout_kind, f"no complete response within {timeout_s:.3g} s"
    elapsed = time.perf_counter() - progress.started
    if error is not None:
        logger.debug("request %d.%d failed: %s (%s)", client_id, index, error, detail)
    return RequestResult(
        client=client_id,
        index=index,
        ttft_s=progress.ttft_s,
        inter_token_s=tuple(progress.gaps),
        completion_tokens=progress.completion_tokens,
        elapsed_s=elapsed,
        error=error,
        detail=detail,
        late=late,
        sent_s=None if run_started is None else progress.started - run_started,
    )
