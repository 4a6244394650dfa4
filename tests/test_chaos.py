"""The fault-injection harness, over many seeds for every fault kind, on the scripted engine
under MockClock; over HTTP (real clients, the real server, real time) for a few seeds; plus
Hypothesis-generated operation scripts checked against the invariants."""

from __future__ import annotations

import logging
import multiprocessing
import subprocess
import sys
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ProcessPoolExecutor
from dataclasses import dataclass, replace
from functools import partial
from typing import Any

import pytest
import trio
import trio.testing
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mlx_trio.actors.messages import Completed, GenerationRequest
from mlx_trio.actors.testing.faulty import FaultyEngine, StepFault
from mlx_trio.actors.testing.scripted import Script, ScriptedEngine
from mlx_trio.api import cli
from mlx_trio.api.chaos import (
    CLIENT_KINDS,
    FAULT_KINDS,
    ChaosReport,
    ClientFault,
    FaultPlan,
    RequestPlan,
    TimedFault,
    run_on_model,
    run_plan,
    run_plans_on_model,
    run_scripted,
    scripted_reference,
)
from mlx_trio.api.chaos import check as check_invariants
from mlx_trio.api.inprocess import open_runtime
from mlx_trio.engine.errors import OverloadedError, RuntimeClosedError
from mlx_trio.engine.params import SamplingParams


def run_virtual(plan: FaultPlan):
    return trio.run(run_scripted, plan, clock=trio.testing.MockClock(autojump_threshold=0))


@pytest.mark.parametrize("kind", FAULT_KINDS)
@pytest.mark.parametrize("seed", range(4))
def test_every_fault_kind_keeps_every_invariant(kind, seed):
    report = run_virtual(FaultPlan.generate(seed, 80, (kind,)))
    assert report.ok, report.table()


@pytest.mark.parametrize("seed", range(6))
def test_all_fault_kinds_at_once_keep_every_invariant(seed):
    report = run_virtual(FaultPlan.generate(100 + seed, 300, FAULT_KINDS))
    assert report.ok, report.table()
    assert report.run.injections, "the plan injected nothing"


STEP_KINDS = ("step_error", "prefill_error", "step_hang", "step_slow", "kv_exhausted")


@pytest.mark.parametrize("seed", range(3))
def test_every_planned_fault_is_injected_and_the_table_shows_planned_against_injected(seed):
    # At 2,000 requests the step faults used to be planned by step number, up to five times
    # as many steps as the run makes: most of them never came.
    report = run_virtual(FaultPlan.generate(seed, 2000, FAULT_KINDS))
    planned, injected = report.run.plan.planned, report.run.injected
    assert report.ok, report.table()
    assert set(planned) == set(FAULT_KINDS) | {"add_error"}
    assert all(injected[kind] >= 1 for kind in planned), report.table()
    assert {kind: injected[kind] for kind in STEP_KINDS} == {k: planned[k] for k in STEP_KINDS}
    table = report.table()
    assert "| fault | planned | injected |" in table
    for kind in planned:
        assert f"| {kind} | {planned[kind]} | {injected[kind]} |" in table
    assert "| every planned fault kind injected | yes | 16 kinds |" in table


def test_a_fault_that_cannot_be_injected_fails_the_run():
    # Every request in the serial lane: no batch step for kv_exhausted, no batch row to refuse.
    plan = FaultPlan.generate(3, 40, ("kv_exhausted", "sampler_error"))
    plan = replace(plan, requests=tuple(replace(r, reproducible=True) for r in plan.requests))
    report = run_virtual(plan)
    assert [c.name for c in report.checks if not c.ok] == ["every planned fault kind injected"]
    assert report.run.injected["sampler_error"] == 1  # the serial lane samples too
    table = report.table()
    assert "| kv_exhausted | 1 | 0 |" in table and "| add_error | 1 | 0 |" in table
    assert (
        "| every planned fault kind injected | NO | never injected: add_error, kv_exhausted |"
        in table
    )


class LeakyEngine(ScriptedEngine):
    """A broken engine whose removed rows stop but are never freed: the harness must notice."""

    async def batch_remove(self, rows: list[int]) -> None:
        for row in rows:
            await self.batch_park(row)


def test_the_harness_catches_a_leak():
    plan = FaultPlan.generate(3, 80, ("consumer_close", "cancel"))

    async def run():
        result = await run_plan(plan, LeakyEngine(Script()))
        return check_invariants(result, scripted_reference)

    checks = trio.run(run, clock=trio.testing.MockClock(autojump_threshold=0))
    quiescence = next(c for c in checks if c.name.startswith("quiescent"))
    assert not quiescence.ok
    assert "engine rows" in quiescence.detail and "kv bytes" in quiescence.detail


def chaos_command(*argv: str) -> subprocess.CompletedProcess[str]:
    """Run ``mlx-trio chaos ARGV`` as a user would; its exit status must be 0."""
    command = [sys.executable, "-m", "mlx_trio.api.cli", "chaos", *argv]
    result = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    return result


def test_chaos_command_prints_the_table_and_exits_0():
    result = chaos_command("--seed", "5", "--requests", "60")
    assert "| exactly one outcome each | yes |" in result.stdout
    assert "| step_error |" in result.stdout


# -- over HTTP ----------------------------------------------------------------------------

ENGINE_FAULTS = ("step_error", "prefill_error", "sampler_error", "step_hang", "kv_exhausted")


def run_http(plan: FaultPlan) -> ChaosReport:
    return trio.run(partial(run_scripted, plan, http=True))


def client_faults_plan(seed: int) -> FaultPlan:
    return FaultPlan.generate(seed, 40, CLIENT_KINDS)


# The scripted engine's runs over HTTP, by the test that checks each. They run in real time and
# mostly wait (a hang lasts 15 watchdog periods; requests arrive over seconds): a few percent
# of a core each, so they run side by side, each in a process of its own with its own server,
# and take about as long together as the longest alone.
HTTP_RUNS: dict[tuple[str, Any], Callable[[], Any]] = {
    **{
        ("test_every_client_fault_over_http_keeps_every_invariant", seed): partial(
            run_http, client_faults_plan(seed)
        )
        for seed in (0, 1)
    },
    **{
        ("test_engine_faults_over_http_keep_every_invariant", seed): partial(
            run_http, FaultPlan.generate(seed, 40, ENGINE_FAULTS)
        )
        for seed in (0, 1)
    },
    ("test_shutdown_and_a_burst_over_http_keep_every_invariant", None): partial(
        run_http, FaultPlan.generate(4, 40, ("shutdown", "burst", "disconnect", "cancel"))
    ),
    ("test_chaos_command_over_http_prints_the_table_and_exits_0", None): partial(
        chaos_command, "--http", "--requests", "60", "--seed", "3"
    ),
}


@pytest.fixture(scope="module")
def over_http(request: pytest.FixtureRequest) -> dict[tuple[str, Any], Future]:
    """The HTTP runs of this module's selected tests, run side by side; each test takes its
    own run's result (or its exception). All of them have ended when this returns, so none
    runs beside a later test."""
    return run_side_by_side(request, HTTP_RUNS)


def run_side_by_side(
    request: pytest.FixtureRequest, runs: dict[tuple[str, Any], Callable[[], Any]]
) -> dict[tuple[str, Any], Future]:
    """Run those of ``runs`` whose test (the key's first item) is selected, each in a process
    of its own (spawned: an interpreter to itself, as when the tests ran one after another);
    return their futures once every one has ended."""
    selected = {
        item.originalname for item in request.session.items if item.module is request.module
    }
    chosen = {key: run for key, run in runs.items() if key[0] in selected}
    spawn = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(max(1, len(chosen)), spawn, max_tasks_per_child=1) as pool:
        futures = {key: pool.submit(run) for key, run in chosen.items()}
    return futures


@pytest.mark.slow
@pytest.mark.parametrize("seed", [0, 1])
def test_every_client_fault_over_http_keeps_every_invariant(seed, over_http):
    plan = client_faults_plan(seed)
    assert set(plan.planned) == set(CLIENT_KINDS)
    report = over_http["test_every_client_fault_over_http_keeps_every_invariant", seed].result()
    assert report.run.plan == plan
    assert report.ok, report.table()
    hung_up = [r for r in report.run.requests if r.unseen]
    assert hung_up, "the clients that hung up never learn their outcome"
    kinds = {r.plan.client.kind for r in hung_up if r.plan.client}
    assert kinds <= {"consumer_close", "disconnect"}
    assert report.run.health_status == 200
    assert "over HTTP" in report.table()


@pytest.mark.slow
@pytest.mark.parametrize("seed", [0, 1])
def test_engine_faults_over_http_keep_every_invariant(seed, over_http):
    report = over_http["test_engine_faults_over_http_keep_every_invariant", seed].result()
    assert report.ok, report.table()
    assert report.run.injected == report.run.plan.planned, report.table()
    # The hang was injected, and /health said 503 while the run went on.
    probe = report.run.hang_probe
    assert probe is not None and probe.stuck_steps == 1 and probe.health_status == 503
    assert report.run.health_status == 503


@pytest.mark.slow
def test_shutdown_and_a_burst_over_http_keep_every_invariant(over_http):
    report = over_http["test_shutdown_and_a_burst_over_http_keep_every_invariant", None].result()
    assert report.ok, report.table()
    assert any(r.refused for r in report.run.requests), "the burst or the shutdown refused none"
    assert report.run.health_status == 503  # shut down


@pytest.mark.slow
def test_the_http_harness_catches_a_leak():
    # Alone, not with the runs above: the leak shows only if a close or a cancel reaches a row
    # before its last token, a race that a busier interpreter loses.
    plan = FaultPlan.generate(3, 40, ("consumer_close", "cancel"))

    async def run():
        result = await run_plan(plan, LeakyEngine(Script()), http=True)
        return check_invariants(result, scripted_reference)

    checks = trio.run(run)
    quiescence = next(c for c in checks if c.name.startswith("quiescent"))
    assert not quiescence.ok
    assert "engine rows" in quiescence.detail and "kv bytes" in quiescence.detail


@pytest.fixture
def restore_logging() -> Iterator[None]:
    """``cli.main`` configures logging and quiets some loggers; put it back for other tests."""
    root = logging.getLogger()
    handlers, root_level = list(root.handlers), root.level
    names = ("mlx_trio.actors", "mlx_trio.http", "mlx_trio.server", "hypercorn", "httpx")
    levels = {name: logging.getLogger(name).level for name in names}
    yield
    root.handlers[:] = handlers
    root.setLevel(root_level)
    for name, level in levels.items():
        logging.getLogger(name).setLevel(level)


@pytest.mark.slow
def test_a_broken_invariant_over_http_exits_1(monkeypatch, capsys, restore_logging):
    monkeypatch.setattr("mlx_trio.actors.testing.scripted.ScriptedEngine", LeakyEngine)
    argv = ["chaos", "--http", "--seed", "3", "--requests", "40", "--faults", "consumer_close"]
    assert cli.main(argv) == 1
    assert "| quiescent: nothing held | NO |" in capsys.readouterr().out


@pytest.mark.slow
def test_chaos_command_over_http_prints_the_table_and_exits_0(over_http):
    result = over_http["test_chaos_command_over_http_prints_the_table_and_exits_0", None].result()
    assert "requests, over HTTP" in result.stdout
    assert "| exactly one outcome each | yes |" in result.stdout
    assert "| unseen (client hung up) |" in result.stdout


# -- Hypothesis: operation scripts ---------------------------------------------------------


@dataclass(frozen=True)
class Submit:
    prompt: str
    max_tokens: int
    reproducible: bool


@dataclass(frozen=True)
class Cancel:
    which: int


@dataclass(frozen=True)
class Stall:
    which: int


@dataclass(frozen=True)
class Resume:
    which: int


@dataclass(frozen=True)
class FailStep:
    pass


@dataclass(frozen=True)
class Advance:
    seconds: float


@dataclass(frozen=True)
class Shutdown:
    pass


operations = st.lists(
    st.one_of(
        st.builds(
            Submit,
            st.text("abcdefgh", min_size=1, max_size=12),
            st.integers(1, 12),
            st.booleans(),
        ),
        st.builds(Cancel, st.integers(0, 20)),
        st.builds(Stall, st.integers(0, 20)),
        st.builds(Resume, st.integers(0, 20)),
        st.just(FailStep()),
        st.builds(Advance, st.sampled_from([0.0, 0.005, 0.02, 0.1, 3.0])),
        st.just(Shutdown()),
    ),
    max_size=30,
)


async def run_script(ops: list) -> None:
    inner = ScriptedEngine(Script(step_s=0.01))
    engine = FaultyEngine(inner)
    handles, outcomes, stalls = [], {}, {}
    async with open_runtime(
        engine=engine,
        max_batch=3,
        max_live=4,
        max_queued=4,
        event_buffer=2,
        idle_timeout_s=1.0,
        shutdown_grace_s=0.2,
    ) as rt:
        async with trio.open_nursery() as readers:

            async def read(i, handle) -> None:
                async with handle:
                    async for _ in handle:
                        await stalls[i].wait()  # a Stall swaps in an unset event
                outcomes[i] = await handle.result()

            for op in ops:
                match op:
                    case Submit(prompt, max_tokens, reproducible):
                        request = GenerationRequest(
                            prompt,
                            SamplingParams(temperature=0, max_tokens=max_tokens),
                            reproducible=reproducible,
                        )
                        try:
                            handle = await rt.submit(request)
                        except (OverloadedError, RuntimeClosedError):
                            continue
                        stalls[len(handles)] = trio.Event()
                        stalls[len(handles)].set()
                        readers.start_soon(read, len(handles), handle)
                        handles.append((request, handle))
                    case Cancel(which) if which < len(handles):
                        handles[which][1].cancel_nowait()
                    case Stall(which) if which < len(handles) and stalls[which].is_set():
                        stalls[which] = trio.Event()
                    case Resume(which) if which in stalls:
                        stalls[which].set()
                    case FailStep():
                        engine.inject(StepFault("step_error", engine.num_batch_steps + 1))
                    case Advance(seconds):
                        await trio.sleep(seconds)
                    case Shutdown():
                        await rt.shutdown(grace_s=0.2)
            for gate in stalls.values():
                gate.set()
        await trio.sleep(2.0)
        stats = rt.statistics()
    assert len(outcomes) == len(handles), "every admitted request has exactly one outcome"
    assert (stats.live_sessions, stats.queued_sessions, stats.active_rows) == (0, 0, 0)
    assert (stats.parked_rows, stats.pending_rows, stats.kv_bytes) == (0, 0, 0)
    assert inner.num_rows == 0 and not inner.serial_active
    assert stats.completed == sum(isinstance(o, Completed) for o in outcomes.values())
    for i, (request, _) in enumerate(handles):
        outcome = outcomes[i]
        if isinstance(outcome, Completed):
            assert outcome.usage.completion_tokens == request.params.max_tokens


async def run_script_within(ops: list, seconds: float) -> None:
    with trio.fail_after(seconds):
        await run_script(ops)


def test_a_lease_granted_as_its_serial_request_is_cancelled_goes_back():
    # Found by the operation scripts: the lease a serial request received in the instant it
    # was cancelled was dropped (the reply channel's async close raised Cancelled), so the
    # engine stayed leased and the batch request behind it never ran. Trio shuffles the
    # order of runnable tasks, so the race is run many times (it hung a third of them).
    ops = [Submit("a", 1, True), Submit("a", 1, False), Cancel(0)]
    for _ in range(60):
        clock = trio.testing.MockClock(autojump_threshold=0)
        trio.run(run_script_within, ops, 60.0, clock=clock)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(operations)
def test_operation_scripts_keep_the_invariants(ops):
    trio.run(run_script, ops, clock=trio.testing.MockClock(autojump_threshold=0))


@pytest.mark.e2e
def test_short_chaos_runs_on_the_default_model_in_process_and_over_http():
    """One fault-free pass, then two plans of the same requests: in-process (a failing sampler
    among the faults) and over HTTP, where the streamed text of untouched requests equals the
    fault-free pass's."""
    in_process = FaultPlan.generate(
        11, 12, ("step_error", "sampler_error", "consumer_close", "cancel"), step_s=0.1
    )
    over_http = FaultPlan.generate(11, 12, ("step_error", "consumer_close", "cancel"), step_s=0.1)
    report, http_report = trio.run(
        run_plans_on_model, [(in_process, False), (over_http, True)], None
    )
    assert report.ok, report.table()
    assert http_report.ok, http_report.table()
    assert "over HTTP" in http_report.table()
    # Sampled requests ran beside the failing sampler: shared sampling state survived it. (Not
    # those whose client acts, a cancel or a close: whether that lands before the request ends
    # is a race, and either outcome is right.)
    run = report.run
    sampled = [
        r
        for r in run.requests
        if r.plan.sampled
        and r.refused is None
        and r.plan.number not in run.touched
        and r.plan.client is None
    ]
    unfinished = [
        (r.plan.number, r.plan.client, r.outcome)
        for r in sampled
        if not (r.outcome or "").startswith("completed:")
    ]
    assert sampled and not unfinished, unfinished


@pytest.mark.e2e
def test_a_chaos_run_that_kills_the_engine_process_on_the_default_model():
    """SIGKILL of the engine process under load: its rows fail, requests sent while it restarts
    are refused engine_unavailable, the rest match the fault-free pass, nothing is held."""
    plan = FaultPlan.generate(1, 20, ("engine_crash", "step_error", "cancel"), step_s=0.1)
    report = trio.run(run_on_model, plan, None)
    assert report.ok, report.table()
    assert report.run.injected["engine_crash"] == 1
    assert report.run.statistics.engine.restarts == 1 and report.run.statistics.is_healthy


def test_a_client_fault_whose_carriers_the_shutdown_refused_is_not_a_broken_invariant():
    """A planned cancel is due after the planned shutdown: every request that could carry it
    is refused, so it is never injected; that is the plan's own timing, not a lost fault (a
    slow machine's HTTP run met it so). Without the shutdown the same fault must be injected."""
    requests = tuple(RequestPlan(number=i, start_s=0.5 + 0.01 * i, max_tokens=8) for i in range(4))
    cut = FaultPlan(
        seed=0,
        requests=requests,
        shutdown_at_s=0.1,
        client_faults=(ClientFault("cancel", after_events=1, at_s=0.4),),
    )
    report = run_virtual(cut)
    assert report.ok, report.table()
    assert not report.run.injected["cancel"]
    assert all(r.refused == "shutting_down" for r in report.run.requests)
    whole = run_virtual(replace(cut, shutdown_at_s=None))
    assert whole.ok and whole.run.injected["cancel"] == 1, whole.table()


def test_a_client_fault_whose_last_carrier_a_step_fault_failed_is_not_a_broken_invariant():
    """A step error fails the only carrier of a consumer close before it reached its events, so
    no request is left to act the close out (an HTTP run on CI met it so). Without the step
    error the same close must be injected."""
    request = RequestPlan(number=0, start_s=0.5, max_tokens=8)
    cut = FaultPlan(
        seed=0,
        requests=(request,),
        engine_faults=(TimedFault("step_error", at_s=0.5),),
        client_faults=(ClientFault("consumer_close", after_events=5, at_s=0.4),),
    )
    report = run_virtual(cut)
    assert report.ok, report.table()
    assert not report.run.injected["consumer_close"]
    assert report.run.requests[0].outcome == "failed:engine_fault"
    assert "another fault ended every carrier of consumer_close" in report.table()
    whole = run_virtual(replace(cut, engine_faults=()))
    assert whole.ok and whole.run.injected["consumer_close"] == 1, whole.table()
