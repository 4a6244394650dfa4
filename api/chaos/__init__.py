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
import logging
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, replace

import trio

from mlx_trio.actors.batch_group import MAX_STEPS_PER_CALL
from mlx_trio.actors.faulty import FaultyEngine, RowFault, StepFault
from mlx_trio.actors.port import EnginePort
from mlx_trio.actors.runtime import RuntimeConfig
from mlx_trio.api.chaos.client import Client, InProcessClient, open_in_process
from mlx_trio.api.chaos.http_client import HttpClient, open_over_http
from mlx_trio.api.chaos.plan import (
    CLIENT_KINDS,
    ENGINE_KINDS,
    FAULT_KINDS,
    ROW_FAULT_KINDS,
    RUN_KINDS,
    ClientFault,
    FaultPlan,
    RequestPlan,
    TimedFault,
)
from mlx_trio.api.chaos.results import HealthProbe, RequestResult, RunResult

__all__ = [
    "CLIENT_KINDS",
    "ENGINE_KINDS",
    "FAULT_KINDS",
    "RUN_KINDS",
    "ChaosReport",
    "Check",
    "Client",
    "ClientFault",
    "Expected",
    "FaultPlan",
    "HealthProbe",
    "HttpClient",
    "InProcessClient",
    "RequestPlan",
    "RequestResult",
    "RunResult",
    "TimedFault",
    "allowed_outcomes",
    "check",
    "run_on_model",
    "run_plan",
    "run_scripted",
    "scripted_reference",
]

logger = logging.getLogger(__name__)


# -- running a plan -----------------------------------------------------------------------


async def run_plan(plan: FaultPlan, inner: EnginePort, *, http: bool = False) -> RunResult:
    """Drive ``plan`` on ``inner`` wrapped with the plan's faults: through the in-process API,
    or (``http``) through real HTTP clients against the real server, in real time."""
    engine = FaultyEngine(inner)
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
    from mlx_trio.engine.thread import EngineThread
    from mlx_trio.engine.threaded import ThreadedEngine

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
