"""How a chaos run's requests reach the runtime: the :class:`Client` protocol, and the client
of the in-process API (virtual time works), which drives a request, acts out its client fault
and records what it saw. The HTTP client is in :mod:`mlx_trio.api.chaos.http_client`."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Protocol

import trio

from ...actors.config import RuntimeConfig, RuntimeStatistics
from ...actors.messages import (
    Cancelled,
    Completed,
    Failed,
    GenerationRequest,
    TextDelta,
    describe,
)
from ...actors.port import EnginePort
from ...engine.errors import EngineUnavailableError, OverloadedError, RuntimeClosedError
from ..inprocess import RuntimeHandle, open_runtime
from .plan import RequestPlan
from .results import RequestResult


class Client(Protocol):
    """How the plan's requests reach the runtime: the in-process API or real HTTP clients."""

    name: str

    async def drive(self, plan: RequestPlan, result: RequestResult) -> None:
        """Send one request now, act out its client fault, and record what it saw."""

    async def shutdown(self) -> None:
        """Shut the runtime down (close admission, grace, cancel the rest) as a signal would."""

    async def observe(self) -> tuple[RuntimeStatistics, int | None]:
        """The runtime's statistics, and /health's status code where there is one."""


@asynccontextmanager
async def open_in_process(engine: EnginePort, config: RuntimeConfig) -> AsyncIterator[Client]:
    """The runtime on ``engine``, in this process, and a client of it."""
    async with open_runtime(engine=engine, config=config) as rt:
        yield InProcessClient(rt)


class InProcessClient:
    name = "in-process"

    def __init__(self, rt: RuntimeHandle) -> None:
        self.rt = rt

    async def shutdown(self) -> None:
        await self.rt.shutdown()

    async def observe(self) -> tuple[RuntimeStatistics, int | None]:
        return self.rt.statistics(), None

    async def drive(self, plan: RequestPlan, result: RequestResult) -> None:
        client = plan.client
        timeout = client.delay_s if client and client.kind == "deadline" else None
        request = GenerationRequest(
            plan.prompt,
            # The model's defaults for the rest, as the HTTP server gives a body that omits
            # them.
            self.rt.sampling_defaults.params(
                temperature=plan.temperature, max_tokens=plan.max_tokens
            ),
            reproducible=plan.reproducible,
            timeout_s=timeout,
            request_id=f"req-{plan.number}",
        )
        try:
            handle = await self.rt.submit(request)
        except (OverloadedError, EngineUnavailableError, RuntimeClosedError) as exc:
            result.refused = exc.code
            if isinstance(exc, OverloadedError):
                config = self.rt.config
                result.refused_when_full = (
                    exc.live >= config.live_limit and exc.queued >= config.max_queued
                )
            return
        tokens: list[int] = []
        result.tokens = tokens
        result.acted = timeout is not None  # the deadline went with the request
        events = 0
        async with handle:
            async for event in handle:
                if isinstance(event, Completed | Cancelled | Failed):
                    result.outcomes_seen += 1
                    break
                events += 1
                if isinstance(event, TextDelta):
                    result.text += event.text
                    tokens.extend(event.token_ids)
                if client is None or events <= client.after_events:
                    continue
                result.acted = True
                match client.kind:
                    case "slow_reader":
                        await trio.sleep(client.delay_s)
                    case "consumer_stall":
                        break  # stop reading, keep the channel open
                    case "consumer_close" | "disconnect":
                        await handle.aclose()
                        break
                    case "cancel":
                        await handle.cancel()
                        break
            result.outcome = describe(await handle.result())
