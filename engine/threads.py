"""How many threads OpenBLAS runs the engine's steps on, chosen from the steps themselves.

On 2 cores (design/017) two OpenBLAS threads made every step of the default model 20-30%
faster than one while nothing else ran, single stream included, and 5-20x slower while other
processes kept the cores busy: OpenBLAS splits each GEMM between its threads, and a thread
the kernel has descheduled holds the other up until its next time slice, for each of the
hundreds of GEMMs of a step. Neither fixed count is safe, and the one measure that covers
both cases (and CPU quotas, and whatever the event loop takes meanwhile) is the step itself.

So the engine times each call at the count it ran, by the call's shape (decoding or
prefilling, and how many rows, to a power of two), and now and then runs one call at the
other count: if it was faster by ``MARGIN`` than the shape's last calls, that count stays for
the shape and the next probe comes soon; if not, the next probe waits twice as long as the
last, from ``FIRST_INTERVAL_S`` up to ``MAX_INTERVAL_S``, and at least long enough that the
time the probe lost is ``PROBE_SHARE`` of the wait: a prefill step that two threads on a busy
machine stretch from 2 s to 20 s must not come back every minute. The probes' schedule is one
for the whole engine, since what they find (the machine busy or not) held for every shape
measured: a machine whose cores are taken pays for a few percent of its time in probes, not
for one slow call every few calls of each shape. A call on several threads ``SLOWDOWN`` times
slower than its shape's last ones (the cores were just taken) brings the next probe forward, to
the shape's third call from then. A shape met for the first time starts at the count last
chosen. A switch is one call into OpenBLAS (``openblas_set_num_threads``, 0.2 us; it applies
from the next GEMM), made only when the count changes.

Only where it can matter: OpenBLAS loaded (Linux x86-64, the CPU device), more than one core,
and no ``OPENBLAS_NUM_THREADS`` in the environment (a count the user set is kept).
"""

from __future__ import annotations

import logging
import os
import statistics
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from . import _blas

logger = logging.getLogger(__name__)

Shape = tuple[str, int]  # ("decode" | "prefill", rows to a power of two)

MARGIN = 0.1  # a probe must beat the shape's recent calls by this share to take over
RECENT = 3  # calls at the shape's count a probe is compared with
FRESH_S = 10.0  # calls older than this say nothing about the machine now
FIRST_INTERVAL_S = 1.0
MAX_INTERVAL_S = 60.0
PROBE_SHARE = 0.03  # at most this share of the time goes to what losing probes lose
SLOWDOWN = 2.0  # a call this much slower than the shape's last ones brings the next probe now


def shape(kind: str, rows: int) -> Shape:
    """A call's shape: its kind and its rows rounded down to a power of two."""
    return kind, 1 << (max(rows, 1).bit_length() - 1)


@dataclass(slots=True)
class _ShapeState:
    count: int
    recent: deque[float] = field(default_factory=lambda: deque(maxlen=RECENT))
    last_at: float = 0.0  # when its last call began


@dataclass(frozen=True, slots=True)
class ThreadStatistics:
    """The count each shape runs at, and how many probes ran and won (switched)."""

    counts: dict[Shape, int]
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
        self._counts = counts
        self._set_threads = set_threads
        self._clock = clock
        self._shapes: dict[Shape, _ShapeState] = {}
        self._preferred = counts[0]  # the count last chosen: where a new shape starts
        self._current: int | None = None  # what OpenBLAS runs now, if we set it
        self._interval = FIRST_INTERVAL_S
        self._probe_at = clock()
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
        """Set the count for a call of ``call_shape``: the shape's, or the other one for a
        probe that is due."""
        state = self._shapes.get(call_shape)
        if state is None:
            state = self._shapes[call_shape] = _ShapeState(self._preferred)
        count = state.count
        now = self._clock()
        if now - state.last_at > FRESH_S:
            state.recent.clear()
        state.last_at = now
        probe = len(state.recent) == RECENT and now >= self._probe_at
        if probe:
            count = self._other(count)
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
        if not probe:
            usual = statistics.median(state.recent) if len(state.recent) == RECENT else None
            if usual is not None and per_step > SLOWDOWN * usual and count != self._counts[0]:
                # The machine changed (other processes took the cores): look again now,
                # against calls from after the change. (At one thread a busier machine makes
                # more threads only worse: no probe for that.)
                state.recent.clear()
                self._probe_at = now
            state.recent.append(per_step)
            return
        self._probes += 1
        usual = statistics.median(state.recent)
        if per_step < (1 - MARGIN) * usual:
            logger.info(
                "OpenBLAS threads for %s steps of %d rows: %d (%.0f ms a step, against %.0f "
                "ms at %d)",
                *call_shape,
                count,
                per_step * 1000,
                usual * 1000,
                state.count,
            )
            state.count = self._preferred = count
            state.recent.clear()
            state.recent.append(per_step)
            self._switches += 1
            self._interval = FIRST_INTERVAL_S
        else:
            lost = max(per_step - usual, 0.0) * steps
            self._interval = max(min(2 * self._interval, MAX_INTERVAL_S), lost / PROBE_SHARE)
        self._probe_at = now + self._interval

    def close(self, count: int = 1) -> None:
        """Leave OpenBLAS at ``count`` threads (the engine's own fixed count), if this changed
        it: the count is the whole process's, and whatever runs next in it did not choose."""
        if self._current not in (None, count):
            self._set_threads(count)
        self._current = None

    def _other(self, count: int) -> int:
        first, second = self._counts
        return second if count == first else first

    def statistics(self) -> ThreadStatistics:
        counts = {s: state.count for s, state in self._shapes.items()}
        return ThreadStatistics(counts, self._probes, self._switches)
