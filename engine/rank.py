"""One rank of an engine group (``python -m mlx_trio.engine.rank ARGS``, run by ``mlx.launch``).

``ARGS`` is a pickled :class:`RankArgs` that the runtime wrote. Every rank builds the engine and
splits its model (``distributed.build_rank``), makes its core and warms it up, all in the same
order. Rank 0 then connects to the runtime's socket and serves its calls as an engine process
does (``child.serve_engine``), sending each to the others first; the others follow
(``distributed.follow``) until rank 0 stops or the group dies.
"""

from __future__ import annotations

import logging
import pickle
import signal
import socket
import sys
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from multiprocessing.connection import Connection
from typing import Any

from .distributed import build_rank, follow
from .rank_group import RankGroup

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class RankArgs:
    build: Callable[[], Any]  # the engine, as one process would build it (it pickles)
    group: RankGroup
    socket_path: str  # where rank 0 finds the runtime
    max_batch: int
    prefill_chunk: int
    warm_up: bool
    log_level: int


def main(args_file: str) -> None:
    with open(args_file, "rb") as f:
        args: RankArgs = pickle.load(f)
    build = partial(build_rank, args.build, args.group)
    import mlx.core as mx

    rank = mx.distributed.init(strict=True, backend=args.group.backend).rank()
    if rank == 0:
        from .child import serve_engine

        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.connect(args.socket_path)
        connection = Connection(sock.detach())
        serve_engine(
            connection,
            build,
            args.max_batch,
            args.prefill_chunk,
            args.warm_up,
            args.log_level,
            terminable=True,
        )
        return
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.basicConfig(
        level=args.log_level,
        format=f"%(asctime)s %(levelname)s %(name)s (rank {rank}): %(message)s",
    )
    from .core import EngineCore
    from .warmup import warm_up

    engine = build()
    core = EngineCore(engine, max_batch=args.max_batch, prefill_chunk=args.prefill_chunk)
    core.batch_reset()
    if args.warm_up:
        warm_up(engine, max_batch=args.max_batch, prefill_chunk=args.prefill_chunk)
    try:
        follow(core, engine.lockstep)
    finally:
        core.close()


if __name__ == "__main__":
    main(sys.argv[1])
