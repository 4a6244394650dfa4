"""OpenBLAS's thread count, chosen call by call from the engine's own step times.

A simulated clock and simulated steps: one thread or two is faster depending on whether the
machine is busy, as measured on 2 cores (design/017), and the chooser must follow.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest

from mlx_trio.engine import _blas
from mlx_trio.engine.threads import PROBE_SHARE, ThreadChooser, shape

QUIET = {1: 0.150, 2: 0.105}  # seconds a step of 8 rows, nothing else running
BUSY = {1: 0.300, 2: 2.400}  # the same while other processes take the cores


class Machine:
    """Steps that take the time the current thread count and the machine's load say."""

    def __init__(self) -> None:
        self.now = 0.0
        self.threads = 1
        self.switches: list[int] = []
        self.step_s = QUIET

    def set_threads(self, count: int) -> None:
        self.threads = count
        self.switches.append(count)

    def chooser(self) -> ThreadChooser:
        return ThreadChooser((1, 2), self.set_threads, clock=lambda: self.now)

    def run(self, chooser: ThreadChooser, calls: int, rows: int = 8, kind: str = "decode") -> list:
        """``calls`` calls of one shape; the thread count of each."""
        counts = []
        for _ in range(calls):
            chooser.begin(shape(kind, rows))
            counts.append(self.threads)
            self.now += self.step_s[self.threads]
            chooser.end(1)
        return counts


def test_on_a_quiet_machine_two_threads_take_over_within_a_few_calls() -> None:
    machine = Machine()
    chooser = machine.chooser()
    counts = machine.run(chooser, 400)
    # It starts at one thread, the safe count; a probe at two between two calls at one wins.
    assert counts[:4] == [1, 2, 1, 2]
    # A probe of one thread now and then, whose cost stays within its share.
    lost = counts[10:].count(1) * (QUIET[1] - QUIET[2])
    assert 0 < lost / (len(counts[10:]) * QUIET[2]) < 2 * PROBE_SHARE
    assert chooser.statistics().count == 2
    # It is the machine's answer, not the step's: a step of another shape runs at it too.
    assert machine.run(chooser, 1, rows=1) == [2]


def test_on_a_busy_machine_it_keeps_one_thread_and_its_probes_cost_little() -> None:
    machine = Machine()
    machine.step_s = BUSY
    chooser = machine.chooser()
    counts = machine.run(chooser, 2000)  # 10 minutes of 0.3 s steps
    stats = chooser.statistics()
    assert stats.count == 1 and stats.switches == 0
    assert counts.count(2) == stats.probes >= 2  # it keeps looking, now and then
    lost = stats.probes * (BUSY[2] - BUSY[1])
    assert lost / machine.now < 2 * PROBE_SHARE


def test_when_the_machine_turns_busy_it_goes_back_to_one_thread() -> None:
    machine = Machine()
    chooser = machine.chooser()
    assert machine.run(chooser, 50)[-1] == 2
    machine.run(chooser, 3000)  # long enough for the probes to come a minute apart
    machine.step_s = BUSY
    counts = machine.run(chooser, 30)
    assert counts[:4] == [2, 1, 2, 1]  # the slowdown brings a probe at once, which wins
    assert counts[4:].count(2) <= 2  # a probe of two threads now and then


def test_a_new_stream_on_a_machine_just_taken_goes_back_to_one_thread_within_seconds() -> None:
    machine = Machine()
    chooser = machine.chooser()
    machine.run(chooser, 400)  # idle: two threads, probes of one every second or two
    machine.step_s = BUSY
    counts = machine.run(chooser, 10, rows=1)  # a single stream, its first calls all slow
    # Its third call runs at one thread; one more probe of two checks that, and loses.
    assert counts[3] == 1 and counts[3:].count(2) == 1


def test_a_busy_machine_pays_little_for_probes_however_a_prompts_chunks_vary() -> None:
    machine = Machine()
    chooser = machine.chooser()
    busy_s = 0.0
    for _prompt in range(60):  # prompts one after another, each chunk dearer than the last
        for chunk in range(4):
            cost = 1.0 + 0.5 * chunk
            machine.step_s = {1: cost, 2: 10 * cost}
            machine.run(chooser, 1, kind="prefill")
            busy_s += cost
    assert chooser.statistics().count == 1
    assert (machine.now - busy_s) / machine.now < 2 * PROBE_SHARE


def test_after_a_busy_spell_two_threads_come_back_within_the_probes_budget() -> None:
    machine = Machine()
    machine.step_s = {1: 0.3, 2: 3.3}  # a probe of two loses 3 s: the next waits 100 s
    chooser = machine.chooser()
    machine.run(chooser, 1000)
    machine.step_s = QUIET
    counts = machine.run(chooser, 1000)  # 150 s
    assert counts[-100:].count(2) > 90  # (and a probe of one thread now and then)


def test_a_cost_that_grows_from_call_to_call_neither_hides_nor_fakes_a_gain() -> None:
    def grow(machine: Machine, chooser: ThreadChooser, two_over_one: float) -> None:
        for n in range(30):  # each call 10% dearer than the last, as a prompt's later chunks
            cost = 0.1 * 1.1**n
            machine.step_s = {1: cost, 2: cost * two_over_one}
            machine.run(chooser, 1, kind="prefill")

    machine = Machine()
    chooser = machine.chooser()
    grow(machine, chooser, 1.02)  # two threads no faster
    assert chooser.statistics().count == 1
    grow(machine, chooser, 0.85)  # two threads 15% faster: the last calls were far cheaper
    assert chooser.statistics().count == 2


def test_a_thread_count_is_set_only_when_it_changes() -> None:
    machine = Machine()
    machine.step_s = {1: 0.1, 2: 0.1}  # no difference: probes lose and one thread stays
    chooser = machine.chooser()
    machine.run(chooser, 100)
    probes = chooser.statistics().probes
    assert machine.switches == [1] + [2, 1] * probes


@pytest.mark.parametrize(
    ("device", "environment", "chooses"),
    [("cpu", {}, True), ("gpu", {}, False), ("cpu", {"OPENBLAS_NUM_THREADS": "2"}, False)],
)
def test_the_engine_chooses_only_on_cpu_and_never_over_a_count_the_user_set(
    monkeypatch: pytest.MonkeyPatch, device: str, environment: dict, chooses: bool
) -> None:
    own: Callable[[], int] = lambda: 2  # noqa: E731  (OpenBLAS's own count on a 2-core machine)
    monkeypatch.setattr(_blas, "own_threads", own)
    monkeypatch.delenv("OPENBLAS_NUM_THREADS", raising=False)
    for name, value in environment.items():
        monkeypatch.setenv(name, value)
    assert (ThreadChooser.for_device(device) is not None) == chooses
