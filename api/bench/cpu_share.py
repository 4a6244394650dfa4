"""How much of the machine's CPU went to processes other than the ones being measured.

On a small shared machine a throughput number means little if something else was computing at
the same time (MLX's BLAS threads slow down badly when they share cores). Take a sample before
and after a measurement, watching the benchmark and the server; :func:`other_share` is the
fraction of all CPUs' time in between that neither of them used. Linux only (``/proc``);
elsewhere samples are None.
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

_PROC = Path("/proc")


@dataclass(frozen=True, slots=True)
class CpuSample:
    """Busy CPU seconds of the whole machine and of the watched processes, at ``taken_at``."""

    machine_busy_s: float
    watched_s: float
    num_cpus: int
    taken_at: float


def _clock_ticks() -> int:
    return os.sysconf("SC_CLK_TCK")


def _machine_busy_s() -> tuple[float, int]:
    """Busy (not idle, not iowait) CPU seconds since boot over all CPUs, and the CPU count."""
    lines = (_PROC / "stat").read_text().splitlines()
    fields = [int(v) for v in lines[0].split()[1:]]
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)
    num_cpus = sum(1 for line in lines[1:] if line.startswith("cpu"))
    return (sum(fields[:8]) - idle) / _clock_ticks(), num_cpus


def _process_cpu_s(pid: int) -> float:
    """User + system CPU seconds of ``pid``, all threads and waited-for children included."""
    text = (_PROC / str(pid) / "stat").read_text()
    rest = text[text.rindex(")") + 2 :].split()  # after "pid (comm) "; rest[0] is field 3
    utime, stime, cutime, cstime = (int(v) for v in rest[11:15])
    return (utime + stime + cutime + cstime) / _clock_ticks()


def sample(pids: Sequence[int]) -> CpuSample | None:
    """A sample watching ``pids``; None without ``/proc`` or if a process is gone."""
    try:
        busy, num_cpus = _machine_busy_s()
        watched = sum(_process_cpu_s(pid) for pid in pids)
    except (OSError, ValueError, IndexError):
        return None
    return CpuSample(busy, watched, num_cpus, time.perf_counter())


def other_share(before: CpuSample | None, after: CpuSample | None) -> float | None:
    """Fraction (0-1) of all CPUs' time between the samples used by unwatched processes."""
    if before is None or after is None or after.taken_at <= before.taken_at:
        return None
    capacity = (after.taken_at - before.taken_at) * after.num_cpus
    other = (after.machine_busy_s - before.machine_busy_s) - (after.watched_s - before.watched_s)
    return min(max(other / capacity, 0.0), 1.0)
