"""The fault-injection harness: randomized workloads with injected faults, checked against the
runtime's invariants.

A :class:`FaultPlan` (reproducible from a seed) says what each request does and which faults
hit the engine; :func:`run_plan` drives it over a ``FaultyEngine`` (``actors/testing/faulty.py``)
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

The modules, in the order they depend on each other: ``plan`` (the fault kinds, the plan and
its generation), ``results`` (what a request's client and a whole run saw), ``client`` (the
:class:`Client` protocol, the in-process client), ``http_client`` (the real server and httpx
clients), ``invariants`` (one function each, and :func:`check`), ``report`` (:class:`ChaosReport`
and its tables), ``run`` (running a plan, the fault timing, the hang probe, :func:`run_scripted`
and :func:`run_on_model`). This package re-exports their public names.
"""

from .client import Client, InProcessClient
from .http_client import HttpClient
from .invariants import Check, Expected, allowed_outcomes, check
from .plan import (
    CLIENT_KINDS,
    ENGINE_KINDS,
    FAULT_KINDS,
    RUN_KINDS,
    ClientFault,
    FaultPlan,
    RequestPlan,
    TimedFault,
)
from .report import ChaosReport
from .results import HealthProbe, RequestResult, RunResult
from .run import run_on_model, run_plan, run_plans_on_model, run_scripted, scripted_reference

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
    "run_plans_on_model",
    "run_scripted",
    "scripted_reference",
]
