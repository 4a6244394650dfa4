"""The fault-injection harness, over many seeds for every fault kind, on the scripted engine
under MockClock; plus Hypothesis-generated operation scripts checked against the invariants."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import dataclass

import pytest
import trio
import trio.testing
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mlx_trio.actors.faulty import FaultyEngine, StepFault
from mlx_trio.actors.messages import Completed, GenerationRequest
from mlx_trio.actors.scripted import Script, ScriptedEngine
from mlx_trio.api.chaos import (
    FAULT_KINDS,
    FaultPlan,
    run_on_model,
    run_plan,
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


def test_chaos_command_prints_the_table_and_exits_0():
    result = subprocess.run(
        [sys.executable, "-m", "mlx_trio.api.cli", "chaos", "--seed", "5", "--requests", "60"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "| exactly one outcome each | yes |" in result.stdout
    assert "| step_error |" in result.stdout


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
                        await rt.runtime.shutdown(grace_s=0.2)
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


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(operations)
def test_operation_scripts_keep_the_invariants(ops):
    trio.run(run_script, ops, clock=trio.testing.MockClock(autojump_threshold=0))


@pytest.mark.e2e
def test_a_short_chaos_run_on_the_default_model():
    plan = FaultPlan.generate(
        11, 12, ("step_error", "sampler_error", "consumer_close", "cancel"), step_s=0.1
    )
    report = trio.run(run_on_model, plan, None)
    assert report.ok, report.table()
