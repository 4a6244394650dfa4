"""The harness's results as data: one measurement, one system's record, and their JSON.

The runner fills these; the report reads only the JSON they become, so a saved file can be
reported again without running anything. ``scenario`` in each level row names the scenario
(``scenarios.SCENARIOS``); a file written before scenarios existed has none and is ``chat``.
``round`` numbers a level's rounds from 0; a file written before rounds existed has one.
"""

from __future__ import annotations

import json
import os
import platform
from collections.abc import Sequence
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

from .load_result import LoadResult

MB = 1024 * 1024


@dataclass(frozen=True, slots=True)
class Measurement:
    """One system at one concurrency level of one scenario."""

    key: str
    scenario: str
    result: LoadResult
    other_cpu_share: float | None
    peak_rss_bytes: int | None
    round: int = 0


@dataclass(frozen=True, slots=True)
class SystemRecord:
    """How a system fared as a whole: its startup time, or why it did not run (``error``)."""

    key: str
    label: str
    kind: str
    startup_s: float | None
    error: str | None
    # A server's warm-up bursts' TTFT p99 in order, the first sent once /health turned 200.
    bursts_ttft_p99_s: tuple[float | None, ...] = ()


def machine() -> dict[str, Any]:
    cpu = "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass

    def version(package: str) -> str:
        try:
            return metadata.version(package)
        except metadata.PackageNotFoundError:
            return "not installed"

    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "python": platform.python_version(),
        "mlx": version("mlx"),
        "mlx_lm": version("mlx-lm"),
        "mlx_trio": version("mlx-trio"),
        "platform": platform.platform(),
    }


def _level_row(m: Measurement) -> dict[str, Any]:
    return {
        "scenario": m.scenario,
        "round": m.round,
        **m.result.summary(),
        "other_cpu_share": m.other_cpu_share,
        "peak_rss_mb": None if m.peak_rss_bytes is None else m.peak_rss_bytes / MB,
        "requests": [r.to_json() for r in m.result.requests],
    }


def to_json(
    *,
    systems: Sequence[SystemRecord],
    measurements: Sequence[Measurement],
    probe: dict | None,
    idle_other_share: float | None,
    settings: dict[str, Any],
) -> dict[str, Any]:
    rows = []
    for system in systems:
        levels = [_level_row(m) for m in measurements if m.key == system.key]
        rows.append(
            {
                "key": system.key,
                "label": system.label,
                "kind": system.kind,
                "startup_s": system.startup_s,
                "error": system.error,
                "bursts_ttft_p99_s": list(system.bursts_ttft_p99_s),
                "levels": sorted(levels, key=lambda lv: (lv["clients"], lv["round"])),
            }
        )
    data: dict[str, Any] = {
        "machine": machine(),
        "settings": {
            "model": "SmolLM2-135M-Instruct (embedded default), float32 on CPU, OpenBLAS",
            **settings,
            "stream_generate": "1 stream only: mlx-lm's stream_generate serves one at a time",
            "peak_rss": "VmHWM of the system's process, reset before each run (clear_refs)",
        },
        "idle_other_cpu_share": idle_other_share,
        "systems": rows,
        "cancel_probe": probe,
    }
    return data


def write_json(out: Path, data: dict[str, Any], indent: int = 2) -> None:
    """Write ``data`` to ``out`` by a rename, so that a run stopped while it writes leaves the
    last whole file (the harness rewrites its results after every run)."""
    staged = out.with_name(f".{out.name}.tmp")
    staged.write_text(json.dumps(data, indent=indent) + "\n")
    os.replace(staged, out)
