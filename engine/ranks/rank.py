"""One rank of an engine group (``python -m mlx_trio.engine.ranks.rank ARGS``, run by
``mlx.launch``).

``ARGS`` is a pickled :class:`RankArgs` that the runtime wrote. Every rank builds the engine and
splits its model (``distributed.build_rank``) as it boots its core (``options.boot_core``), all
in the same order. Rank 0 then connects to the runtime's socket and serves its calls as an engine
process does (``child.serve_engine``), sending each to the others first; the others follow
(``distributed.follow``) until rank 0 stops or the group dies.
"""

from __future__ import annotations

import logging
import pickle
import signal
import socket
import sys
from dataclasses import dataclass, replace
from functools import partial
from multiprocessing.connection import Connection

from ..options import CoreRecipe, boot_core
from .distributed import build_rank, follow
from .rank_group import RankGroup

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class RankArgs:
    recipe: CoreRecipe  # the engine's core, as one process would boot it (it pickles)
    group: RankGroup
    socket_path: str  # where rank 0 finds the runtime
    log_level: int


def main(args_file: str) -> None:
    with open(args_file, "rb") as f:
        args: RankArgs = pickle.load(f)
    recipe = replace(args.recipe, build=partial(build_rank, args.recipe.build, args.group))
    import mlx.core as mx

    rank = mx.distributed.init(strict=True, backend=args.group.backend).rank()
    if rank == 0:
        from ..child import serve_engine

        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.connect(args.socket_path)
        connection = Connection(sock.detach())
        serve_engine(connection, recipe, args.log_level, terminable=True)
        return
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.basicConfig(
        level=args.log_level,
        format=f"%(asctime)s %(levelname)s %(name)s (rank {rank}): %(message)s",
    )
    core, _ = boot_core(recipe)
    try:
        follow(core, core.engine.lockstep)
    finally:
        core.close()


if __name__ == "__main__":
    main(sys.argv[1])
