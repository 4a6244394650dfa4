"""``mlx-trio chaos``: its arguments and its run (the CLI's part of the chaos harness)."""

from __future__ import annotations

import argparse
import logging
from functools import partial

import trio
import trio.testing

from ...engine.errors import MlxTrioError
from ..cli_args import SEED, integer, model
from .plan import FAULT_KINDS, FaultPlan
from .run import run_on_model, run_scripted

logger = logging.getLogger("mlx_trio.cli")


def _kinds(text: str) -> tuple[str, ...]:
    """``all``, or comma-separated fault kinds of ``FAULT_KINDS``."""
    kinds = FAULT_KINDS if text == "all" else tuple(k.strip() for k in text.split(",") if k.strip())
    if not kinds:
        raise argparse.ArgumentTypeError("at least one fault kind, or 'all'")
    if unknown := sorted(set(kinds) - set(FAULT_KINDS)):
        raise argparse.ArgumentTypeError(f"unknown fault kinds {unknown}; see --list")
    return kinds


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--seed", type=SEED, default=0, help="the plan's seed: the same seed, the same run"
    )
    parser.add_argument(
        "--requests",
        type=integer(1, 100_000),
        default=200,
        help="requests in the randomized workload",
    )
    parser.add_argument(
        "--faults",
        type=_kinds,
        default=FAULT_KINDS,
        help="comma-separated fault kinds, or 'all' (see --list; default: all)",
    )
    parser.add_argument("--list", action="store_true", help="list the fault kinds and exit")
    parser.add_argument(
        "--model",
        type=model,
        default=None,
        help="run on a real model ('default' for the embedded one); default: the scripted engine",
    )
    parser.add_argument(
        "--device", choices=["auto", "cpu", "gpu"], default="auto", help="auto: a GPU if any"
    )
    parser.add_argument(
        "--http",
        action="store_true",
        help="drive the plan with HTTP clients against the real server (real time)",
    )


def run(args: argparse.Namespace) -> int:
    """Run the plan ``args`` describe; print its report; 0 if every invariant held."""
    if args.list:
        print("\n".join(FAULT_KINDS))
        return 0
    kinds: tuple[str, ...] = args.faults
    if args.log_level != "DEBUG":  # the injected faults are logged as errors; the table says it all
        logging.getLogger("mlx_trio.actors").setLevel(logging.CRITICAL)
        for name in ("mlx_trio.http", "mlx_trio.server", "hypercorn", "httpx"):  # lines per request
            logging.getLogger(name).setLevel(logging.WARNING)
    over = "over HTTP" if args.http else "in-process"
    try:  # a model's steps are slower: its plan is paced for 100 ms steps
        step_s = 0.01 if args.model is None else 0.1
        plan = FaultPlan.generate(args.seed, args.requests, kinds, step_s=step_s)
    except ValueError as exc:
        raise MlxTrioError(str(exc)) from None
    if args.model is None:
        if args.http:  # sockets need real time: FaultPlan.generate paces the plan for 10 ms steps
            logger.info("chaos: %d requests on the scripted engine, over HTTP", args.requests)
            report = trio.run(partial(run_scripted, plan, step_s=0.01, http=True))
        else:
            logger.info("chaos: %d requests on the scripted engine (virtual time)", args.requests)
            clock = trio.testing.MockClock(autojump_threshold=0)
            report = trio.run(run_scripted, plan, clock=clock)
    else:
        model = None if args.model == "default" else args.model
        logger.info(
            "chaos: %d requests on %s, %s (fault-free pass first)", args.requests, args.model, over
        )
        report = trio.run(partial(run_on_model, plan, model, device=args.device, http=args.http))
    print(report.table())
    return 0 if report.ok else 1
