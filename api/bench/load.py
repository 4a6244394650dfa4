"""Streaming chat-completion load against any OpenAI-compatible server on a loopback address.

``clients`` concurrent clients each send ``requests_per_client`` streaming requests in sequence
(``POST {url}/v1/chat/completions``, ``stream: true``, usage requested, greedy, fixed
``max_tokens``), each with its own prompt from a fixed list. Per request it measures the time to
the first non-empty content delta (TTFT), the gaps between successive content chunks
(inter-token latency, ITL), the completion tokens (the usage chunk's count, else the number of
content chunks) and what went wrong, if anything. The run reports generated tokens per second
of wall time over the whole run, TTFT and ITL percentiles, and errors by kind.

``run_streams`` sends a scenario's streams instead (``scenarios.Stream``: a prompt and
``max_tokens`` each, one request a client), the late ones once every other stream has its
first token or has ended; then the result also summarizes the two groups apart (``groups``).

This is the harness's one load generator: ``mlx-trio bench`` drives both servers with it, and
``python -m mlx_trio.api.bench.http_load --url http://127.0.0.1:8000 --clients 8`` runs it alone
(``http_load``; the GPU run's HTTP waves run it so, in a process of their own). Only
loopback URLs are accepted: this benchmark never loads a remote host.
"""

from __future__ import annotations

import ipaddress
import json
import logging
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from functools import partial

import httpx
import trio

from .load_result import LoadResult, summarize
from .scenarios import Stream, prompt
from .stream import RequestResult, run_request

logger = logging.getLogger(__name__)

DEFAULT_REQUEST_TIMEOUT_S = 300.0
RUN_TIMEOUT_MARGIN_S = 60.0
RUN_STOP_GRACE_S = 10.0


def check_loopback(url: str) -> httpx.URL:
    """Parse ``url``; raise ValueError unless it is http(s) on a loopback host."""
    try:
        parsed = httpx.URL(url)
    except httpx.InvalidURL as exc:
        raise ValueError(f"not a URL: {url!r} ({exc})") from None
    if parsed.scheme not in ("http", "https"):
        raise ValueError(f"not an http(s) URL: {url!r}")
    host = parsed.host
    try:
        is_loopback = host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        is_loopback = False
    if not is_loopback:
        raise ValueError(
            f"refusing non-loopback URL {url!r}: this benchmark only targets loopback hosts "
            "(localhost, 127.0.0.0/8, ::1)"
        )
    return parsed


async def fetch_model_id(client: httpx.AsyncClient) -> str:
    """The first model id listed by ``GET /v1/models``.

    Raises RuntimeError if the listing fails, is not JSON or is empty (pass ``model`` then).
    """
    where = f"GET {client.base_url.join('/v1/models')}"
    try:
        response = await client.get("/v1/models")
        response.raise_for_status()
        ids = [str(m["id"]) for m in response.json().get("data") or []]
    except (httpx.HTTPError, json.JSONDecodeError, AttributeError, KeyError, TypeError) as exc:
        raise RuntimeError(f"{where} failed ({exc!r}); give the model id explicitly") from None
    if not ids:
        raise RuntimeError(f"{where} lists no model; give the model id explicitly")
    return ids[0]


class FirstTokens:
    """The first group's streams counted down to their first tokens (or their ends): the late
    streams wait for none to be left."""

    def __init__(self, client_ids: Iterable[int]) -> None:
        self._waiting = set(client_ids)
        self.all_started = trio.Event()
        if not self._waiting:
            self.all_started.set()

    def started(self, client_id: int) -> None:
        self._waiting.discard(client_id)
        if not self._waiting:
            self.all_started.set()


async def _client_loop(
    client: httpx.AsyncClient,
    *,
    client_id: int,
    bodies: Sequence[dict],
    timeout_s: float,
    deadline: float,
    results: list[RequestResult],
    first_tokens: FirstTokens,
    late: bool = False,
    run_started: float | None = None,
) -> None:
    """Send ``bodies`` one after another until ``deadline`` (``trio.current_time()``); a late
    client first waits for ``first_tokens``, an early one tells it of its first token.

    Appends each outcome to ``results`` (this client's own list). A request cut short by the
    deadline is a ``run_timeout`` error that keeps its measurements; requests not sent by then
    are not appended.
    """
    if late:
        with trio.move_on_at(deadline):
            await first_tokens.all_started.wait()
    on_first = None if late else partial(first_tokens.started, client_id)
    try:
        for index, body in enumerate(bodies):
            remaining = deadline - trio.current_time()
            if remaining <= 0:
                return
            result = await run_request(
                client,
                client_id=client_id,
                index=index,
                body=body,
                timeout_s=min(timeout_s, remaining),
                timeout_kind="timeout" if timeout_s <= remaining else "run_timeout",
                late=late,
                on_first=on_first,
                run_started=run_started,
            )
            results.append(result)
    finally:
        if not late:  # ended without a first token: the late ones need not wait for it
            first_tokens.started(client_id)


def _request_body(model: str, text: str, max_tokens: int, temperature: float = 0.0) -> dict:
    return {
        "model": model,
        "messages": [{"role": "user", "content": text}],
        "stream": True,
        "stream_options": {"include_usage": True},
        "temperature": temperature,
        "repetition_penalty": 1.0,  # not the model's default: the raw runs compared have none
        "max_tokens": max_tokens,
    }


@dataclass(frozen=True, slots=True)
class _ClientPlan:
    """What one client sends, in order: (prompt, max_tokens) a request; whether it is late."""

    requests: tuple[tuple[str, int], ...]
    late: bool = False


async def run_load(
    url: str,
    *,
    clients: int,
    max_tokens: int,
    model: str | None = None,
    requests_per_client: int = 1,
    api_key: str | None = None,
    prompt_offset: int = 0,
    prompt_of: Callable[[int], str] = prompt,
    request_timeout_s: float = DEFAULT_REQUEST_TIMEOUT_S,
    run_timeout_s: float | None = None,
    temperature: float = 0.0,
) -> LoadResult:
    """Run ``clients`` concurrent streaming clients against ``url`` and measure them.

    Client ``c`` sends prompts ``prompt_of(prompt_offset + c * requests_per_client + i)``
    (a scenario's ``prompt``; the default is the ``chat`` scenario's), greedy unless
    ``temperature`` is set. ``model`` is
    the first id of ``GET /v1/models`` unless given. Each request is bounded by
    ``request_timeout_s``; the run by ``run_timeout_s`` (default: every request's timeout in
    sequence plus a margin): requests cut short or not sent by then count as ``run_timeout``.
    Raises ValueError for a non-loopback URL or bad counts. Cancelled: connections are closed
    and nothing is returned.
    """
    if clients < 1 or requests_per_client < 1 or max_tokens < 1:
        raise ValueError("clients, requests_per_client and max_tokens must be at least 1")
    plans = []
    for c in range(clients):
        first = prompt_offset + c * requests_per_client
        texts = (prompt_of(first + i) for i in range(requests_per_client))
        plans.append(_ClientPlan(tuple((text, max_tokens) for text in texts)))
    return await _run(
        url,
        plans,
        model=model,
        api_key=api_key,
        request_timeout_s=request_timeout_s,
        run_timeout_s=run_timeout_s,
        temperature=temperature,
    )


async def run_streams(
    url: str,
    streams: Sequence[Stream],
    *,
    model: str | None = None,
    api_key: str | None = None,
    request_timeout_s: float = DEFAULT_REQUEST_TIMEOUT_S,
    run_timeout_s: float | None = None,
) -> LoadResult:
    """A scenario's ``streams`` against ``url``, a client each, the late ones sent once every
    other stream has its first token or has ended; otherwise as :func:`run_load` (whose
    ``max_tokens`` in the result is the first stream's)."""
    if not streams or any(s.max_tokens < 1 for s in streams):
        raise ValueError("at least one stream, and max_tokens at least 1 for each")
    plans = [_ClientPlan(((s.prompt, s.max_tokens),), s.late) for s in streams]
    return await _run(
        url,
        plans,
        model=model,
        api_key=api_key,
        request_timeout_s=request_timeout_s,
        run_timeout_s=run_timeout_s,
    )


async def _run(
    url: str,
    plans: Sequence[_ClientPlan],
    *,
    model: str | None,
    api_key: str | None,
    request_timeout_s: float,
    run_timeout_s: float | None,
    temperature: float = 0.0,
) -> LoadResult:
    """Each plan's client at once (the late ones gated), measured; see :func:`run_load`."""
    base = check_loopback(url)
    requests_per_client = max(len(plan.requests) for plan in plans)
    if run_timeout_s is None:
        run_timeout_s = request_timeout_s * requests_per_client + RUN_TIMEOUT_MARGIN_S
        if any(plan.late for plan in plans):  # the late ones start once the others have
            run_timeout_s += request_timeout_s
    if request_timeout_s <= 0 or run_timeout_s <= 0:
        raise ValueError("request_timeout_s and run_timeout_s must be positive")
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    clients = len(plans)
    async with httpx.AsyncClient(
        base_url=base,
        headers=headers,
        timeout=httpx.Timeout(request_timeout_s),
        limits=httpx.Limits(max_connections=clients, max_keepalive_connections=clients),
        trust_env=False,  # never route loopback traffic through a proxy from the environment
    ) as client:
        if model is None:
            model = await fetch_model_id(client)
        per_client: list[list[RequestResult]] = [[] for _ in range(clients)]
        first_tokens = FirstTokens(c for c, plan in enumerate(plans) if not plan.late)
        started = time.perf_counter()
        deadline = trio.current_time() + run_timeout_s
        with trio.move_on_at(deadline + RUN_STOP_GRACE_S):  # a net: requests stop at deadline
            async with trio.open_nursery() as nursery:
                for c, plan in enumerate(plans):
                    loop = partial(
                        _client_loop,
                        client,
                        client_id=c,
                        bodies=[
                            _request_body(model, text, n, temperature) for text, n in plan.requests
                        ],
                        timeout_s=request_timeout_s,
                        deadline=deadline,
                        results=per_client[c],
                        first_tokens=first_tokens,
                        late=plan.late,
                        run_started=started,
                    )
                    nursery.start_soon(loop)
        wall = time.perf_counter() - started
    requests = [r for results in per_client for r in results]
    for c, results in enumerate(per_client):
        for index in range(len(results), len(plans[c].requests)):
            detail = f"not sent: the run stopped after {run_timeout_s:g} s"
            requests.append(
                RequestResult(
                    c, index, None, (), 0, wall, "run_timeout", detail, late=plans[c].late
                )
            )
    return summarize(
        url=url,
        model=model,
        clients=sum(not plan.late for plan in plans),
        requests_per_client=requests_per_client,
        max_tokens=plans[0].requests[0][1],
        wall_s=wall,
        requests=requests,
    )
