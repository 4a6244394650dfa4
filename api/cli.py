"""The ``mlx-trio`` command line: ``generate``, ``serve``, ``chaos``, ``pull`` and ``bench``."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Sequence
from typing import NoReturn

from ..actors.config import RuntimeConfig
from ..engine.errors import InvalidRequestError, MlxTrioError
from ..engine.options import EngineOptions
from ..engine.params import MAX_STOP_STRINGS, SamplingParams
from ..engine.sampling_defaults import SamplingDefaults
from . import bench as bench_harness
from .chaos import command as chaos_command
from .cli_args import (
    MAX_BYTES,
    MAX_ROWS,
    MAX_SESSIONS,
    MAX_TOKENS,
    PORT,
    SEED,
    TOKENS,
    HelpFormatter,
    flag_of,
    given,
    hub_id,
    integer,
    logit_bias,
    memory_limit,
    model,
    nonempty,
    number,
    sampling,
    seconds,
)
from .cli_generate import generate
from .cli_ranks import add_rank_flags, rank_group
from .http_state import HttpSettings
from .server import ServeOptions

logger = logging.getLogger("mlx_trio.cli")
ENGINE = EngineOptions()  # the defaults the flags' help shows
RUNTIME = RuntimeConfig()
HTTP = HttpSettings()
SERVE = ServeOptions()


class _Parser(argparse.ArgumentParser):
    """argparse, but an error is one line on stderr and exit status 2; each flag's help
    shows its default."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"mlx-trio: error: {message}\n")


def _add_default_flags(
    group: argparse._ArgumentGroup, *max_tokens_aliases: str, max_tokens: str
) -> None:
    """The flags over the model's ``generation_config.json``; one not given takes the model's
    value, else OpenAI's (for ``--max-tokens``: ``max_tokens``)."""
    fallback = "default: the model's generation_config.json, else"
    group.add_argument(
        "--max-tokens",
        *max_tokens_aliases,
        type=TOKENS,
        default=None,
        help=f"new tokens at most; {fallback} {max_tokens}",
    )
    group.add_argument(
        "--temperature",
        type=sampling("temperature", number),
        default=None,
        help=f"0 to 2, 0: greedy; {fallback} 1",
    )
    group.add_argument(
        "--top-p",
        type=sampling("top_p", number),
        default=None,
        help=f"above 0 to 1; {fallback} 1",
    )
    group.add_argument(
        "--top-k",
        type=integer(0, MAX_TOKENS),
        default=None,
        help=f"0 (off) or below the vocabulary size; {fallback} 0",
    )
    group.add_argument(
        "--min-p",
        type=sampling("min_p", number),
        default=None,
        help=f"0 (off) to 1; {fallback} 0",
    )
    group.add_argument(
        "--repetition-penalty",
        type=sampling("repetition_penalty", number),
        default=None,
        help=f"above 0 to 2, 1: off; {fallback} 1",
    )


def _flag_defaults(args: argparse.Namespace) -> SamplingDefaults:
    """The sampling defaults given as flags (checked: ``InvalidRequestError``)."""
    return SamplingDefaults(
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        min_p=args.min_p,
        repetition_penalty=args.repetition_penalty,
        max_tokens=args.max_tokens,
    )


def _add_sampling_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("sampling")
    _add_default_flags(group, max_tokens="256")
    group.add_argument(
        "--presence-penalty", type=sampling("presence_penalty", number), default=0.0, help="-2 to 2"
    )
    group.add_argument(
        "--frequency-penalty",
        type=sampling("frequency_penalty", number),
        default=0.0,
        help="-2 to 2",
    )
    group.add_argument(
        "--logit-bias",
        type=logit_bias,
        default={},
        help="JSON object of token id to bias, -100 to 100, e.g. '{\"42\": -100}' (default: none)",
    )
    group.add_argument(
        "--seed", type=SEED, default=None, help="reproducible sampling (default: random)"
    )
    group.add_argument(
        "--stop",
        type=nonempty("a stop string"),
        action="append",
        default=[],
        help=f"stop string, up to {MAX_STOP_STRINGS} (repeatable; default: none)",
    )
    group.add_argument(
        "--stop-token-id",
        type=integer(0, MAX_TOKENS),
        action="append",
        default=[],
        help="stop at this token (repeatable; default: the model's end tokens only)",
    )


def _sampling_params(args: argparse.Namespace, defaults: SamplingDefaults) -> SamplingParams:
    """The flags' params, ``defaults`` for the sampling flags not given."""
    return defaults.params(
        presence_penalty=args.presence_penalty,
        frequency_penalty=args.frequency_penalty,
        logit_bias=args.logit_bias,
        seed=args.seed,
        stop=tuple(args.stop),
        stop_token_ids=tuple(args.stop_token_id),
    )


def _add_device(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--device",
        choices=["auto", "cpu", "gpu"],
        default=None,
        help=f"auto: a GPU if any (default: {ENGINE.device})",
    )


def _add_memory_limit(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--memory-limit",
        type=memory_limit,
        default=None,
        help="memory budget: bytes (6GB, 512MiB) or a share of the device's memory (0.3, 30%%); "
        "weights, activations and KV cache stay within it, requests wait for KV room "
        "(default: 0.9 of a GPU's memory, 0.5 of the CPU's)",
    )


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
    _add_device(generate)
    _add_memory_limit(generate)
    _add_sampling_flags(generate)
    add_rank_flags(generate)

    serve = command("serve", help="serve an OpenAI-compatible HTTP API")
    serve.add_argument(
        "--host",
        type=nonempty("--host"),
        default=None,
        help=f"address to listen on (default: {SERVE.host})",
    )
    serve.add_argument(
        "--port",
        type=PORT,
        default=None,
        help=f"port to listen on (0: any free; default: {SERVE.port})",
    )
    serve.add_argument(
        "--model",
        type=model,
        default=None,
        help=MODEL_HELP,
    )
    _add_device(serve)
    serve.add_argument(
        "--engine",
        choices=["auto", "thread", "process"],
        default=None,
        help="run the model on a thread beside the server or in a process of its own "
        "(default: a process on a GPU, a thread on CPU)",
    )
    serve.add_argument(
        "--max-batch",
        type=integer(1, MAX_ROWS),
        default=None,
        help=f"rows per batch (1: no batching; default: {RUNTIME.max_batch})",
    )
    serve.add_argument(
        "--max-live",
        type=integer(1, MAX_SESSIONS),
        default=None,
        help="admitted sessions (default: 2x --max-batch, at least 4)",
    )
    serve.add_argument(
        "--max-queued",
        type=integer(0, MAX_SESSIONS),
        default=None,
        help=f"sessions waiting for admission (default: {RUNTIME.max_queued})",
    )
    serve.add_argument(
        "--max-n",
        type=integer(1, MAX_ROWS),
        default=None,
        help="the most choices a request may ask for: n times its prompts (completions; "
        f"default: {HTTP.max_n})",
    )
    serve.add_argument(
        "--api-key",
        type=nonempty("--api-key"),
        action="append",
        default=None,
        help="require 'Authorization: Bearer KEY'; repeat for several keys, each with its own "
        "prompt-cache entries (default: $MLX_TRIO_API_KEY)",
    )
    serve.add_argument(
        "--served-model-name",
        type=nonempty("--served-model-name"),
        nargs="+",
        default=None,
        metavar="NAME",
        help="the names requests may give the model, listed by /v1/models (several: an agent's "
        "own model names); default: the model's id",
    )
    serve.add_argument(
        "--allowed-origins",
        type=nonempty("--allowed-origins"),
        nargs="+",
        default=None,
        metavar="ORIGIN",
        help="browser origins allowed by CORS ('*' for any); default: none",
    )
    serve.add_argument(
        "--max-body-bytes",
        type=integer(1024, 1 << 30),
        default=None,
        help=f"largest request body, 1 KiB to 1 GiB (default: {HTTP.max_body_bytes})",
    )
    _add_default_flags(
        serve.add_argument_group("sampling defaults, for what a request omits"),
        "--default-max-tokens",
        max_tokens="512 (chat), 16 (completions)",
    )
    serve.add_argument(
        "--request-timeout",
        type=seconds(),
        default=None,
        help="seconds a request may take (default: none)",
    )
    serve.add_argument(
        "--idle-timeout",
        type=seconds(),
        default=None,
        help=f"seconds a reader may stall (default: {RUNTIME.idle_timeout_s:g})",
    )
    serve.add_argument(
        "--step-timeout",
        type=seconds(),
        default=None,
        help=f"engine step watchdog, seconds (default: {RUNTIME.step_timeout_s:g})",
    )
    serve.add_argument(
        "--steps-per-call",
        type=integer(1, 1024),
        default=None,
        help="batch steps per engine call (default: picked per call; 1 on CPU)",
    )
    serve.add_argument(
        "--shutdown-grace",
        type=seconds(zero=True),
        default=None,
        help="seconds in-flight requests get to finish on shutdown "
        f"(default: {RUNTIME.shutdown_grace_s:g})",
    )
    serve.add_argument(
        "--max-preparation-tokens",
        type=TOKENS,
        default=None,
        help="prompt tokens prefilled together (default: the device's, 1024 on CPU, 32768 GPU)",
    )
    serve.add_argument(
        "--max-iteration-tokens",
        type=TOKENS,
        default=None,
        help="tokens a batch step processes: one per decoding row, the rest prompt chunks "
        "(default: the device's, 256 on CPU, 8192 on GPU)",
    )
    serve.add_argument(
        "--engine-restarts",
        type=integer(0, 1000),
        default=None,
        help="restarts of a dead or wedged engine within 10 minutes before giving up (0: never; "
        f"default: {RUNTIME.max_engine_restarts})",
    )
    serve.add_argument(
        "--prompt-cache-bytes",
        type=integer(0, MAX_BYTES),
        default=None,
        help="prompt cache budget (default: 1/8 of memory, at most 8 GiB; 0 turns it off)",
    )
    _add_memory_limit(serve)
    add_rank_flags(serve)

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


def _once(given: list[str] | None) -> tuple[str, ...] | None:
    """A repeatable flag's values, each once, in order; None if not given."""
    return tuple(dict.fromkeys(given)) if given else None


def _api_keys(given: list[str] | None) -> tuple[str, ...]:
    """``--api-key`` as given (each once), else ``$MLX_TRIO_API_KEY``, else none."""
    if given:
        return tuple(dict.fromkeys(given))
    from_env = os.environ.get("MLX_TRIO_API_KEY")
    return (from_env,) if from_env else ()


MODEL_HELP = (
    "model directory, GGUF file or Hugging Face id org/name[@revision] "
    "(default: SmolLM2-135M-Instruct)"
)


def _engine_options(args: argparse.Namespace) -> EngineOptions:
    """The engine's options the flags give (``EngineOptions``' defaults for the rest)."""
    engine = getattr(args, "engine", None)
    return given(
        EngineOptions,
        model=args.model,
        device=args.device,
        memory_limit=args.memory_limit,
        prompt_cache_bytes=getattr(args, "prompt_cache_bytes", None),
        max_preparation_tokens=getattr(args, "max_preparation_tokens", None),
        max_iteration_tokens=getattr(args, "max_iteration_tokens", None),
        engine_process=None if engine in (None, "auto") else engine == "process",
        ranks=rank_group(args),
    )


def _generate(args: argparse.Namespace) -> int:
    flags = _flag_defaults(args)
    return generate(
        args, _engine_options(args), lambda model: _sampling_params(args, flags.over(model)), flags
    )


def serve_options(args: argparse.Namespace) -> ServeOptions:
    """``serve``'s options from its flags: each flag not given takes its dataclass's default."""
    return given(
        ServeOptions,
        host=args.host,
        port=args.port,
        engine=_engine_options(args),
        runtime=given(
            RuntimeConfig,
            max_batch=args.max_batch,
            max_live=args.max_live,
            max_queued=args.max_queued,
            idle_timeout_s=args.idle_timeout,
            step_timeout_s=args.step_timeout,
            shutdown_grace_s=args.shutdown_grace,
            steps_per_call=args.steps_per_call,
            max_engine_restarts=args.engine_restarts,
        ),
        http=given(
            HttpSettings,
            api_keys=_api_keys(args.api_key),
            served_model_names=_once(args.served_model_name),
            allowed_origins=_once(args.allowed_origins),
            max_body_bytes=args.max_body_bytes,
            max_n=args.max_n,
            sampling=_flag_defaults(args),
            request_timeout_s=args.request_timeout,
        ),
    )


def _serve(args: argparse.Namespace) -> int:
    import trio

    from .server import serve

    trio.run(serve, serve_options(args))
    return 0


def _pull(args: argparse.Namespace) -> int:
    from ..engine.hub import pull_hub_model
    from ..engine.model_store import pull_default_model

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
            _sampling_params(args, _flag_defaults(args))
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
