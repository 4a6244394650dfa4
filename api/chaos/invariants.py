"""The invariants of a chaos run, one function each, and :func:`check`, which runs them all:
what each fault lets a request's outcome be, exactly one outcome each, refusals only past the
bound, nothing held at quiescence, untouched requests as in a fault-free run, a stuck step
seen as unhealthy, counters that agree, every planned fault kind injected."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

from ...actors.config import RuntimeStatistics
from .plan import RequestPlan
from .results import RequestResult, RunResult


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
    "engine_crash": {"failed:engine_fault"},
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


def check(run: RunResult, reference: Callable[[RequestPlan], Expected | None]) -> list[Check]:
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
    """Every planned kind was injected, but a client fault whose chain of carriers a fault of
    the run cut: a fault moves on to the next request until one acts it out (``TimedFault``: a
    refused request, or one that ends first, passes it on), so on a slow machine the planned
    shutdown, an engine crash that fails every row and refuses what comes while it restarts,
    or a step fault that fails the last carrier before it reached its events, can leave no
    request to act it out."""
    planned, injected = run.plan.planned, run.injected
    missing = sorted(kind for kind in planned if not injected[kind])
    uncarried = [kind for kind in missing if _no_request_could_carry(run, kind)]
    missing = [kind for kind in missing if kind not in uncarried]
    detail = f"never injected: {', '.join(missing)}" if missing else f"{len(planned)} kinds"
    if uncarried:
        detail += f"; another fault ended every carrier of {', '.join(uncarried)}"
    return Check("every planned fault kind injected", not missing, detail)


def _no_request_could_carry(run: RunResult, kind: str) -> bool:
    """Whether another fault cut the client fault ``kind``'s chain of carriers: the last
    request that carried it (if any did) was refused or cancelled by the shutdown, refused or
    failed by a crash, or ended by an engine fault that touched it."""
    if kind not in {f.kind for f in run.plan.client_faults}:
        return False
    shutdown = run.plan.shutdown_at_s is not None
    crashed = bool(run.injected["engine_crash"])
    carriers = [r for r in run.requests if r.plan.client is not None and r.plan.client.kind == kind]
    if not carriers:
        return shutdown or crashed
    last = max(carriers, key=lambda r: r.plan.start_s)
    by_shutdown = last.refused is not None or last.outcome == "cancelled:shutdown"
    by_crash = last.refused == "engine_unavailable" or last.outcome == "failed:engine_fault"
    touched = run.touched.get(last.plan.number, set())
    by_engine_fault = any(last.outcome in ENGINE_OUTCOME[k] for k in touched if k != "step_slow")
    return (shutdown and by_shutdown) or (crashed and by_crash) or by_engine_fault


def _refusals_only_past_the_bound(run: RunResult) -> Check:
    shutdown = run.plan.shutdown_at_s is not None
    crashed = bool(run.injected["engine_crash"])  # refused while the engine restarted
    stray = [
        r.plan.number
        for r in run.requests
        if (r.refused == "overloaded" and not r.refused_when_full)
        or (r.refused == "shutting_down" and not shutdown)
        or (r.refused == "engine_unavailable" and not crashed)
    ]
    burst = [r for r in run.requests if r.plan.in_burst]
    # A burst past the bound meets a full gate, unless the shutdown closed admission first
    # (over HTTP a burst takes a while to arrive, so the shutdown may come in the middle of it)
    # or it arrived while a crashed engine restarted.
    bound_held = not burst or any(
        r.refused in ("overloaded", "shutting_down", "engine_unavailable") for r in burst
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


def held_at_rest(stats: RuntimeStatistics, engine_rows: int) -> dict[str, int]:
    """What the runtime still holds (nothing, once every request has ended and let go)."""
    leftovers = {
        "live": stats.live_sessions,
        "queued": stats.queued_sessions,
        "active rows": stats.active_rows,
        "parked rows": stats.parked_rows,
        "pending rows": stats.pending_rows,
        "kv bytes": stats.kv_bytes,
        "engine rows": engine_rows,
    }
    return {k: v for k, v in leftovers.items() if v}


def _quiescent(run: RunResult) -> Check:
    s = run.statistics
    held = held_at_rest(s, run.engine_rows)
    return Check(
        "quiescent: nothing held",
        not held and s.lane_mode == "idle",
        f"{held} lane={s.lane_mode}" if held or s.lane_mode != "idle" else "",
    )


def _untouched_match(run: RunResult, reference: Callable[[RequestPlan], Expected | None]) -> Check:
    """Untouched requests that completed give the reference's tokens (None: the reference has
    none for that request, as when the fault-free pass did not complete it either)."""
    untouched = [
        r
        for r in _admitted(run)
        if r.plan.number not in run.touched
        and not r.plan.sampled
        and (r.plan.client is None or r.plan.client.kind == "slow_reader")
        and r.outcome is not None
        and r.outcome.startswith("completed:")
    ]
    diverged, unknown = [], 0
    for r in untouched:
        expected = reference(r.plan)
        if expected is None:
            unknown += 1
            continue
        same = r.tokens == expected.tokens if r.tokens is not None else r.text == expected.text
        if not same:
            diverged.append(r.plan.number)
    detail = f"{len(untouched) - unknown} compared"
    detail += f", {unknown} without a reference" if unknown else ""
    detail += f", diverged {diverged[:5]}" if diverged else ""
    return Check("untouched requests match a fault-free run", not diverged, detail)


def _stuck_step_unhealthy(run: RunResult) -> Check:
    """After a hang: unhealthy during the run (over HTTP /health says 503), and still at the
    end, with one stuck step counted for each hang; unless a crash restarted the engine since:
    a new engine is a healthy one."""
    s, probe, hangs = run.statistics, run.hang_probe, run.injections["step_hang"]
    seen_unhealthy = (
        probe is not None and not probe.is_healthy and probe.health_status in (None, 503)
    )
    restarted = run.injections["engine_crash"] > 0 and s.engine.restarts > 0
    unhealthy_at_end = not s.is_healthy and run.health_status in (None, 503)
    hung_ok = (not hangs) or (
        seen_unhealthy and s.stuck_steps == hangs and (unhealthy_at_end or restarted)
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
    failing = ("step_error", "prefill_error", "kv_exhausted", "add_error", "engine_crash")
    step_faults = sum(run.injections[k] for k in failing)
    if step_faults != s.engine_faults:
        mismatches.append(f"engine_faults stats={s.engine_faults} injected={step_faults}")
    return Check(
        "counters agree with outcomes and injections", not mismatches, "; ".join(mismatches)
    )
