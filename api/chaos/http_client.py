"""The chaos run's HTTP client: the real server (Hypercorn on a loopback port) on the faulty
engine, and httpx clients streaming ``POST /v1/completions``, acting out client faults on the
connection, and reading ``/v1/stats`` and ``/health``. Real time, as sockets need."""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator
from contextlib import aclosing, asynccontextmanager
from dataclasses import fields
from functools import partial
from typing import Any

import httpx
import trio

from ...actors.config import RuntimeConfig, RuntimeStatistics
from ...actors.port import EngineLiveness, EnginePort
from ...engine.budget import MemoryBudget, MemoryUsage
from ...engine.outputs import PromptCacheStatistics
from ..http_state import AppState
from ..server import ServeOptions, serve
from .client import Client
from .plan import ClientFault, RequestPlan
from .results import RequestResult

logger = logging.getLogger(__name__)

# The error codes of the HTTP API (api/http_errors.py) back to the outcomes they report. Written out
# rather than derived from the server's table, so that the harness checks that mapping too.
HTTP_ERROR_OUTCOME = {
    "request_timeout": "cancelled:deadline",
    "shutting_down": "cancelled:shutdown",
    "engine_timeout": "cancelled:engine_fault",
    "engine_fault": "failed:engine_fault",
    "client_idle": "cancelled:consumer_idle",
    "request_cancelled": "cancelled:requested",
    "client_closed": "cancelled:consumer_closed",
}
HTTP_REFUSALS = ("overloaded", "shutting_down", "engine_unavailable")


@asynccontextmanager
async def open_over_http(engine: EnginePort, config: RuntimeConfig) -> AsyncIterator[Client]:
    """The real server (Hypercorn on a loopback port) on ``engine``, and an HTTP client pool."""
    options = ServeOptions(host="127.0.0.1", port=0, handle_signals=False, runtime=config)
    state = AppState(options.http)
    stop = trio.Event()
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
    timeout = httpx.Timeout(60.0, connect=30.0)
    async with trio.open_nursery() as nursery:
        url = await nursery.start(
            partial(serve, options, engine=engine, shutdown=stop, state=state)
        )
        try:
            async with httpx.AsyncClient(base_url=url, limits=limits, timeout=timeout) as http:
                with trio.fail_after(60):
                    while (await http.get("/health")).status_code != 200:
                        await trio.sleep(0.05)
                yield HttpClient(http, state, config)
        finally:
            stop.set()


def _runtime_statistics(data: dict[str, Any]) -> RuntimeStatistics:
    """Rebuild :class:`RuntimeStatistics` from GET /v1/stats (``asdict`` of it, with the
    HTTP edge's own keys beside it, such as ``adapters``, left out)."""
    known = {f.name for f in fields(RuntimeStatistics)}
    data = {key: value for key, value in data.items() if key in known}
    cache = data.get("prompt_cache")
    budget = data.get("memory_budget")
    memory = data.get("memory")
    return RuntimeStatistics(
        **{
            **data,
            "prompt_cache": PromptCacheStatistics(**cache) if cache else None,
            "engine": EngineLiveness(**data["engine"]),
            "memory_budget": MemoryBudget(**budget) if budget else None,
            "memory": MemoryUsage(**memory) if memory else None,
        }
    )


class HttpClient:
    """Each request is a streaming ``POST /v1/completions``; client faults are acted out on the
    connection: read slowly, stop reading for a while, hang up, cancel by id."""

    name = "over HTTP"

    def __init__(self, http: httpx.AsyncClient, state: AppState, config: RuntimeConfig) -> None:
        self.http = http
        self.state = state
        # Long enough to trip the idle timeout if the server's writes block on a full socket;
        # small outputs sit in the socket buffers, though, so the session usually completes.
        self.stall_s = config.idle_timeout_s * 1.5

    async def shutdown(self) -> None:
        # What serve does on SIGTERM, except that the server keeps answering: quiescence can
        # still be checked over HTTP, and new requests get 503 shutting_down.
        assert self.state.runtime is not None
        await self.state.runtime.shutdown()

    async def observe(self) -> tuple[RuntimeStatistics, int | None]:
        stats = await self.http.get("/v1/stats")
        stats.raise_for_status()
        health = await self.http.get("/health")
        return _runtime_statistics(stats.json()), health.status_code

    async def drive(self, plan: RequestPlan, result: RequestResult) -> None:
        result.tokens = None  # the API streams text, not token ids
        body: dict[str, Any] = {
            "model": self.state.model_id,
            "prompt": plan.prompt,
            "max_tokens": plan.max_tokens,
            "temperature": plan.temperature,
            "stream": True,
        }
        if plan.client is not None and plan.client.kind == "deadline":
            body["timeout"] = plan.client.delay_s
        try:
            async with self.http.stream("POST", "/v1/completions", json=body) as response:
                if response.status_code == 200:
                    result.acted = "timeout" in body  # the deadline went with the request
                    await self._read(response, plan.client, result)
                else:
                    await self._refused(response, result)
        except (httpx.HTTPError, ValueError, LookupError, TypeError) as exc:
            # The connection broke, or a chunk is not what the API promises: the check flags
            # the request (truncated) rather than the whole run crashing.
            if not result.unseen:
                result.truncated = True
                logger.warning("req %d: the stream broke: %r", plan.number, exc)

    async def _read(
        self, response: httpx.Response, fault: ClientFault | None, result: RequestResult
    ) -> None:
        """Read the SSE stream to ``[DONE]``, acting out the client fault on the way."""
        request_id = response.headers.get("x-request-id", "")
        events = 0
        acted = False
        async with aclosing(response.aiter_lines()) as lines:
            async for line in lines:
                if line.startswith("data: "):
                    payload = line.removeprefix("data: ")
                    if payload == "[DONE]":
                        return
                    outcome = self._chunk(json.loads(payload), result)
                    if outcome is not None:
                        result.outcome = outcome
                        result.outcomes_seen += 1
                        continue
                elif not line.startswith(":"):  # ": prefill" comments count as events too
                    continue
                events += 1
                if fault is None or events <= fault.after_events:
                    continue
                result.acted = True
                match fault.kind:
                    case "slow_reader":
                        await trio.sleep(fault.delay_s)
                    case "consumer_stall" if not acted:
                        acted = True
                        await trio.sleep(self.stall_s)  # then read on
                    case "cancel" if not acted:
                        acted = True
                        await self.http.post(f"/v1/requests/{request_id}/cancel")
                    case "consumer_close" | "disconnect":
                        result.unseen = True
                        return  # leaving the stream's context closes the connection
        result.truncated = True

    @staticmethod
    def _chunk(data: dict[str, Any], result: RequestResult) -> str | None:
        """Take a chunk's text; return the outcome it reports, if any."""
        if "error" in data:
            code = data["error"].get("code")
            return HTTP_ERROR_OUTCOME.get(code, f"failed:{code}")
        choice = data["choices"][0]
        result.text += choice.get("text") or ""
        reason = choice.get("finish_reason")
        return f"completed:{reason}" if reason is not None else None

    @staticmethod
    async def _refused(response: httpx.Response, result: RequestResult) -> None:
        """A reply before any streaming: a refusal (503), or an outcome the check will flag."""
        await response.aread()
        try:
            code = response.json()["error"]["code"]
        except (ValueError, KeyError, TypeError):
            code = None
        if response.status_code == 503 and code in HTTP_REFUSALS:
            result.refused = code  # whether the gate was full cannot be seen from here
        else:
            result.outcome = f"failed:http {response.status_code} {code}"
            result.outcomes_seen += 1
