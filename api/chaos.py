"""The fault-injection harness: randomized workloads with injected faults, checked against the
runtime's invariants.

A :class:`FaultPlan` (reproducible from a seed) says what each request does and which faults
hit the engine; :func:`run_plan` drives it through the in-process API over a
:class:`~mlx_trio.actors.faulty.FaultyEngine`, and :func:`check` compares what happened with
what the plan implies:

- every request ends in exactly one outcome, of a kind its faults allow;
- at quiescence: no rows, no permits, no queued sessions, KV bytes back to zero;
- requests no fault touched produce exactly the tokens of a fault-free run;
- a stuck step leaves the runtime unhealthy and its sessions cancelled ``engine_fault``;
- the runtime's counters agree with the outcomes and with what was injected.
"""

from __future__ import annotations

import logging
import random
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Literal

import trio

from mlx_trio.actors.faulty import EngineFault, FaultyEngine, RowFault, StepFault
from mlx_trio.actors.messages import (
    Cancelled,
    Completed,
    Failed,
    GenerationRequest,
    Outcome,
    TextDelta,
    describe,
)
from mlx_trio.actors.port import EnginePort
from mlx_trio.actors.runtime import RuntimeConfig, RuntimeStatistics
from mlx_trio.api.inprocess import open_runtime
from mlx_trio.engine.errors import OverloadedError, RuntimeClosedError
from mlx_trio.engine.params import SamplingParams

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


@dataclass(frozen=True, slots=True)
class ClientFault:
    """What a request's client does: stop reading, read slowly, close its end, disconnect,
    cancel, or set a deadline it cannot meet, after ``after_events`` events."""

    kind: ClientFaultKind
    after_events: int = 0
    delay_s: float = 0.0


@dataclass(frozen=True, slots=True)
class RequestPlan:
    number: int
    start_s: float
    max_tokens: int
    reproducible: bool = False
    client: ClientFault | None = None
    in_burst: bool = False

    @property
    def prompt(self) -> str:
        return f"[req {self.number}] tell me something about the number {self.number}"


@dataclass(frozen=True, slots=True)
class FaultPlan:
    seed: int
    requests: tuple[RequestPlan, ...]
    engine_faults: tuple[EngineFault, ...] = ()
    shutdown_at_s: float | None = None
    config: RuntimeConfig = field(default_factory=RuntimeConfig)

    @property
    def planned(self) -> Counter[str]:
        counts: Counter[str] = Counter()
        counts.update(f.kind for f in self.engine_faults)
        counts.update(r.client.kind for r in self.requests if r.client)
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
        requests = [
            RequestPlan(
                number=i,
                start_s=rng.uniform(0, span),
                max_tokens=rng.randint(4, 24),
                reproducible=rng.random() < 0.05,
            )
            for i in range(num_requests)
        ]
        per_kind = max(1, num_requests // 400)
        client_kinds = [k for k in kinds if k in CLIENT_KINDS]
        for kind in client_kinds:
            for i in rng.sample(range(num_requests), min(per_kind, num_requests)):
                if requests[i].client is None:
                    requests[i] = replace(requests[i], client=_client_fault(kind, rng, step_s))
        if "burst" in kinds:
            at = rng.uniform(0, span)
            burst = config.live_limit + config.max_queued + 8
            base = len(requests)
            requests += [
                RequestPlan(number=base + j, start_s=at, max_tokens=8, in_burst=True)
                for j in range(burst)
            ]
        faults: list[EngineFault] = []
        total_steps = int(span / step_s)
        for kind in (k for k in kinds if k in ENGINE_KINDS):
            for _ in range(per_kind):
                victim = rng.randrange(num_requests)
                match kind:
                    case "sampler_error":
                        faults.append(RowFault("sampler_error", victim, at_token=2))
                    case "prefill_error":
                        faults.append(StepFault("prefill_error", request=victim))
                    case "step_slow":
                        faults.append(
                            StepFault("step_slow", rng.randint(1, total_steps), slow_s=0.5)
                        )
                    case _:
                        faults.append(StepFault(kind, rng.randint(1, total_steps)))  # type: ignore[arg-type]
        if "kv_exhausted" in kinds:
            faults.append(RowFault("add_error", rng.randrange(num_requests)))
        shutdown = span * rng.uniform(0.9, 0.97) if "shutdown" in kinds else None
        return cls(
            seed, tuple(sorted(requests, key=lambda r: r.start_s)), tuple(faults), shutdown, config
        )


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
    plan: RequestPlan
    refused: str | None = None
    refused_when_full: bool = True
    outcome: Outcome | None = None
    outcomes_seen: int = 0
    tokens: list[int] = field(default_factory=list)


@dataclass
class RunResult:
    plan: FaultPlan
    requests: list[RequestResult]
    statistics: RuntimeStatistics
    injections: Counter[str]
    touched: dict[int, set[str]]
    engine_rows: int


async def run_plan(plan: FaultPlan, inner: EnginePort) -> RunResult:
    """Drive ``plan`` through the in-process API on ``inner`` wrapped with the plan's faults."""
    engine = FaultyEngine(inner, plan.engine_faults)
    results = {r.number: RequestResult(r) for r in plan.requests}
    async with open_runtime(engine=engine, config=plan.config) as rt:
        async with trio.open_nursery() as clients:
            for request in plan.requests:
                clients.start_soon(_drive, rt, request, results[request.number])
            if plan.shutdown_at_s is not None:
                await trio.sleep(plan.shutdown_at_s)
                await rt.runtime.shutdown()
        # Quiescence is checked while the runtime still runs: shutdown must not hide a leak.
        await trio.sleep(plan.config.step_timeout_s)
        stats = rt.statistics()
        engine_rows = getattr(inner, "num_rows", 0)
    touched: dict[int, set[str]] = {}
    for injection in engine.injections:
        for number in injection.requests:
            touched.setdefault(number, set()).add(injection.kind)
    injected = Counter(i.kind for i in engine.injections)
    return RunResult(plan, list(results.values()), stats, injected, touched, engine_rows)


async def _drive(rt, plan: RequestPlan, result: RequestResult) -> None:
    await trio.sleep(plan.start_s)
    client = plan.client
    timeout = client.delay_s if client and client.kind == "deadline" else None
    request = GenerationRequest(
        plan.prompt,
        SamplingParams(temperature=0, max_tokens=plan.max_tokens),
        reproducible=plan.reproducible,
        timeout_s=timeout,
        request_id=f"req-{plan.number}",
    )
    try:
        handle = await rt.submit(request)
    except (OverloadedError, RuntimeClosedError) as exc:
        result.refused = exc.code
        if isinstance(exc, OverloadedError):
            config = rt.runtime.config
            result.refused_when_full = (
                exc.live >= config.live_limit and exc.queued >= config.max_queued
            )
        return
    events = 0
    async with handle:
        async for event in handle:
            if isinstance(event, Completed | Cancelled | Failed):
                result.outcomes_seen += 1
                break
            events += 1
            if isinstance(event, TextDelta):
                result.tokens.extend(event.token_ids)
            if client is None or events <= client.after_events:
                continue
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
        result.outcome = await handle.result()


# -- the invariants -----------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Check:
    name: str
    ok: bool
    detail: str = ""


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


def check(run: RunResult, reference: Callable[[RequestPlan], list[int]]) -> list[Check]:
    """Every invariant, each with what it found."""
    checks: list[Check] = []
    shutdown = run.plan.shutdown_at_s is not None
    admitted = [r for r in run.requests if r.refused is None]

    stray = [
        r.plan.number
        for r in run.requests
        if (r.refused == "overloaded" and not r.refused_when_full)
        or (r.refused == "shutting_down" and not shutdown)
    ]
    burst = [r for r in run.requests if r.plan.in_burst]
    bound_held = (
        not burst
        or any(r.refused == "overloaded" for r in burst)
        or all(r.refused == "shutting_down" for r in burst)
    )
    checks.append(
        Check(
            "refusals only past the bound",
            not stray and bound_held,
            f"stray {stray[:5]}"
            if stray
            else f"{sum(bool(r.refused) for r in run.requests)} refused",
        )
    )

    missing = [r.plan.number for r in admitted if r.outcome is None]
    doubled = [r.plan.number for r in admitted if r.outcomes_seen > 1]
    checks.append(
        Check(
            "exactly one outcome each",
            not missing and not doubled,
            f"missing {missing[:5]} doubled {doubled[:5]}"
            if missing or doubled
            else f"{len(admitted)} admitted",
        )
    )

    wrong = []
    for r in admitted:
        if r.outcome is None:
            continue
        allowed = allowed_outcomes(r, run.touched.get(r.plan.number, set()), shutdown)
        if describe(r.outcome) not in allowed:
            wrong.append(f"req {r.plan.number}: {describe(r.outcome)} not in {sorted(allowed)}")
    checks.append(Check("outcome kinds match the faults", not wrong, "; ".join(wrong[:3])))

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
    checks.append(
        Check(
            "quiescent: nothing held",
            not held and s.lane_mode == "idle",
            f"{held} lane={s.lane_mode}" if held or s.lane_mode != "idle" else "",
        )
    )

    untouched = [
        r
        for r in admitted
        if r.plan.number not in run.touched
        and (r.plan.client is None or r.plan.client.kind == "slow_reader")
        and isinstance(r.outcome, Completed)
    ]
    diverged = [r.plan.number for r in untouched if r.tokens != reference(r.plan)]
    checks.append(
        Check(
            "untouched requests match a fault-free run",
            not diverged,
            f"{len(untouched)} compared" + (f", diverged {diverged[:5]}" if diverged else ""),
        )
    )

    hangs = run.injections["step_hang"]
    hung_ok = (not hangs) or (not s.is_healthy and s.stuck_steps == hangs)
    checks.append(
        Check(
            "a stuck step makes the runtime unhealthy",
            hung_ok,
            f"hangs={hangs} stuck_steps={s.stuck_steps} healthy={s.is_healthy}",
        )
    )

    outcomes = Counter(describe(r.outcome) for r in admitted if r.outcome is not None)
    mismatches = []
    if sum(v for k, v in outcomes.items() if k.startswith("completed")) != s.completed:
        mismatches.append(f"completed {s.completed}")
    for reason, n in s.cancelled.items():
        if outcomes[f"cancelled:{reason}"] != n:
            mismatches.append(
                f"cancelled:{reason} stats={n} seen={outcomes[f'cancelled:{reason}']}"
            )
    for code, n in s.failed.items():
        if outcomes[f"failed:{code}"] != n:
            mismatches.append(f"failed:{code} stats={n} seen={outcomes[f'failed:{code}']}")
    overloaded = sum(r.refused == "overloaded" for r in run.requests)
    if overloaded != s.refused:
        mismatches.append(f"refused stats={s.refused} seen={overloaded}")
    step_faults = sum(
        run.injections[k] for k in ("step_error", "prefill_error", "kv_exhausted", "add_error")
    )
    if step_faults != s.engine_faults:
        mismatches.append(f"engine_faults stats={s.engine_faults} injected={step_faults}")
    checks.append(
        Check("counters agree with outcomes and injections", not mismatches, "; ".join(mismatches))
    )
    return checks


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
            f"seed {plan.seed}: {len(plan.requests)} requests",
            "",
            "| fault | planned | injected |",
            "| --- | --- | --- |",
        ]
        injected = Counter(run.injections)
        injected.update(r.plan.client.kind for r in run.requests if r.plan.client)
        injected["burst"] = sum(r.plan.in_burst for r in run.requests)
        injected["shutdown"] = int(plan.shutdown_at_s is not None)
        for kind in sorted(set(plan.planned) | {k for k, v in injected.items() if v}):
            lines.append(f"| {kind} | {plan.planned[kind]} | {injected[kind]} |")
        outcomes = Counter(describe(r.outcome) for r in run.requests if r.outcome is not None)
        outcomes.update(f"refused:{r.refused}" for r in run.requests if r.refused)
        lines += ["", "| outcome | requests |", "| --- | --- |"]
        lines += [f"| {kind} | {n} |" for kind, n in sorted(outcomes.items())]
        lines += ["", "| invariant | holds | detail |", "| --- | --- | --- |"]
        lines += [f"| {c.name} | {'yes' if c.ok else 'NO'} | {c.detail} |" for c in self.checks]
        return "\n".join(lines)


def scripted_reference(plan: RequestPlan) -> list[int]:
    """The tokens the scripted engine gives a request with no fault."""
    from mlx_trio.actors.scripted import expected_tokens

    return expected_tokens(tuple(ord(c) for c in plan.prompt), plan.max_tokens)


async def run_scripted(plan: FaultPlan, *, step_s: float = 0.01) -> ChaosReport:
    """Run a plan on the scripted engine (use a MockClock for speed)."""
    from mlx_trio.actors.scripted import Script, ScriptedEngine

    run = await run_plan(plan, ScriptedEngine(Script(step_s=step_s)))
    return ChaosReport(run, check(run, scripted_reference))


async def run_on_model(plan: FaultPlan, model: str | None, *, device: str = "auto") -> ChaosReport:
    """Run a plan on a real model: a fault-free pass first gives the reference tokens."""
    from mlx_trio.engine.thread import EngineThread
    from mlx_trio.engine.threaded import ThreadedEngine

    with EngineThread() as thread:
        engine = await ThreadedEngine.load(
            thread, model, device=device, max_batch=plan.config.max_batch
        )
        calm = replace(
            plan,
            requests=tuple(replace(r, client=None) for r in plan.requests if not r.in_burst),
            engine_faults=(),
            shutdown_at_s=None,
        )
        baseline = await run_plan(calm, engine)
        tokens = {r.plan.number: r.tokens for r in baseline.requests if r.outcome is not None}
        run = await run_plan(plan, engine)
    return ChaosReport(run, check(run, lambda p: tokens.get(p.number, [])))
