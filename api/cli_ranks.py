"""The CLI's flags for an engine over several ranks, and ``generate`` on them (through the
runtime, which starts the ranks: ``actors/engine_port/ranks.py``)."""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Callable

from ..engine.budget import MemoryLimit
from ..engine.errors import InvalidRequestError, MlxTrioError
from ..engine.params import SamplingParams
from ..engine.rank_group import RankGroup
from ..engine.sampling_defaults import SamplingDefaults
from .cli_args import DISTRIBUTED_BACKENDS, hostfile, integer, model_refused

logger = logging.getLogger("mlx_trio.cli")

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


def generate_on_ranks(
    args: argparse.Namespace,
    ranks: RankGroup,
    sampling_params: Callable[[SamplingDefaults], SamplingParams],
    memory_limit: MemoryLimit | None,
) -> int:
    """``generate`` over several ranks: through the runtime, which starts them.
    ``sampling_params``: the request's parameters over the model's defaults (from the flags)."""
    import trio

    from ..actors.messages import Completed, GenerationRequest, TextDelta
    from ..engine.prompt import ChatMessage
    from .inprocess import open_runtime

    async def run() -> None:
        async with open_runtime(
            args.model,
            device=args.device,
            memory_limit=memory_limit,
            ranks=ranks,
            max_batch=1,
        ) as rt:
            params = sampling_params(rt.sampling_defaults)
            prompt: str | tuple[ChatMessage, ...] = args.prompt
            if not args.raw:
                system = () if args.system is None else (ChatMessage("system", args.system),)
                prompt = (*system, ChatMessage("user", args.prompt))
            try:
                handle = await rt.submit(GenerationRequest(prompt, params))
            except InvalidRequestError as exc:  # --top-k past the vocabulary, ...
                raise model_refused(exc) from None
            async for event in handle:
                if isinstance(event, TextDelta):
                    sys.stdout.write(event.text)
                    sys.stdout.flush()
                elif isinstance(event, Completed):
                    sys.stdout.write("\n")
                    logger.info("%s: finish %s", rt.model_id, event.finish_reason)

    trio.run(run)
    return 0
