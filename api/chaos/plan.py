"""The plan of a chaos run: which requests arrive when, what each one's client does, and which
engine faults are due when, all drawn from one ``random.Random(seed)`` by
:meth:`FaultPlan.generate`. Also the fault kinds, as the CLI lists them."""

from __future__ import annotations

import random
from collections import Counter
from dataclasses import dataclass, field, replace
from typing import Literal

from ...actors.config import RuntimeConfig
from ...actors.testing.faulty import StepFaultKind

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
    "engine_crash",
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
