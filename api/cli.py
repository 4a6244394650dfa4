"""The ``mlx-trio`` command line: ``generate``, ``serve``, ``chaos``, ``pull`` and ``bench``."""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence
from typing import NoReturn

from ..engine.errors import InvalidRequestError, MlxTrioError
from . import bench as bench_harness
from .chaos import command as chaos_command
from .cli_args import (
    HelpFormatter,
    flag_of,
    hub_id,
    model,
)
from .cli_flags import (
    MODEL_HELP,
    add_adapter_path,
    add_device,
    add_kv_bits,
    add_memory_limit,
    add_sampling_flags,
    add_speculative,
    engine_options,
    flag_defaults,
    sampling_params,
)
from .cli_generate import generate
from .cli_ranks import add_rank_flags
from .cli_serve import add_serve_flags, serve_options

__all__ = ["build_parser", "main", "serve_options"]

logger = logging.getLogger("mlx_trio.cli")


class _Parser(argparse.ArgumentParser):
    """argparse, but an error is one line on stderr and exit status 2; each flag's help
    shows its default."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"mlx-trio: error: {message}\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="mlx-trio", description="Concurrent LLM inference on MLX and Trio.")
    levels = ["DEBUG", "INFO", "WARNING", "ERROR"]
    parser.add_argument(
        "--log-level", type=str.upper, default="INFO", choices=levels, help="what is logged"
    )
    # The same flag after the command (``mlx-trio serve --log-level debug``) wins.
    logs = _Parser(add_help=False)
    logs.add_argument(
        "--log-level",
        type=str.upper,
        default=argparse.SUPPRESS,
        choices=levels,
        help="what is logged (default: INFO)",
    )
    commands = parser.add_subparsers(
        dest="command", metavar="COMMAND", parser_class=_Parser, title="commands"
    )
    add_parser = commands.add_parser

    def command(name: str, help: str) -> argparse.ArgumentParser:
        return add_parser(name, help=help, description=help, parents=[logs])

    generate = command("generate", help="stream a completion to stdout")
    generate.add_argument("prompt", help="the user's message (with --raw: the text to continue)")
    generate.add_argument(
        "--model",
        type=model,
        default=None,
        help=MODEL_HELP,
    )
    generate.add_argument("--raw", action="store_true", help="plain completion, no chat template")
    generate.add_argument(
        "--system", default=None, help="system message (chat only; default: none)"
    )
    add_device(generate)
    add_memory_limit(generate)
    add_adapter_path(generate)
    add_kv_bits(generate)
    add_speculative(generate)
    add_sampling_flags(generate)
    add_rank_flags(generate)

    add_serve_flags(command("serve", help="serve an OpenAI-compatible HTTP API"))

    chaos = command(
        "chaos", help="run a randomized workload with injected faults and check the invariants"
    )
    chaos_command.add_arguments(chaos)

    pull = command(
        "pull", help="fetch a Hugging Face model into its cache, or the embedded default model"
    )
    pull.add_argument(
        "model",
        nargs="?",
        type=hub_id,
        default=None,
        help="a Hugging Face id, org/name or org/name@revision (default: the embedded model)",
    )
    pull.add_argument("--force", action="store_true", help="re-download (and re-import)")
    pull.set_defaults(force=False)

    bench = command(
        "bench", help="benchmark systems x scenarios x concurrency levels (design/014-bench.md)"
    )
    bench_harness.add_arguments(bench)
    return parser


def _generate(args: argparse.Namespace) -> int:
    from ..engine import torchless

    flags = flag_defaults(args)
    options = engine_options(args)
    torchless.keep_out_for(options.model)  # before this process imports the engine
    return generate(args, options, lambda model: sampling_params(args, flags.over(model)), flags)


def _serve(args: argparse.Namespace) -> int:
    import trio

    from ..engine import torchless

    options = serve_options(args)
    torchless.keep_out_for(options.engine.model)  # before this process imports the engine
    from .server import serve

    trio.run(serve, options)
    return 0


def _pull(args: argparse.Namespace) -> int:
    from ..engine.model.hub import pull_hub_model
    from ..engine.model.model_store import pull_default_model

    if args.model is None:
        path = pull_default_model(force=args.force)
    else:
        path = pull_hub_model(args.model, force=args.force)
    print(path)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:  # a bare ``mlx-trio``: what it can do
        parser.print_help(sys.stderr)
        return 2
    if args.command == "generate":  # what no one flag's check sees: five --stop strings
        try:
            sampling_params(args, flag_defaults(args))
        except InvalidRequestError as exc:
            parser.error(f"argument {flag_of(exc.param)}: {exc.message}")
    logging.basicConfig(
        level=getattr(logging, args.log_level),
        format="%(asctime)s %(message)s" if args.command == "serve" else "%(message)s",
        stream=sys.stderr,
    )
    try:
        match args.command:
            case "generate":
                return _generate(args)
            case "serve":
                return _serve(args)
            case "chaos":
                return chaos_command.run(args)
            case "pull":
                return _pull(args)
            case "bench":
                return bench_harness.run(args)
    except MlxTrioError as exc:
        print(f"mlx-trio: error: {exc.message}", file=sys.stderr)
        return 1
    except BaseExceptionGroup as group:  # from a Trio nursery: serve loads the model in one
        error = _only_error(group)
        if error is None:
            raise
        print(f"mlx-trio: error: {error.message}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    raise AssertionError(f"unhandled command {args.command}")


def _only_error(group: BaseExceptionGroup) -> MlxTrioError | None:
    """The group's one exception, if it is one of ours (a model that failed to load)."""
    leaves: list[BaseException] = []
    pending: list[BaseException] = [group]
    while pending:
        exc = pending.pop()
        if isinstance(exc, BaseExceptionGroup):
            pending.extend(exc.exceptions)
        else:
            leaves.append(exc)
    if len(leaves) == 1 and isinstance(leaves[0], MlxTrioError):
        return leaves[0]
    return None


if __name__ == "__main__":
    sys.exit(main())
