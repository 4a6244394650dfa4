"""How many threads OpenBLAS runs the engine's steps on, chosen from the steps themselves.

On 2 cores (design/017) two OpenBLAS threads made every step of the default model 20-30%
faster than one while nothing else ran, single stream included, and 5-20x slower while other
processes kept the cores busy: OpenBLAS splits each GEMM between its threads, and a thread
the kernel has descheduled holds the other up until its next time slice, for each of the
hundreds of GEMMs of a step. Neither fixed count is safe, and the one measure that covers
both cases (and CPU quotas, and whatever the event loop takes meanwhile) is the step itself.
Which count wins was the same for every step measured, one row or 32, decoding or prefilling:
it depends on the machine, not on the step. So there is one count for the engine.

The engine times each call, by its shape (decoding or prefilling, and how many rows, to a
power of two), and now and then runs one call at the other count, a probe, between two calls
of the same shape at the engine's count: the probe is compared with their mean, so that a
cost that grows from call to call (a prompt's chunks against a longer and longer context, a
KV cache that grows) does not count for or against it; neighbours ``NEIGHBOURS`` times apart
(a prompt ended between them) decide nothing. If the probe was faster by ``MARGIN``,
its count becomes the engine's; either way the next probe waits ``MIN_INTERVAL_S``, and long
enough that what the probe lost is ``PROBE_SHARE`` of the wait: on an idle machine a probe of
one thread loses a third of a step, and comes back within seconds (so that the cores being
taken shows soon); on a busy one a probe of two threads can stretch a prefill step from 2 s
to 20 s, and comes back ten minutes later. A probe whose shape changes before the call after
it is dropped.

A call on several threads ``SLOWDOWN`` times slower than its shape's last ones (the cores were
just taken) brings the next probe forward: a probe of one thread costs little. Nothing brings a
probe of several threads forward, however busy the machine was: a first version took a call on
one thread 1.5x faster than its shape's last ones for the cores given back, but a prompt's
first chunk is that much cheaper than the last prompt's last one, and on a busy machine every
prompt of a long-context run then paid for a probe of two threads. A switch is one call into
OpenBLAS (``openblas_set_num_threads``, 0.2 us; it applies from the next GEMM), made only when
the count changes.

Only where it can matter: OpenBLAS loaded (Linux x86-64, the CPU device), more than one core,
and no ``OPENBLAS_NUM_THREADS`` in the environment (a count the user set is kept).
"""

from __future__ import annotations

import logging
import math
import os
import statistics
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from . import _blas

logger = logging.getLogger(__name__)

Shape = tuple[str, int]  # ("decode" | "prefill", rows to a power of two)

MARGIN = 0.1  # a probe must beat the calls around it by this share to take over
NEIGHBOURS = 1.5  # calls around a probe further apart than this are no measure
RECENT = 3  # a shape's last calls, against which a slowdown shows
FRESH_S = 10.0  # calls older than this say nothing about the machine now
MIN_INTERVAL_S = 1.0  # between probes
PROBE_SHARE = 0.03  # at most this share of the time goes to what losing probes lose
SLOWDOWN = 2.0  # a call on several threads this much slower brings the next probe now


def shape(kind: str, rows: int) -> Shape:
    """A call's shape: its kind and its rows rounded down to a power of two."""
    return kind, 1 << (max(rows, 1).bit_length() - 1)


@dataclass(slots=True)
class _ShapeState:
    recent: deque[float] = field(default_factory=lambda: deque(maxlen=RECENT))
    last_at: float = -math.inf  # when its last call began


@dataclass(frozen=True, slots=True)
class _Probe:
    """A probe waiting for the call after it: its shape and count, its time a step and steps,
    and the time a step of the call before it."""

    shape: Shape
    count: int
    per_step: float
    steps: int
    before: float


@dataclass(frozen=True, slots=True)
class ThreadStatistics:
    """The engine's count now, and how many probes ran and won (switched)."""

    count: int
    probes: int
    switches: int


class ThreadChooser:
    """Picks OpenBLAS's thread count for each engine call; see the module docstring.

    Call :meth:`begin` with the call's shape before it steps and :meth:`end` with the steps
    it ran after; a call that raised is simply not ended. Engine thread only.
    """

    def __init__(
        self,
        counts: tuple[int, int],
        set_threads: Callable[[int], None] = _blas.set_threads,
        *,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        """``counts``: one thread (the safe count, where it starts) and the other."""
        self._counts = counts
        self._set_threads = set_threads
        self._clock = clock
        self._count = counts[0]
        self._shapes: dict[Shape, _ShapeState] = {}
        self._current: int | None = None  # what OpenBLAS runs now, if we set it
        self._probe_at = clock()
        self._probe: _Probe | None = None
        self._probes = 0
        self._switches = 0
        # The call in flight: its shape, its count, whether it probes, when it began.
        self._call: tuple[Shape, int, bool, float] | None = None

    @classmethod
    def for_device(cls, device: str) -> ThreadChooser | None:
        """A chooser between one thread and OpenBLAS's own count, where that can matter
        (see the module docstring); else None."""
        own = _blas.own_threads()
        if device != "cpu" or own is None or own < 2 or "OPENBLAS_NUM_THREADS" in os.environ:
            return None
        return cls((1, own))

    def begin(self, call_shape: Shape) -> None:
        """Set the count for a call of ``call_shape``: the engine's, or the other one for a
        probe that is due."""
        state = self._shapes.setdefault(call_shape, _ShapeState())
        now = self._clock()
        if now - state.last_at > FRESH_S:
            state.recent.clear()
        state.last_at = now
        if self._probe is not None and self._probe.shape != call_shape:
            self._probe = None  # no call after it to compare with: look again soon
            self._probe_at = now + MIN_INTERVAL_S
        probe = self._probe is None and bool(state.recent) and now >= self._probe_at
        count = self._other() if probe else self._count
        if count != self._current:
            self._set_threads(count)
            self._current = count
        self._call = (call_shape, count, probe, now)

    def end(self, steps: int) -> None:
        """Record the call begun last, which ran ``steps`` steps (none: nothing to learn)."""
        if self._call is None:
            return
        call_shape, count, probe, began = self._call
        self._call = None
        now = self._clock()
        if steps < 1:
            return
        per_step = (now - began) / steps
        state = self._shapes[call_shape]
        if probe:
            self._probes += 1
            self._probe = _Probe(call_shape, count, per_step, steps, state.recent[-1])
            return
        if self._probe is not None:
            self._decide(self._probe, per_step, now)
            self._probe = None
        elif self._machine_changed(state, count, per_step):
            state.recent.clear()
            self._probe_at = now
        state.recent.append(per_step)

    def _machine_changed(self, state: _ShapeState, count: int, per_step: float) -> bool:
        """Whether a call on several threads was ``SLOWDOWN`` times slower than its shape's
        last calls: the cores were taken."""
        return (
            count != self._counts[0]
            and bool(state.recent)
            and per_step > SLOWDOWN * statistics.median(state.recent)
        )

    def _decide(self, probe: _Probe, after: float, now: float) -> None:
        """Make the probe's count the engine's if it beat the mean of the calls around it
        (``after``: the time a step of the one after it), and schedule the next probe. Calls
        around it that disagree by more than ``NEIGHBOURS`` (a prompt ended between them)
        decide nothing; what the probe lost against the call before it sets the wait."""
        low, high = sorted((probe.before, after))
        if high > NEIGHBOURS * low:
            usual = probe.before
            logger.debug("OpenBLAS threads: a probe between unlike calls decides nothing")
        elif probe.per_step < (1 - MARGIN) * (usual := (probe.before + after) / 2):
            logger.info(
                "OpenBLAS threads: %d (%s steps of %d rows: %.0f ms a step, against %.0f ms at %d)",
                probe.count,
                *probe.shape,
                probe.per_step * 1000,
                usual * 1000,
                self._count,
            )
            self._count = probe.count
            self._switches += 1
            for state in self._shapes.values():
                state.recent.clear()  # times at the other count
        else:
            logger.debug(
                "OpenBLAS threads: %d stays (%s steps of %d rows: %.0f ms a step at %d)",
                self._count,
                *probe.shape,
                probe.per_step * 1000,
                probe.count,
            )
        lost = max(probe.per_step - usual, 0.0) * probe.steps
        self._probe_at = now + max(MIN_INTERVAL_S, lost / PROBE_SHARE)

    def close(self, count: int = 1) -> None:
        """Leave OpenBLAS at ``count`` threads (the engine's own fixed count), if this changed
        it: the count is the whole process's, and whatever runs next in it did not choose."""
        if self._current not in (None, count):
            self._set_threads(count)
        self._current = None

    def _other(self) -> int:
        first, second = self._counts
        return second if self._count == first else first

    def statistics(self) -> ThreadStatistics:
        return ThreadStatistics(self._count, self._probes, self._switches)
