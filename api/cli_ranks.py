"""The CLI's flags for an engine over several ranks (the runtime starts the ranks:
``actors/engine_port/ranks.py``)."""

from __future__ import annotations

import argparse

from ..engine.errors import MlxTrioError
from ..engine.ranks.rank_group import RankGroup
from .cli_args import DISTRIBUTED_BACKENDS, hostfile, integer

MAX_LOCAL_RANKS = 256  # processes on this machine; more hosts: --hostfile


def add_rank_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("several ranks (mx.distributed, started by mlx.launch)")
    group.add_argument(
        "--ranks",
        type=integer(2, MAX_LOCAL_RANKS),
        default=None,
        help=f"run the model over N local ranks, 2 to {MAX_LOCAL_RANKS} (default: one process)",
    )
    group.add_argument(
        "--hostfile",
        type=hostfile,
        default=None,
        help="mlx.launch's JSON hostfile: ranks on these hosts instead (default: none)",
    )
    group.add_argument(
        "--parallel",
        choices=["tensor", "pipeline"],
        default="tensor",
        help="split each layer over the ranks, or the layers into stages",
    )
    group.add_argument(
        "--distributed-backend",
        choices=DISTRIBUTED_BACKENDS,
        default="ring",
        help="mlx.launch's backend",
    )


def rank_group(args: argparse.Namespace) -> RankGroup | None:
    """The ranks the flags ask for (None: one process); raises ``MlxTrioError``."""
    if args.ranks is None and args.hostfile is None:
        return None
    try:
        return RankGroup(args.ranks or 0, args.parallel, args.distributed_backend, args.hostfile)
    except ValueError as exc:
        raise MlxTrioError(str(exc)) from None
