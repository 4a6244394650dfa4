"""The fault-injection harness: randomized workloads with injected faults, checked against the
runtime's invariants.

A :class:`FaultPlan` (reproducible from a seed) says what each request does and which faults
hit the engine; :func:`run_plan` drives it over a :class:`~mlx_trio.actors.faulty.FaultyEngine`
through a client: the in-process API (virtual time works), or real HTTP clients against the
real server (``http=True``, real time), and :func:`check` compares what happened with what the
plan implies:

- every request ends in exactly one outcome, of a kind its faults allow (over HTTP, a client
  that hangs up never learns its outcome: the runtime's counters must account for it);
- at quiescence: no rows, no permits, no queued sessions, KV bytes back to zero;
- requests no fault touched produce exactly the tokens (over HTTP: the text) of a fault-free run;
- a stuck step leaves the runtime unhealthy (over HTTP: /health says 503) and its sessions
  cancelled ``engine_fault``;
- the runtime's counters agree with the outcomes and with what was injected.
"""

from __future__ import annotations

import bisect
import json
import logging
import random
from collections import Counter
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing, asynccontextmanager
from dataclasses import dataclass, field, replace
from functools import partial
from typing import Any, Literal, Protocol

import httpx
import trio

from mlx_trio.actors.batch_group import MAX_STEPS_PER_CALL
from mlx_trio.actors.faulty import FaultyEngine, RowFault, StepFault, StepFaultKind
from mlx_trio.actors.messages import (
    Cancelled,
    Completed,
    Failed,
    GenerationRequest,
    TextDelta,
    describe,
)
from mlx_trio.actors.port import EnginePort
from mlx_trio.actors.runtime import RuntimeConfig, RuntimeStatistics
from mlx_trio.api.http import AppState
from mlx_trio.api.inprocess import RuntimeHandle, open_runtime
from mlx_trio.api.server import ServeOptions, serve
from mlx_trio.engine.errors import OverloadedError, RuntimeClosedError
from mlx_trio.engine.outputs import PromptCacheStatistics

logger = logging.getLogger(__name__)

ClientFaultKind = Literal[
    "consumer_stall", "slow_reader", "consumer_close", "disconnect", "cancel", "deadline"
]
ENGINE_KINDS = (
    "step_error",
    "prefill_error",
    "sampler_error",
    "step_hang",
    "step_slow",
    "kv_exhausted",
)
CLIENT_KINDS = (
    "consumer_stall",
    "slow_reader",
    "consumer_close",
    "disconnect",
    "cancel",
    "deadline",
)
RUN_KINDS = ("shutdown", "burst")
FAULT_KINDS = ENGINE_KINDS + CLIENT_KINDS + RUN_KINDS
SAMPLED_TEMPERATURE = 0.8
# A plan with a hang lasts at least this many step watchdog periods: shorter, and a small plan
# is mostly hang, and the requests meant to carry the other faults are refused behind it.
HANG_ROOM = 15


@dataclass(frozen=True, slots=True)
class ClientFault:
    """What a request's client does: stop reading, read slowly, close its end, disconnect,
    cancel, or set a deadline it cannot meet, after ``after_events`` events.

    The plan has it due ``at_s`` into the run, and a request carries it as :class:`TimedFault`
    says: the first one sent from then on, or the next if that one's client could not act it
    out (refused, or its request finished first).
    """

    kind: ClientFaultKind
    after_events: int = 0
    delay_s: float = 0.0
    at_s: float = 0.0


@dataclass(frozen=True, slots=True)
class RequestPlan:
    """One request of the workload. ``reproducible`` ones take the serial lane; ``sampled`` ones
    draw at ``SAMPLED_TEMPERATURE`` with no seed: their tokens are compared with nothing, but a
    fault that broke shared sampling state (one row's failed sampler, say) fails them."""

    number: int
    start_s: float
    max_tokens: int
    reproducible: bool = False
    client: ClientFault | None = None
    in_burst: bool = False
    sampled: bool = False

    @property
    def temperature(self) -> float:
        return SAMPLED_TEMPERATURE if self.sampled else 0.0

    @property
    def prompt(self) -> str:
        return f"[req {self.number}] tell me something about the number {self.number}"


EngineFaultKind = StepFaultKind | Literal["sampler_error", "add_error"]
ROW_FAULT_KINDS = ("sampler_error", "add_error")


@dataclass(frozen=True, slots=True)
class TimedFault:
    """An engine fault due ``at_s`` into the run, scheduled by time rather than by step number
    (how many batch calls a run makes depends on batching, and over HTTP on real time).

    A step fault goes into the next batch step (``prefill_error``: the next one that prefills a
    row). A row fault (``sampler_error``, ``add_error``: KV memory exhausted at admission), like
    a client fault, goes to the first request sent from then on that carries no fault (and is
    not in the burst; for ``add_error``, not in the serial lane), and moves on to the next one
    if its request ends without it firing (refused, or failed first by a step fault).
    """

    kind: EngineFaultKind
    at_s: float
    slow_s: float = 0.0


@dataclass(frozen=True, slots=True)
class FaultPlan:
    seed: int
    requests: tuple[RequestPlan, ...]
    engine_faults: tuple[TimedFault, ...] = ()
    shutdown_at_s: float | None = None
    config: RuntimeConfig = field(default_factory=RuntimeConfig)
    client_faults: tuple[ClientFault, ...] = ()

    @property
    def planned(self) -> Counter[str]:
        counts: Counter[str] = Counter()
        counts.update(f.kind for f in self.engine_faults)
        counts.update(f.kind for f in self.client_faults)
        counts["burst"] = sum(r.in_burst for r in self.requests)
        counts["shutdown"] = int(self.shutdown_at_s is not None)
        return +counts

    @classmethod
    def generate(
        cls, seed: int, num_requests: int, kinds: tuple[str, ...], *, step_s: float = 0.01
    ) -> FaultPlan:
        """A random plan: requests arrive over time; each fault kind hits a few of them."""
        unknown = set(kinds) - set(FAULT_KINDS)
        if unknown:
            raise ValueError(f"unknown fault kinds {sorted(unknown)}; known: {FAULT_KINDS}")
        if num_requests < 1:
            raise ValueError(f"a plan needs at least one request, not {num_requests}")
        rng = random.Random(seed)
        config = RuntimeConfig(
            max_batch=8,
            max_live=16,
            max_queued=32,
            event_buffer=4,
            idle_timeout_s=2.0,
            step_timeout_s=1.0,
            shutdown_grace_s=0.5,
        )
        span = num_requests * step_s * 5  # about half of what the batch can serve
        if "step_hang" in kinds:  # a hang stops the batch for a watchdog period or more
            span = max(span, HANG_ROOM * config.step_timeout_s)
        requests = [
            RequestPlan(
                number=i,
                start_s=rng.uniform(0, span),
                max_tokens=rng.randint(4, 24),
                reproducible=rng.random() < 0.05,
            )
            for i in range(num_requests)
        ]
        # Every fifth batched request samples (chosen by number: the plan's draws stay as
        # they were for a seed).
        requests = [replace(r, sampled=not r.reproducible and r.number % 5 == 2) for r in requests]
        per_kind = max(1, num_requests // 400)
        clients = [
            replace(_client_fault(kind, rng, step_s), at_s=_fault_time(rng, span))
            for kind in kinds
            if kind in CLIENT_KINDS
            for _ in range(per_kind)
        ]
        if "burst" in kinds:
            at = rng.uniform(0, span)
            # Twice the bound: over HTTP a burst takes a while to arrive; sessions end meanwhile.
            burst = 2 * (config.live_limit + config.max_queued)
            base = len(requests)
            requests += [
                RequestPlan(number=base + j, start_s=at, max_tokens=8, in_burst=True)
                for j in range(burst)
            ]
        faults = _engine_faults(rng, [k for k in kinds if k in ENGINE_KINDS], per_kind, span)
        shutdown = span * rng.uniform(0.9, 0.97) if "shutdown" in kinds else None
        return cls(
            seed,
            tuple(sorted(requests, key=lambda r: r.start_s)),
            tuple(faults),
            shutdown,
            config,
            tuple(clients),
        )


def _fault_time(rng: random.Random, span: float) -> float:
    """A time in the first 70% of the workload: well before a shutdown (at 90% or later), with
    requests still arriving to carry the fault, or the next request if it did not take."""
    return span * rng.uniform(0.02, 0.7)


def _engine_faults(
    rng: random.Random, kinds: list[str], per_kind: int, span: float
) -> list[TimedFault]:
    faults: list[TimedFault] = []
    for kind in kinds:
        for _ in range(per_kind):
            slow_s = 0.5 if kind == "step_slow" else 0.0
            faults.append(TimedFault(kind, _fault_time(rng, span), slow_s))  # type: ignore[arg-type]
    if "kv_exhausted" in kinds:
        faults.append(TimedFault("add_error", _fault_time(rng, span)))
    return faults


def _client_fault(kind: str, rng: random.Random, step_s: float) -> ClientFault:
    match kind:
        case "slow_reader":
            return ClientFault("slow_reader", delay_s=step_s * rng.uniform(2, 6))
        case "deadline":
            return ClientFault("deadline", delay_s=step_s * 2)
        case _:
            return ClientFault(kind, after_events=rng.randint(0, 3))  # type: ignore[arg-type]


# -- running a plan -----------------------------------------------------------------------


@dataclass
class RequestResult:
    """What one request's client saw.

    ``outcome``: the outcome as :func:`describe` writes it (``completed:length``), or None if the
    client never saw one. ``tokens``: None where the client cannot see token ids (over HTTP).
    ``unseen``: the client hung up on purpose before its outcome came, so it never learns it.
    ``truncated``: an HTTP stream ended without ``data: [DONE]`` although the client stayed.
    ``acted``: the client acted out its fault (its request finished first, or was refused: no).
    """

    plan: RequestPlan
    refused: str | None = None
    refused_when_full: bool = True
    outcome: str | None = None
    outcomes_seen: int = 0
    text: str = ""
    tokens: list[int] | None = field(default_factory=list)
    unseen: bool = False
    truncated: bool = False
    acted: bool = False


@dataclass(frozen=True, slots=True)
class HealthProbe:
    """What the runtime said of its health, polled during the run, once the first injected
    hang's watchdog had fired: its statistics and, over HTTP, /health's status code."""

    stuck_steps: int
    is_healthy: bool
    health_status: int | None


@dataclass
class RunResult:
    plan: FaultPlan
    requests: list[RequestResult]
    statistics: RuntimeStatistics
    injections: Counter[str]
    touched: dict[int, set[str]]
    engine_rows: int
    client: str = "in-process"
    health_status: int | None = None  # GET /health's status code, over HTTP
    hang_probe: HealthProbe | None = None

    @property
    def injected(self) -> Counter[str]:
        """Per fault kind, how many were injected: engine faults that fired, client faults
        acted out, burst requests sent, the shutdown."""
        counts = Counter(self.injections)
        counts.update(r.plan.client.kind for r in self.requests if r.plan.client and r.acted)
        counts["burst"] = sum(r.plan.in_burst for r in self.requests)
        counts["shutdown"] = int(self.plan.shutdown_at_s is not None)
        return +counts


class Client(Protocol):
    """How the plan's requests reach the runtime: the in-process API or real HTTP clients."""

    name: str

    async def drive(self, plan: RequestPlan, result: RequestResult) -> None:
        """Send one request now, act out its client fault, and record what it saw."""

    async def shutdown(self) -> None:
        """Shut the runtime down (close admission, grace, cancel the rest) as a signal would."""

    async def observe(self) -> tuple[RuntimeStatistics, int | None]:
        """The runtime's statistics, and /health's status code where there is one."""


async def run_plan(plan: FaultPlan, inner: EnginePort, *, http: bool = False) -> RunResult:
    """Drive ``plan`` on ``inner`` wrapped with the plan's faults: through the in-process API,
    or (``http``) through real HTTP clients against the real server, in real time."""
    engine = FaultyEngine(inner)
    results = {r.number: RequestResult(r) for r in plan.requests}
    row_faults = [f for f in plan.engine_faults if f.kind in ROW_FAULT_KINDS]
    carriers = _Carriers(engine, [*row_faults, *plan.client_faults])
    step_faults = [f for f in plan.engine_faults if f.kind not in ROW_FAULT_KINDS]
    probes: list[HealthProbe] = []
    connect = _over_http if http else _in_process
    async with connect(engine, plan.config) as client:
        async with trio.open_nursery() as injector:
            injector.start_soon(_inject_step_faults, engine, step_faults, client, plan, probes)
            async with trio.open_nursery() as clients:
                for request in plan.requests:
                    clients.start_soon(_start, client, request, results[request.number], carriers)
                if plan.shutdown_at_s is not None:
                    await trio.sleep(plan.shutdown_at_s)
                    await client.shutdown()
            injector.cancel_scope.cancel()  # faults due after the workload ended never come
        # Quiescence is checked while the runtime still runs: shutdown must not hide a leak.
        await trio.sleep(plan.config.step_timeout_s)
        stats, health = await client.observe()
        engine_rows = getattr(inner, "num_rows", 0)
    touched: dict[int, set[str]] = {}
    for injection in engine.injections:
        for number in injection.requests:
            touched.setdefault(number, set()).add(injection.kind)
    injected = Counter(i.kind for i in engine.injections)
    return RunResult(
        plan,
        list(results.values()),
        stats,
        injected,
        touched,
        engine_rows,
        client.name,
        health,
        probes[0] if probes else None,
    )


async def _start(
    client: Client, plan: RequestPlan, result: RequestResult, carriers: _Carriers
) -> None:
    await trio.sleep(plan.start_s)
    result.plan, fault = carriers.claim(plan)
    await client.drive(result.plan, result)
    if fault is not None:
        carriers.settle(fault, result)


RequestFault = TimedFault | ClientFault


class _Carriers:
    """The plan's row and client faults waiting for a request to carry them: the rule is in
    :class:`TimedFault`'s docstring."""

    def __init__(self, engine: FaultyEngine, faults: list[RequestFault]) -> None:
        self._engine = engine
        self._waiting = sorted(faults, key=_due)

    def claim(self, request: RequestPlan) -> tuple[RequestPlan, RequestFault | None]:
        """``request``, sent now, with the first fault due that it can carry, and that fault."""
        if request.in_burst:
            return request, None
        for fault in self._waiting:
            if fault.at_s > request.start_s:
                break
            if fault.kind == "add_error" and request.reproducible:
                continue  # the serial lane adds no batch row
            self._waiting.remove(fault)
            if isinstance(fault, ClientFault):
                return replace(request, client=fault), fault
            # A sampler fault at the first token: a model may stop at the next.
            self._engine.inject(RowFault(fault.kind, request.number, at_token=0))  # type: ignore[arg-type]
            return request, fault
        return request, None

    def settle(self, fault: RequestFault, result: RequestResult) -> None:
        """``result``'s request has ended: if its fault did not take, the next request gets it."""
        number = result.plan.number
        if isinstance(fault, ClientFault):
            took = result.acted
        else:
            took = any(
                i.kind == fault.kind and number in i.requests for i in self._engine.injections
            )
        if not took:
            logger.info("%s did not take in request %d: moving it on", fault.kind, number)
            bisect.insort(self._waiting, fault, key=_due)


def _due(fault: RequestFault) -> float:
    return fault.at_s


async def _inject_step_faults(
    engine: FaultyEngine,
    faults: list[TimedFault],
    client: Client,
    plan: FaultPlan,
    probes: list[HealthProbe],
) -> None:
    """Put each step fault into the next batch step when its time comes; after the first hang,
    poll the runtime's health until its watchdog has fired. Cancelled when the workload ends."""
    start = trio.current_time()
    probing = False
    async with trio.open_nursery() as nursery:
        for fault in sorted(faults, key=lambda f: f.at_s):
            await trio.sleep_until(start + fault.at_s)
            step = engine.num_batch_steps + 1
            engine.inject(StepFault(fault.kind, step, slow_s=fault.slow_s))  # type: ignore[arg-type]
            if fault.kind == "step_hang" and not probing:
                probing = True
                nursery.start_soon(_probe_health, client, plan.config, probes)


async def _probe_health(client: Client, config: RuntimeConfig, probes: list[HealthProbe]) -> None:
    """Poll until a stuck step shows in the statistics (the hang starts at the next batch step
    and lasts a watchdog period per step in its call); ``probes`` holds the latest answer."""
    deadline = trio.current_time() + config.step_timeout_s * (MAX_STEPS_PER_CALL + 2)
    while True:
        stats, health = await client.observe()
        probes[:] = [HealthProbe(stats.stuck_steps, stats.is_healthy, health)]
        if stats.stuck_steps or trio.current_time() >= deadline:
            return
        await trio.sleep(config.step_timeout_s / 10)


# -- in process ---------------------------------------------------------------------------


@asynccontextmanager
async def _in_process(engine: EnginePort, config: RuntimeConfig) -> AsyncIterator[Client]:
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
        except (OverloadedError, RuntimeClosedError) as exc:
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


# -- over HTTP ----------------------------------------------------------------------------

# The error codes of the HTTP API (api/http.py) back to the outcomes they report. Written out
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
HTTP_REFUSALS = ("overloaded", "shutting_down")


@asynccontextmanager
async def _over_http(engine: EnginePort, config: RuntimeConfig) -> AsyncIterator[Client]:
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
    """Rebuild :class:`RuntimeStatistics` from GET /v1/stats (``asdict`` of it)."""
    cache = data.get("prompt_cache")
    return RuntimeStatistics(
        **{**data, "prompt_cache": PromptCacheStatistics(**cache) if cache else None}
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


# -- the invariants -----------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Check:
    name: str
    ok: bool
    detail: str = ""


@dataclass(frozen=True, slots=True)
class Expected:
    """What a fault-free run gives a request: its tokens, and its text."""

    tokens: list[int]
    text: str


ENGINE_OUTCOME = {
    "step_error": {"failed:engine_fault"},
    "prefill_error": {"failed:engine_fault"},
    "kv_exhausted": {"failed:engine_fault"},
    "add_error": {"failed:engine_fault"},
    "sampler_error": {"failed:engine_fault"},
    "step_hang": {"cancelled:engine_fault"},
    "step_slow": {"completed:length", "completed:stop"},
}
CLEAN = {"completed:length", "completed:stop"}
# A client that acts after its request already finished sees it completed: that race is real.
CLIENT_OUTCOME = {
    "consumer_stall": {"cancelled:consumer_idle"} | CLEAN,
    "slow_reader": CLEAN,
    "consumer_close": {"cancelled:consumer_closed"} | CLEAN,
    "disconnect": {"cancelled:consumer_closed"} | CLEAN,
    "cancel": {"cancelled:requested"} | CLEAN,
    "deadline": {"cancelled:deadline"},
}


def allowed_outcomes(result: RequestResult, touched: set[str], shutdown: bool) -> set[str]:
    allowed: set[str] = set()
    for kind in touched:
        allowed |= ENGINE_OUTCOME[kind]
    if result.plan.client is not None:
        allowed |= CLIENT_OUTCOME[result.plan.client.kind]
    if not allowed or touched <= {"step_slow"}:
        allowed |= CLEAN
    if shutdown:
        allowed |= {"cancelled:shutdown"} | CLEAN
    return allowed


def _counted(outcome: str) -> str:
    """An outcome as the runtime's counters see it: completions are counted as one kind."""
    return "completed" if outcome.startswith("completed:") else outcome


def check(run: RunResult, reference: Callable[[RequestPlan], Expected]) -> list[Check]:
    """Every invariant, each with what it found."""
    return [
        _every_planned_fault_injected(run),
        _refusals_only_past_the_bound(run),
        _exactly_one_outcome_each(run),
        _outcome_kinds_match_the_faults(run),
        _quiescent(run),
        _untouched_match(run, reference),
        _stuck_step_unhealthy(run),
        _counters_agree(run),
    ]


def _admitted(run: RunResult) -> list[RequestResult]:
    return [r for r in run.requests if r.refused is None]


def _allowed(run: RunResult, result: RequestResult) -> set[str]:
    touched = run.touched.get(result.plan.number, set())
    return allowed_outcomes(result, touched, run.plan.shutdown_at_s is not None)


def _every_planned_fault_injected(run: RunResult) -> Check:
    planned, injected = run.plan.planned, run.injected
    missing = sorted(kind for kind in planned if not injected[kind])
    detail = f"never injected: {', '.join(missing)}" if missing else f"{len(planned)} kinds"
    return Check("every planned fault kind injected", not missing, detail)


def _refusals_only_past_the_bound(run: RunResult) -> Check:
    shutdown = run.plan.shutdown_at_s is not None
    stray = [
        r.plan.number
        for r in run.requests
        if (r.refused == "overloaded" and not r.refused_when_full)
        or (r.refused == "shutting_down" and not shutdown)
    ]
    burst = [r for r in run.requests if r.plan.in_burst]
    # A burst past the bound meets a full gate, unless the shutdown closed admission first
    # (over HTTP a burst takes a while to arrive, so the shutdown may come in the middle of it).
    bound_held = (
        not burst
        or any(r.refused == "overloaded" for r in burst)
        or any(r.refused == "shutting_down" for r in burst)
    )
    refused = f"{sum(bool(r.refused) for r in run.requests)} refused"
    if run.health_status is not None:
        refused += " (over HTTP a refusal cannot show whether the gate was full)"
    return Check(
        "refusals only past the bound",
        not stray and bound_held,
        f"stray {stray[:5]}" if stray else refused,
    )


def _exactly_one_outcome_each(run: RunResult) -> Check:
    admitted = _admitted(run)
    missing = [
        r.plan.number for r in admitted if not r.unseen and (r.outcome is None or r.truncated)
    ]
    doubled = [r.plan.number for r in admitted if r.outcomes_seen > 1]
    return Check(
        "exactly one outcome each",
        not missing and not doubled,
        f"missing {missing[:5]} doubled {doubled[:5]}"
        if missing or doubled
        else f"{len(admitted)} admitted, {sum(r.unseen for r in admitted)} unseen",
    )


def _outcome_kinds_match_the_faults(run: RunResult) -> Check:
    wrong = []
    for r in _admitted(run):
        if r.outcome is None:
            continue
        allowed = _allowed(run, r)
        if r.outcome not in allowed:
            wrong.append(f"req {r.plan.number}: {r.outcome} not in {sorted(allowed)}")
    return Check("outcome kinds match the faults", not wrong, "; ".join(wrong[:3]))


def _quiescent(run: RunResult) -> Check:
    s = run.statistics
    leftovers = {
        "live": s.live_sessions,
        "queued": s.queued_sessions,
        "active rows": s.active_rows,
        "parked rows": s.parked_rows,
        "pending rows": s.pending_rows,
        "kv bytes": s.kv_bytes,
        "engine rows": run.engine_rows,
    }
    held = {k: v for k, v in leftovers.items() if v}
    return Check(
        "quiescent: nothing held",
        not held and s.lane_mode == "idle",
        f"{held} lane={s.lane_mode}" if held or s.lane_mode != "idle" else "",
    )


def _untouched_match(run: RunResult, reference: Callable[[RequestPlan], Expected]) -> Check:
    untouched = [
        r
        for r in _admitted(run)
        if r.plan.number not in run.touched
        and not r.plan.sampled
        and (r.plan.client is None or r.plan.client.kind == "slow_reader")
        and r.outcome is not None
        and r.outcome.startswith("completed:")
    ]
    diverged = []
    for r in untouched:
        expected = reference(r.plan)
        same = r.tokens == expected.tokens if r.tokens is not None else r.text == expected.text
        if not same:
            diverged.append(r.plan.number)
    return Check(
        "untouched requests match a fault-free run",
        not diverged,
        f"{len(untouched)} compared" + (f", diverged {diverged[:5]}" if diverged else ""),
    )


def _stuck_step_unhealthy(run: RunResult) -> Check:
    """After a hang: unhealthy during the run (over HTTP /health says 503), and still at the
    end, with one stuck step counted for each hang."""
    s, probe, hangs = run.statistics, run.hang_probe, run.injections["step_hang"]
    seen_unhealthy = (
        probe is not None and not probe.is_healthy and probe.health_status in (None, 503)
    )
    hung_ok = (not hangs) or (
        seen_unhealthy
        and not s.is_healthy
        and s.stuck_steps == hangs
        and run.health_status in (None, 503)
    )
    during = "not probed" if probe is None else f"healthy={probe.is_healthy}"
    if probe is not None and probe.health_status is not None:
        during += f" /health={probe.health_status}"
    health = "" if run.health_status is None else f" /health={run.health_status}"
    return Check(
        "a stuck step makes the runtime unhealthy",
        hung_ok,
        f"hangs={hangs}; during the run: {during}; "
        f"at the end: stuck_steps={s.stuck_steps} healthy={s.is_healthy}{health}",
    )


def _counters_agree(run: RunResult) -> Check:
    """What the runtime counted against what the clients saw: every outcome seen was counted,
    and the rest are exactly the outcomes of the clients that hung up before seeing theirs."""
    s = run.statistics
    admitted = _admitted(run)
    unseen = [r for r in admitted if r.unseen]
    counted = Counter({"completed": s.completed})
    counted.update({f"cancelled:{reason}": n for reason, n in s.cancelled.items()})
    counted.update({f"failed:{code}": n for code, n in s.failed.items()})
    seen = Counter(_counted(r.outcome) for r in admitted if r.outcome is not None)
    mismatches = [
        f"{kind} stats={counted[kind]} seen={n}" for kind, n in seen.items() if n > counted[kind]
    ]
    residual = counted - seen
    if residual.total() != len(unseen):
        mismatches.append(f"{residual.total()} outcomes not seen, {len(unseen)} unseen requests")
    possible = [{_counted(o) for o in _allowed(run, r)} for r in unseen]
    mismatches += [
        f"{kind} x{n} counted, unseen, allowed for none"
        for kind, n in residual.items()
        if not any(kind in kinds for kinds in possible)
    ]
    overloaded = sum(r.refused == "overloaded" for r in run.requests)
    if overloaded != s.refused:
        mismatches.append(f"refused stats={s.refused} seen={overloaded}")
    step_faults = sum(
        run.injections[k] for k in ("step_error", "prefill_error", "kv_exhausted", "add_error")
    )
    if step_faults != s.engine_faults:
        mismatches.append(f"engine_faults stats={s.engine_faults} injected={step_faults}")
    return Check(
        "counters agree with outcomes and injections", not mismatches, "; ".join(mismatches)
    )


# -- the report ---------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ChaosReport:
    run: RunResult
    checks: list[Check]

    @property
    def ok(self) -> bool:
        return all(c.ok for c in self.checks)

    def table(self) -> str:
        plan, run = self.run.plan, self.run
        lines = [
            f"seed {plan.seed}: {len(plan.requests)} requests, {run.client}",
            "",
            "| fault | planned | injected |",
            "| --- | --- | --- |",
        ]
        injected = run.injected
        for kind in sorted(set(plan.planned) | {k for k, v in injected.items() if v}):
            lines.append(f"| {kind} | {plan.planned[kind]} | {injected[kind]} |")
        outcomes = Counter(r.outcome for r in run.requests if r.outcome is not None)
        outcomes.update(f"refused:{r.refused}" for r in run.requests if r.refused)
        outcomes["unseen (client hung up)"] = sum(r.unseen for r in run.requests)
        outcomes["truncated (stream cut)"] = sum(r.truncated for r in run.requests)
        lines += ["", "| outcome | requests |", "| --- | --- |"]
        lines += [f"| {kind} | {n} |" for kind, n in sorted(outcomes.items()) if n]
        lines += ["", "| invariant | holds | detail |", "| --- | --- | --- |"]
        lines += [f"| {c.name} | {'yes' if c.ok else 'NO'} | {c.detail} |" for c in self.checks]
        return "\n".join(lines)


def scripted_reference(plan: RequestPlan) -> Expected:
    """The tokens and text the scripted engine gives a request with no fault."""
    from mlx_trio.actors.scripted import expected_tokens, token_text

    tokens = expected_tokens(tuple(ord(c) for c in plan.prompt), plan.max_tokens)
    return Expected(tokens, "".join(token_text(t) for t in tokens))


async def run_scripted(plan: FaultPlan, *, step_s: float = 0.01, http: bool = False) -> ChaosReport:
    """Run a plan on the scripted engine (in-process: use a MockClock for speed; over HTTP it
    runs in real time, as sockets need)."""
    from mlx_trio.actors.scripted import Script, ScriptedEngine

    run = await run_plan(plan, ScriptedEngine(Script(step_s=step_s)), http=http)
    return ChaosReport(run, check(run, scripted_reference))


async def run_on_model(
    plan: FaultPlan, model: str | None, *, device: str = "auto", http: bool = False
) -> ChaosReport:
    """Run a plan on a real model: a fault-free pass (in-process) first gives the reference
    tokens and text; then the plan runs on the same engine, in-process or over HTTP."""
    from mlx_trio.actors.engine_port.thread import EngineThread, ThreadedEngine

    with EngineThread() as thread:
        engine = await ThreadedEngine.load(
            thread, model, device=device, max_batch=plan.config.max_batch
        )
        # Every request, burst included (a queue long enough that none is refused), no fault.
        calm = replace(
            plan,
            engine_faults=(),
            client_faults=(),
            shutdown_at_s=None,
            config=replace(plan.config, max_queued=len(plan.requests)),
        )
        baseline = await run_plan(calm, engine)
        expected = {
            r.plan.number: Expected(r.tokens or [], r.text)
            for r in baseline.requests
            if r.outcome is not None
        }
        run = await run_plan(plan, engine, http=http)
    return ChaosReport(run, check(run, lambda p: expected.get(p.number, Expected([], ""))))
