"""The batch group's two sizing rules, each a small state machine of its own.

:class:`CallPacer`: how many steps the next engine call runs. Every engine call costs the
event loop some work (the thread hop, the group waking, the fan-out, each consumer waking) and
that work holds the GIL the engine thread needs. When steps are fast (a GPU: 4 ms for one row,
31 ms for 256) it would slow decoding down by a seventh at one row and by a third or more at
256, so a call then runs several steps: as many as keep the loop's CPU time, measured call by
call, near ``LOOP_SHARE`` of the call. A row's tokens then wait for the call's last step; so a
small batch (``SMALL_BATCH`` rows or fewer, where the loop's work per call is small) runs one
step a call instead and lets the engine run that many steps ahead of its calls: each call hands
out what was sampled meanwhile, at once, and the engine does not wait for the loop either. An
engine in a process of its own on a GPU shares neither the loop's GIL nor its cores, so batches
of every size run that way there (design/030).

:class:`BatchLimit`: how many rows the batch admits. A step that fails to allocate memory halves
it; each ``RECOVER_AFTER_CALLS`` engine calls that succeed give one row back, up to
``max_batch`` (additive increase, multiplicative decrease, as TCP's congestion window does;
design/015-memory-budget.md).
"""

from __future__ import annotations

import logging
import math

logger = logging.getLogger(__name__)

# The event loop's CPU time per engine call (fan-out, consumers waking, HTTP streaming)
# may add at most this share to the call's steps; it is measured as the calls run.
LOOP_SHARE = 0.03
# An engine in a process of its own on a GPU runs ahead of calls that hand out every step's
# tokens up to SMALL_BATCH_APART rows and every STEPS_APART steps' beyond: at 128 and 256 rows
# of the 8B shape on an H200, a client's gap p50 28 / 40 ms against 224 / 336 ms with calls of
# several steps, and 0.91-1.09x the tok/s over two loans (design/030, section 5).
SMALL_BATCH_APART = 16
STEPS_APART = 2
# Bounds how long a row's tokens wait to be sent (what 16 steps take: design/024).
MAX_STEPS_PER_CALL = 16
# Batches of at most this many rows get their tokens as they are sampled (one step a call,
# the engine running ahead): the loop's work per call is then a fraction of a step even on an
# H200 (design/024).
SMALL_BATCH = 8
RECOVER_AFTER_CALLS = 8


class CallPacer:
    """Steps per engine call, from moving averages of a step's time and of the event loop's
    CPU time per call (its thread's CPU clock from one call to the next)."""

    def __init__(self, fixed: int | None = None) -> None:
        """``fixed``: always this many steps a call (None: paced)."""
        self.fixed = fixed
        self._step_s: float | None = None
        self._loop_s: float | None = None
        self._loop_mark: float | None = None  # the loop thread's CPU clock at the last call

    def call_starts(self, loop_cpu_s: float) -> None:
        """A call begins; ``loop_cpu_s``: the loop's CPU clock now."""
        if self._loop_mark is not None:
            self._loop_s = _moving_average(self._loop_s, loop_cpu_s - self._loop_mark)
        self._loop_mark = loop_cpu_s

    def call_ended(self, seconds: float, steps: int, ahead: int = 0) -> None:
        """A call of ``steps`` (and ``ahead``) took ``seconds``; a call with steps run ahead
        of it does not say how long a step takes, and is not counted."""
        if ahead == 0:
            self._step_s = _moving_average(self._step_s, seconds / steps)

    def forget(self) -> None:
        """Idle, or the batch ended: the next call starts a new measurement of the loop's CPU
        time and of a step. Kept, the loop's CPU time until then (other requests, streams
        closing) was the next batch's first sample, and the last batch's averages its start:
        a lone stream after a batch of long prompts ran 7-16 steps a call on CPU."""
        self._loop_mark = self._loop_s = self._step_s = None

    def plan(self, *, single: bool, rows: int, apart: bool = False) -> tuple[int, int]:
        """The next call's ``(steps, ahead)`` for a batch of ``rows`` (``steps``): a small
        batch that would run several steps a call runs one and lets the engine run as many
        ahead. An engine ``apart`` (in a process of its own on a GPU, whose steps the loop's
        work does not slow) runs ahead of such calls at every batch size, each handing out
        every token sampled since the last: at least one step's up to ``SMALL_BATCH_APART``
        rows, ``STEPS_APART`` steps' beyond (each call costs the engine time a row)."""
        if self.fixed is None and apart and not single:
            return (1 if rows <= SMALL_BATCH_APART else STEPS_APART), MAX_STEPS_PER_CALL
        steps = self.steps(single=single)
        if self.fixed is None and steps > 1 and rows <= SMALL_BATCH:
            return 1, steps
        return steps, 0

    def steps(self, *, single: bool) -> int:
        """Steps for the next call: 1 when ``single`` (rows wait to join, or a drain waits),
        else enough to keep the loop's share near ``LOOP_SHARE``. A first token does not wait
        for the rest of a call: the engine ends the call in the step that produced it."""
        if self.fixed is not None:
            return self.fixed
        if self._step_s is None or self._loop_s is None or single:
            return 1
        wanted = self._loop_s / (LOOP_SHARE * max(self._step_s, 1e-6))
        return max(1, min(MAX_STEPS_PER_CALL, math.ceil(wanted)))


class BatchLimit:
    """The rows the batch admits now: ``max_batch``, less after running out of memory."""

    def __init__(self, max_batch: int) -> None:
        self.max_batch = max_batch
        self.rows = max_batch
        self.out_of_memory = 0  # engine calls that failed to allocate memory
        self._calls_since_lowered = 0

    def lower(self, rows_in_batch: int) -> None:
        """After a failed allocation: admit at most half the rows that were in the batch."""
        self.out_of_memory += 1
        rows = max(1, min(self.rows, rows_in_batch))
        self.rows = max(1, rows // 2)
        self._calls_since_lowered = 0
        logger.warning(
            "the engine ran out of memory with %d row(s); the batch admits at most %d until "
            "steps succeed again",
            rows,
            self.rows,
        )

    def call_succeeded(self) -> None:
        """One row back every ``RECOVER_AFTER_CALLS`` calls that succeed."""
        if self.rows >= self.max_batch:
            return
        self._calls_since_lowered += 1
        if self._calls_since_lowered >= RECOVER_AFTER_CALLS:
            self._calls_since_lowered = 0
            self.rows += 1
            if self.rows == self.max_batch:
                logger.info("the batch admits up to max_batch (%d) rows again", self.max_batch)


def _moving_average(average: float | None, sample: float) -> float:
    return sample if average is None else 0.7 * average + 0.3 * sample


class FaultRecord:
    """A lane's faults: every one counted, and the consecutive ones and stuck steps of the
    engine generation they happened in, so that a restarted engine starts with a clean record
    while the totals stay."""

    def __init__(self) -> None:
        self.faults = 0  # engine calls that raised
        self.stuck = 0  # steps past the watchdog
        self._consecutive = 0
        self._fault_generation = 0
        self._stuck_generation: int | None = None

    def failed(self, generation: int, *, counted: bool = True) -> None:
        """An engine call raised (``counted``) or passed the watchdog (then :meth:`stuck`)."""
        self.faults += counted
        if self._fault_generation != generation:
            self._fault_generation, self._consecutive = generation, 0
        self._consecutive += 1

    def got_stuck(self, generation: int) -> None:
        self.stuck += 1
        self._stuck_generation = generation
        self.failed(generation, counted=False)

    def succeeded(self) -> None:
        self._consecutive = 0

    def consecutive(self, generation: int) -> int:
        """Faults in a row since the last call that did not fault, on ``generation``."""
        return self._consecutive if self._fault_generation == generation else 0

    def is_stuck(self, generation: int) -> bool:
        """Whether a step of ``generation`` passed the watchdog: that engine is wedged."""
        return self._stuck_generation == generation
