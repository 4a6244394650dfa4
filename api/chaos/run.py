"""Running a chaos plan: :func:`run_plan` drives a plan's requests through a client over a
``FaultyEngine`` (``actors/testing/faulty.py``), puts each fault in when it is due (step faults
into the next batch step, row and client faults onto the next request sent, moved on if they
did not take), and probes the runtime's health after the first hang. :func:`run_scripted` and
:func:`run_on_model` (:func:`run_plans_on_model`) run a plan on the scripted engine or a real
model and check it."""

from __future__ import annotations

import bisect
import logging
import os
import signal
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING

import trio

from ...actors.batch_policy import MAX_STEPS_PER_CALL
from ...actors.config import RuntimeConfig, RuntimeStatistics
from ...actors.port import EnginePort
from ...actors.testing.faulty import FaultyEngine, RowFault, StepFault
from ...engine.options import Device, EngineOptions
from .client import Client, open_in_process
from .http_client import open_over_http
from .invariants import Expected, check, held_at_rest
from .plan import (
    ROW_FAULT_KINDS,
    ClientFault,
    FaultPlan,
    RequestPlan,
    TimedFault,
)
from .report import ChaosReport
from .results import HealthProbe, RequestResult, RunResult

if TYPE_CHECKING:
    from ...actors.testing.scripted import ScriptedEngine

logger = logging.getLogger(__name__)

# A real model's steps on a busy 2-core machine (CI's, beside another test file's ranks) took
# over 10 s: the watchdog abandoned them and the supervisor killed the engine as wedged, a
# restart the plan did not inject.
MODEL_STEP_TIMEOUT_S = 30.0
SCRIPTED_RESTART_STEPS = 20  # a crashed scripted engine is back after this many steps' time


async def run_plan(
    plan: FaultPlan,
    inner: EnginePort,
    *,
    http: bool = False,
    crash: Callable[[], None] | None = None,
) -> RunResult:
    """Drive ``plan`` on ``inner`` wrapped with the plan's faults: through the in-process API,
    or (``http``) through real HTTP clients against the real server, in real time. ``crash``
    kills the engine under ``inner`` (for ``engine_crash``)."""
    engine = FaultyEngine(inner, crash=crash)
    results = {r.number: RequestResult(r) for r in plan.requests}
    row_faults = [f for f in plan.engine_faults if f.kind in ROW_FAULT_KINDS]
    carriers = _Carriers(engine, [*row_faults, *plan.client_faults])
    step_faults = [f for f in plan.engine_faults if f.kind not in ROW_FAULT_KINDS]
    probes: list[HealthProbe] = []
    connect = open_over_http if http else open_in_process
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
        stats, health, engine_rows = await _at_rest(client, inner, plan.config.step_timeout_s)
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


async def _at_rest(
    client: Client, inner: EnginePort, within_s: float
) -> tuple[RuntimeStatistics, int | None, int]:
    """The runtime's statistics, /health's status and the engine's rows once nothing is held
    and the engine is up (a killed one restarted), or after ``within_s`` (a step's watchdog:
    time for a step in flight to end) if not."""
    deadline = trio.current_time() + within_s
    while True:
        stats, health = await client.observe()
        engine_rows = getattr(inner, "num_rows", 0)
        quiet = not held_at_rest(stats, engine_rows) and stats.lane_mode == "idle"
        quiet = quiet and stats.engine.is_up
        if quiet or trio.current_time() >= deadline:
            return stats, health, engine_rows
        await trio.sleep(min(0.05, within_s / 20))


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


def scripted_reference(plan: RequestPlan) -> Expected:
    """The tokens and text the scripted engine gives a request with no fault."""
    from ...actors.testing.scripted import expected_tokens, token_text

    tokens = expected_tokens(tuple(ord(c) for c in plan.prompt), plan.max_tokens)
    return Expected(tokens, "".join(token_text(t) for t in tokens))


async def run_scripted(plan: FaultPlan, *, step_s: float = 0.01, http: bool = False) -> ChaosReport:
    """Run a plan on the scripted engine (in-process: use a MockClock for speed; over HTTP it
    runs in real time, as sockets need)."""
    from ...actors.testing.scripted import Script, ScriptedEngine

    engine = ScriptedEngine(Script(step_s=step_s))
    async with trio.open_nursery() as restarts:

        def crash() -> None:  # as a supervisor would: down now, a new engine a while later
            engine.go_down("injected: the engine crashed")
            restarts.start_soon(_come_back, engine, SCRIPTED_RESTART_STEPS * step_s)

        run = await run_plan(plan, engine, http=http, crash=crash)
    return ChaosReport(run, check(run, scripted_reference))


async def _come_back(engine: ScriptedEngine, after_s: float) -> None:
    await trio.sleep(after_s)
    engine.come_back()


async def run_on_model(
    plan: FaultPlan, model: str | None, *, device: Device = "auto", http: bool = False
) -> ChaosReport:
    """Run a plan on a real model (:func:`run_plans_on_model` with the one plan)."""
    (report,) = await run_plans_on_model([(plan, http)], model, device=device)
    return report


async def run_plans_on_model(
    runs: Sequence[tuple[FaultPlan, bool]], model: str | None, *, device: Device = "auto"
) -> list[ChaosReport]:
    """Run plans on a real model, one after another on one engine, each ``(plan, http)``:
    a fault-free pass (in-process) first gives the reference tokens and text; then each plan
    runs, in-process or over HTTP. The plans share their requests (one seed and count, other
    faults), so the one pass is every plan's reference. The step watchdog is at least
    ``MODEL_STEP_TIMEOUT_S``: a plan's 1 s suits the scripted engine's steps, while a real
    model's prefill on a busy 2-core machine can take longer."""
    from ...actors.engine_port.open import open_engine

    first = runs[0][0]
    if any(p.requests != first.requests or p.config != first.config for p, _ in runs):
        raise ValueError("plans run on one model must share their requests and config")
    watchdog = max(first.config.step_timeout_s, MODEL_STEP_TIMEOUT_S)
    config = replace(first.config, step_timeout_s=watchdog)
    # A crash kills the engine's process: the one engine that can die alone (a thread cannot).
    process = True if any(p.planned["engine_crash"] for p, _ in runs) else None
    options = EngineOptions(model=model, device=device, engine_process=process)
    async with open_engine(options, config) as engine:

        def crash() -> None:
            pid = engine.liveness().pid
            assert pid is not None, "engine_crash needs the engine in a process"
            logger.info("killing the engine process %d", pid)
            os.kill(pid, signal.SIGKILL)

        # Every request, burst included (a queue long enough that none is refused), no fault.
        calm = replace(
            first,
            engine_faults=(),
            client_faults=(),
            shutdown_at_s=None,
            config=replace(config, max_queued=len(first.requests)),
        )
        baseline = await run_plan(calm, engine)
        # Only what the fault-free pass completed is a reference: on a loaded machine its own
        # steps can outlast the watchdog, and a cut-short request's tokens are no reference.
        expected = {
            r.plan.number: Expected(r.tokens or [], r.text)
            for r in baseline.requests
            if r.outcome is not None and r.outcome.startswith("completed:")
        }
        if len(expected) < len(baseline.requests):
            logger.warning(
                "the fault-free pass completed %d of %d requests; the rest have no reference",
                len(expected),
                len(baseline.requests),
            )
        reports = []
        for plan, http in runs:
            plan = replace(plan, config=config)
            run = await run_plan(plan, engine, http=http, crash=crash)
            reports.append(ChaosReport(run, check(run, lambda p: expected.get(p.number))))
    return reports
