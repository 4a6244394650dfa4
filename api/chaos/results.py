"""What a chaos run saw: per request what its client saw (:class:`RequestResult`), the health
probe's answer after the first hang (:class:`HealthProbe`), and the whole run
(:class:`RunResult`), which the invariants and the report read."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from ...actors.config import RuntimeStatistics
from .plan import FaultPlan, RequestPlan


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
