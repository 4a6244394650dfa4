"""``mlx-trio bench``: the flags, and running the suite, the GPU run, or reporting a saved run.

Two runs share the command, the prompts (``scenarios``), the load generator and the output:

- the suite (the default): every system of ``systems.SYSTEMS`` in a process of its own on the
  default model, scenarios x concurrency levels (``runner``, ``report``);
- the GPU run (``--gpu``): every system of ``wave_plan.WAVE_SYSTEMS`` in this process on one
  random-weight Llama-3.2-1B-shaped model, in paired waves (``wave_runner``, ``wave_report``).
  ``--quick`` shrinks the model so that a CPU runs it in a minute or two.

Either logs a progress line per run (stderr), writes its results as JSON (rewritten after each
run, so that a run cut short keeps what finished), draws the plot where matplotlib is
installed (``pip install 'mlx-trio[bench]'``) and prints the markdown table on stdout.
``--report-only FILE`` does the last two from a saved JSON of either run. The exit status is
1 when a system failed: it did not start or stopped part-way, or (mlx-trio's systems, every
system of the GPU run) some of its requests failed; the table says which.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
from collections.abc import Callable, Iterable
from functools import partial
from pathlib import Path
from typing import Any

import trio

from ..cli_args import MAX_ROWS, integer, json_file, model_directory, program, seconds
from . import report, suite_plot, wave_report
from .log_kinds import once_per_kind
from .results import write_json
from .scenarios import DEFAULT_SCENARIO, SCENARIOS, Scenario, parse_scenarios
from .systems import BASELINE, DEFAULT_SYSTEMS, SYSTEMS
from .wave_plan import MODELS, QUICK_LEVELS, QUICK_MAX_TOKENS, WAVE_SYSTEMS, WavePlan

logger = logging.getLogger(__name__)

DEFAULT_LEVELS = "1,4,8,16,32,64"
DEFAULT_RESULTS = Path("bench-results")
PLOT_EXTRA = "pip install 'mlx-trio[bench]'"
# The flags of one run only, by dest (None when not given): the other run refuses them.
SUITE_ONLY = ("scenarios", "cancel_probe", "baseline", "model_dir", "one_at_a_time")
GPU_ONLY = (
    "quick",
    "models",
    "prompt_tokens",
    "single_repeats",
    "budget_s",
    "warmup_only",
)
# --max-tokens and --prompt-tokens: together within the GPU run's model's context (131,072)
MAX_BENCH_TOKENS = 65_536
# Loggers that would write a line per request or session in the GPU run's own process.
GPU_QUIET = ("hypercorn.error", "mlx_trio.server", "mlx_trio.http", "mlx_trio.actors")


def _levels(text: str) -> list[int]:
    try:
        levels = sorted({int(x) for x in text.split(",") if x.strip()})
    except ValueError:
        raise argparse.ArgumentTypeError(f"not comma-separated integers: {text!r}") from None
    if not levels or levels[0] < 1 or levels[-1] > MAX_ROWS:
        raise argparse.ArgumentTypeError(f"at least one level, each from 1 to {MAX_ROWS}")
    return levels


def _keys(text: str, known: Iterable[str], what: str, choices: str | None = None) -> list[str]:
    """Comma-separated keys, each one of ``known`` (``choices`` says which, if not them all)."""
    keys = [k.strip() for k in text.split(",") if k.strip()]
    if not keys:
        raise argparse.ArgumentTypeError(f"at least one {what}")
    if unknown := [k for k in keys if k not in known]:
        choices = choices or ", ".join(known)
        raise argparse.ArgumentTypeError(f"unknown {unknown}; choose from {choices}")
    return keys


def _systems(text: str) -> list[str]:
    """Keys of either run's systems (they are distinct); which run's is checked once parsed."""
    choices = f"{', '.join(SYSTEMS)}, or with --gpu from {', '.join(WAVE_SYSTEMS)}"
    return _keys(text, [*SYSTEMS, *WAVE_SYSTEMS], "system", choices)


def _scenarios(text: str) -> list[Scenario]:
    try:
        return parse_scenarios(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _saved_run(text: str) -> Path:
    """A results JSON of either run: the suite's (``systems``) or the GPU run's (``models``)."""
    path = json_file(text)
    if not {"systems", "models"} & json.loads(path.read_text()).keys():
        raise argparse.ArgumentTypeError(f"{text} is not a results JSON of either run")
    return path


def add_arguments(
    parser: argparse.ArgumentParser, *, results_dir: Path = DEFAULT_RESULTS, gpu: bool = False
) -> None:
    """The harness's flags on ``parser`` (``mlx-trio bench``, ``python -m bench.suite`` and
    ``python -m bench.gpu``); results go to ``results_dir`` unless ``--out`` says; ``gpu``:
    the GPU run is the default."""
    parser.set_defaults(results_dir=results_dir)
    parser.add_argument(
        "--systems",
        type=_systems,
        default=None,
        help=f"of {','.join(SYSTEMS)}; with --gpu of {','.join(WAVE_SYSTEMS)} (default: all)",
    )
    parser.add_argument(
        "--scenarios",
        type=_scenarios,
        default=None,
        help=f"of {','.join(SCENARIOS)} (default {DEFAULT_SCENARIO}), each with its own "
        "levels if given, as in long-context:8,chat:1+32",
    )
    levels = ",".join(map(str, WavePlan().concurrency))
    quick_levels = ",".join(map(str, QUICK_LEVELS))
    parser.add_argument(
        "--concurrency",
        type=_levels,
        default=None,
        help=f"default {DEFAULT_LEVELS}; --gpu {levels}, --quick {quick_levels}",
    )
    parser.add_argument(
        "--max-tokens",
        type=integer(1, MAX_BENCH_TOKENS),
        default=None,
        help=f"new tokens per stream (default: the scenario's; --gpu {WavePlan().max_tokens}, "
        f"--quick {QUICK_MAX_TOKENS})",
    )
    parser.add_argument(
        "--rounds",
        type=integer(1, 1000),
        default=None,
        help="rounds of each level, every system once a round, in an order that rotates "
        f"(default 1; --gpu {WavePlan().rounds})",
    )
    parser.add_argument(
        "--baseline",
        type=program,
        default=None,
        metavar="PYTHON",
        help="also serve mlx-trio HTTP with this interpreter (another install, say an earlier "
        f"commit's venv) as the system {BASELINE}, with its ratios (default: none)",
    )
    parser.add_argument(
        "--model-dir",
        type=model_directory,
        default=None,
        metavar="DIR",
        help="an MLX model directory every system serves instead of the embedded default model "
        "(the GPU run's 1B shape: python -m bench.memory --build-only --model-dir DIR)",
    )
    parser.add_argument(
        "--one-at-a-time",
        action="store_true",
        default=None,
        help="start each system only for its own runs and stop it before the next starts (a "
        "model too large for two servers at once; default: all started, rounds interleaved)",
    )
    parser.add_argument(
        "--cancel-probe",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="probe how soon a cancelled stream leaves the batch (mlx-trio in-process; default on)",
    )
    parser.add_argument(
        "--out",
        type=Path,
        default=None,
        help=f"the results JSON (default {results_dir}/suite.json, gpu.json with --gpu)",
    )
    parser.add_argument("--png", type=Path, default=None, help="the plot (default: --out, .png)")
    parser.add_argument(
        "--report-only",
        type=_saved_run,
        default=None,
        help="a results JSON to report (either run's) instead of running (default: run)",
    )
    _add_gpu_arguments(parser, gpu)


def _add_gpu_arguments(parser: argparse.ArgumentParser, gpu: bool) -> None:
    plan = WavePlan()
    flags = parser.add_argument_group(
        "the GPU run",
        "every system in this process on one random-weight Llama-3.2-1B-shaped model, in paired "
        "waves (design/008-gpu.md)",
    )
    flags.add_argument("--gpu", action="store_true", default=gpu, help="run it (not the suite)")
    flags.add_argument(
        "--quick", action="store_true", default=None, help="a small model: a CPU check of the path"
    )
    flags.add_argument(
        "--models",
        type=partial(_keys, known=MODELS, what="model"),
        default=None,
        help=f"of {','.join(MODELS)} (default: both)",
    )
    flags.add_argument(
        "--prompt-tokens",
        type=integer(1, MAX_BENCH_TOKENS),
        default=None,
        help=f"prompt ids a stream (default {plan.prompt_tokens})",
    )
    flags.add_argument(
        "--single-repeats",
        type=integer(1, 100),
        default=None,
        help=f"1-stream waves a round (default {plan.single_repeats})",
    )
    flags.add_argument(
        "--budget-s",
        type=seconds(),
        default=None,
        help=f"stop adding rounds after (default {plan.budget_s:g})",
    )
    flags.add_argument(
        "--warmup-only",
        action="store_true",
        default=None,
        help="build each model and time its warm-up alone",
    )


def draw(plot: Callable[[Any, Path], None], data: dict[str, Any], png: Path) -> bool:
    """``plot(data, png)`` if matplotlib is installed; False, said once, if it is not."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        logger.warning("no plot: matplotlib is not installed (%s)", PLOT_EXTRA)
        return False
    plot(data, png)
    logger.info("drew %s", png)
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


def _refuse(message: str) -> None:
    raise SystemExit(f"mlx-trio: error: {message}")


def _check(args: argparse.Namespace) -> None:
    """Flags that belong to the other run, and systems of the other run's table, are refused."""
    others = SUITE_ONLY if args.gpu else GPU_ONLY
    if given := [f"--{d.replace('_', '-')}" for d in others if getattr(args, d) is not None]:
        run = "the suite's, not for --gpu" if args.gpu else "for the GPU run: add --gpu"
        _refuse(f"{', '.join(given)}: {run}")
    table = WAVE_SYSTEMS if args.gpu else SYSTEMS
    if args.systems and (wrong := [k for k in args.systems if k not in table]):
        run = "the GPU run's (--gpu)" if args.gpu else "the suite's"
        _refuse(f"{wrong} are not {run} systems; choose from {', '.join(table)}")
    if not args.gpu and args.systems and BASELINE in args.systems and args.baseline is None:
        _refuse(f"{BASELINE} needs --baseline PYTHON")


def run(args: argparse.Namespace) -> int:
    """Run the suite or the GPU run, or report ``--report-only``; 1 if some system of the suite
    did not run through."""
    for handler in logging.getLogger().handlers:
        handler.setFormatter(_Elapsed("%(message)s"))
    logging.getLogger("httpx").setLevel(logging.WARNING)  # not a line per request
    if args.report_only is not None:
        data = json.loads(args.report_only.read_text())
        return _report(data, args.png or args.report_only.with_suffix(".png"))
    _check(args)
    out = args.out or args.results_dir / ("gpu.json" if args.gpu else "suite.json")
    png = args.png or out.with_suffix(".png")
    if args.gpu:
        return _run_gpu(args, out, png)
    try:
        data = _run_suite(args, out)
    except KeyboardInterrupt:
        if out.is_file():
            logger.warning("interrupted: %s keeps the runs that finished", out)
        raise
    status = _report(data, png)
    write_json(out, data)
    logger.info("wrote %s", out)
    return status


def _report(data: dict[str, Any], png: Path) -> int:
    """Plot and print ``data``, a JSON of either run (the GPU run's has ``models``); 1 if
    some system failed (:func:`failed_systems`)."""
    if "models" in data:
        draw(wave_report.plot, data, png)
        print(wave_report.table(data))
    else:
        draw(suite_plot.plot, data, png)
        print(report.render(data))
    if failed := failed_systems(data):
        logger.error("failed: %s", "; ".join(failed))
        return 1
    return 0


def failed_systems(data: dict[str, Any]) -> list[str]:
    """What failed in a saved run of either kind: in the GPU run, any system with a failed
    request or wave; in the suite, a system that did not start or stopped part-way, or one of
    mlx-trio's with failed requests (mlx_lm.server's stock listener resets a burst's extra
    connections by design: its errors are measured, not a failure of the run)."""
    if "models" in data:
        return wave_report.failures(data)
    failed = []
    for system in data["systems"]:
        if system["error"]:
            failed.append(f"{system['label']}: {system['error']}")
        elif system["key"].startswith("mlx-trio") and (
            errors := sum(level["num_errors"] for level in system["levels"])
        ):
            failed.append(f"{system['label']}: {errors} failed requests")
    return failed


def _run_suite(args: argparse.Namespace, out: Path) -> dict[str, Any]:
    from .runner import run_suite
    from .systems import ensure_f32_model

    keys = args.systems or list(DEFAULT_SYSTEMS)
    if args.baseline is not None and BASELINE not in keys:
        keys.append(BASELINE)
    scenarios = [
        s.with_max_tokens(args.max_tokens) for s in args.scenarios or [SCENARIOS[DEFAULT_SCENARIO]]
    ]
    out.parent.mkdir(parents=True, exist_ok=True)
    needs_f32 = args.model_dir is None and any(SYSTEMS[k].system == "mlx_lm" for k in keys)
    f32_dir = ensure_f32_model() if needs_f32 else None
    suite = partial(
        run_suite,
        keys=keys,
        scenarios=scenarios,
        levels=args.concurrency or _levels(DEFAULT_LEVELS),
        f32_dir=f32_dir,
        log_dir=out.parent,
        cancel_probe=args.cancel_probe is not False,
        rounds=args.rounds or 1,
        baseline=args.baseline,
        model_dir=args.model_dir,
        save=partial(write_json, out),
        one_at_a_time=bool(args.one_at_a_time),
    )
    data = trio.run(suite)
    data["total_s"] = _process_age_s()
    return data


def gpu_plan(args: argparse.Namespace) -> WavePlan:
    """The GPU run's plan from the flags; what they leave out, ``WavePlan``'s defaults (or
    ``--quick``'s levels and tokens)."""
    quick = bool(args.quick)
    levels = args.concurrency or (QUICK_LEVELS if quick else None)
    given = {
        "models": args.models and tuple(args.models),
        "systems": args.systems and tuple(WAVE_SYSTEMS[k] for k in args.systems),
        "concurrency": levels and tuple(levels),
        "max_tokens": args.max_tokens or (QUICK_MAX_TOKENS if quick else None),
        "prompt_tokens": args.prompt_tokens,
        "rounds": args.rounds,
        "single_repeats": args.single_repeats,
        "budget_s": args.budget_s,
    }
    return WavePlan(quick=quick, **{k: v for k, v in given.items() if v is not None})


def _run_gpu(args: argparse.Namespace, out: Path, png: Path) -> int:
    from .wave_runner import run_waves, warmup_only

    for name in GPU_QUIET:
        logging.getLogger(name).setLevel(logging.WARNING)
    plan = gpu_plan(args)
    out.parent.mkdir(parents=True, exist_ok=True)
    if args.warmup_only:
        print(json.dumps(trio.run(warmup_only, plan, out)["warmup_only"], indent=1))
        return 0
    with once_per_kind():
        try:
            data = trio.run(run_waves, plan, out)
        except KeyboardInterrupt:
            if out.is_file():
                logger.warning("interrupted: %s keeps the waves that finished", out)
            raise
    logger.info("wrote %s", out)
    return _report(data, png)
