"""``mlx-trio bench``: the flags, and running the harness or reporting a saved run.

It logs a progress line per run (stderr), writes the results as JSON, draws the plot where
matplotlib is installed (``pip install 'mlx-trio[bench]'``) and prints the markdown table, the
ratios and the goals on stdout. ``--report-only FILE`` does the last three from a saved JSON.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
from functools import partial
from pathlib import Path
from typing import Any

import trio

from . import report
from .scenarios import DEFAULT_SCENARIO, SCENARIOS, Scenario, parse_scenarios
from .systems import SYSTEMS

logger = logging.getLogger(__name__)

DEFAULT_LEVELS = "1,4,8,16,32,64"
DEFAULT_OUT = Path("bench-results") / "suite.json"
PLOT_EXTRA = "pip install 'mlx-trio[bench]'"


def _levels(text: str) -> list[int]:
    try:
        levels = sorted({int(x) for x in text.split(",") if x.strip()})
    except ValueError:
        raise argparse.ArgumentTypeError(f"not comma-separated integers: {text!r}") from None
    if not levels or levels[0] < 1:
        raise argparse.ArgumentTypeError("at least one level, each at least 1")
    return levels


def _systems(text: str) -> list[str]:
    keys = [k.strip() for k in text.split(",") if k.strip()]
    if not keys:
        raise argparse.ArgumentTypeError("at least one system")
    if unknown := [k for k in keys if k not in SYSTEMS]:
        raise argparse.ArgumentTypeError(f"unknown {unknown}; choose from {', '.join(SYSTEMS)}")
    return keys


def _scenarios(text: str) -> list[Scenario]:
    try:
        return parse_scenarios(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def add_arguments(parser: argparse.ArgumentParser, *, default_out: Path = DEFAULT_OUT) -> None:
    """The harness's flags on ``parser`` (``mlx-trio bench`` and ``python -m bench.suite``)."""
    parser.add_argument(
        "--systems", type=_systems, default=list(SYSTEMS), help=f"of {','.join(SYSTEMS)}"
    )
    parser.add_argument(
        "--scenarios",
        type=_scenarios,
        default=[SCENARIOS[DEFAULT_SCENARIO]],
        help=f"of {','.join(SCENARIOS)} (default {DEFAULT_SCENARIO})",
    )
    parser.add_argument(
        "--concurrency", type=_levels, default=_levels(DEFAULT_LEVELS), help=DEFAULT_LEVELS
    )
    parser.add_argument(
        "--max-tokens",
        type=int,
        default=None,
        help="new tokens per stream (default: the scenario's)",
    )
    parser.add_argument(
        "--cancel-probe",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="probe how soon a cancelled stream leaves the batch (mlx-trio in-process)",
    )
    parser.add_argument("--out", type=Path, default=default_out, help="the results JSON")
    parser.add_argument("--png", type=Path, default=None, help="the plot (default: --out, .png)")
    parser.add_argument("--report-only", type=Path, default=None, help="a results JSON to report")


def draw(data: dict[str, Any], png: Path) -> bool:
    """The plot to ``png`` if matplotlib is installed; False, said once, if it is not."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        logger.warning("no plot: matplotlib is not installed (%s)", PLOT_EXTRA)
        return False
    report.plot(data, png)
    return True


class _Elapsed(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        minutes, seconds = divmod(record.relativeCreated / 1000, 60)
        return f"[{int(minutes):02d}:{seconds:04.1f}] {super().format(record)}"


def _process_age_s() -> float | None:
    """Seconds since this process started (imports included), from ``/proc``; else None."""
    try:
        ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])
        uptime = float(Path("/proc/uptime").read_text().split()[0])
        return uptime - ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


def run(args: argparse.Namespace) -> int:
    """Run the harness (or report ``--report-only``); 1 if some system did not run through."""
    for handler in logging.getLogger().handlers:
        handler.setFormatter(_Elapsed("%(message)s"))
    logging.getLogger("httpx").setLevel(logging.WARNING)  # not a line per request
    if args.report_only is not None:
        data = json.loads(args.report_only.read_text())
        png = args.png or args.report_only.with_suffix(".png")
    else:
        if args.max_tokens is not None and args.max_tokens < 1:
            raise SystemExit("mlx-trio: error: --max-tokens must be at least 1")
        data = _run_harness(args)
        png = args.png or args.out.with_suffix(".png")
    if draw(data, png):
        logger.info("drew %s", png)
    print(report.render(data))
    if args.report_only is None:
        args.out.write_text(json.dumps(data, indent=2) + "\n")
        logger.info("wrote %s", args.out)
    return 1 if any(system["error"] for system in data["systems"]) else 0


def _run_harness(args: argparse.Namespace) -> dict[str, Any]:
    from .runner import run_suite
    from .systems import ensure_f32_model

    scenarios = [s.with_max_tokens(args.max_tokens) for s in args.scenarios]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    needs_f32 = any(SYSTEMS[k].system == "mlx_lm" for k in args.systems)
    f32_dir = ensure_f32_model() if needs_f32 else None
    suite = partial(
        run_suite,
        keys=args.systems,
        scenarios=scenarios,
        levels=args.concurrency,
        f32_dir=f32_dir,
        log_dir=args.out.parent,
        cancel_probe=args.cancel_probe,
    )
    data = trio.run(suite)
    data["total_s"] = _process_age_s()
    return data
