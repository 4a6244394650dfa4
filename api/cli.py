"""The ``mlx-trio`` command line: ``generate`` and ``pull``."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Sequence
from typing import NoReturn

from mlx_trio.engine.errors import MlxTrioError
from mlx_trio.engine.params import SamplingParams

logger = logging.getLogger("mlx_trio.cli")


class _Parser(argparse.ArgumentParser):
    """argparse, but an error is one line on stderr and exit status 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"mlx-trio: error: {message}\n")


def _add_sampling_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("sampling")
    group.add_argument("--max-tokens", type=int, default=256)
    group.add_argument(
        "--temperature", type=float, default=0.0, help="0 (the default) decodes greedily"
    )
    group.add_argument("--top-p", type=float, default=1.0)
    group.add_argument("--top-k", type=int, default=0)
    group.add_argument("--min-p", type=float, default=0.0)
    group.add_argument("--repetition-penalty", type=float, default=1.0)
    group.add_argument("--presence-penalty", type=float, default=0.0)
    group.add_argument("--frequency-penalty", type=float, default=0.0)
    group.add_argument(
        "--logit-bias", type=json.loads, default={}, help="JSON object, e.g. '{\"42\": -100}'"
    )
    group.add_argument("--seed", type=int, default=None)
    group.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    group.add_argument("--stop-token-id", type=int, action="append", default=[])


def _sampling_params(args: argparse.Namespace) -> SamplingParams:
    if not isinstance(args.logit_bias, dict):
        raise MlxTrioError("--logit-bias must be a JSON object of token id to bias")
    try:
        logit_bias = {int(k): float(v) for k, v in args.logit_bias.items()}
    except (TypeError, ValueError) as exc:
        raise MlxTrioError(f"--logit-bias: {exc}") from None
    return SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        min_p=args.min_p,
        repetition_penalty=args.repetition_penalty,
        presence_penalty=args.presence_penalty,
        frequency_penalty=args.frequency_penalty,
        logit_bias=logit_bias,
        seed=args.seed,
        stop=tuple(args.stop),
        stop_token_ids=tuple(args.stop_token_id),
    )


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="mlx-trio", description="Concurrent LLM inference on MLX and Trio.")
    parser.add_argument(
        "--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"]
    )
    commands = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    generate = commands.add_parser("generate", help="stream a completion to stdout")
    generate.add_argument("prompt")
    generate.add_argument(
        "--model",
        default=None,
        help="model directory or GGUF file (default: SmolLM2-135M-Instruct)",
    )
    generate.add_argument("--raw", action="store_true", help="plain completion, no chat template")
    generate.add_argument("--system", default=None, help="system message (chat only)")
    generate.add_argument("--device", choices=["auto", "cpu", "gpu"], default="auto")
    _add_sampling_flags(generate)

    pull = commands.add_parser("pull", help="fetch and import the embedded default model")
    pull.add_argument("--force", action="store_true", help="re-download and re-import")
    return parser


def _generate(args: argparse.Namespace) -> int:
    from mlx_trio.engine.generate import Engine
    from mlx_trio.engine.prompt import ChatMessage

    params = _sampling_params(args)
    engine = Engine.load(args.model, device=args.device)
    if args.raw:
        prompt: str | list[ChatMessage] = args.prompt
    else:
        prompt = [ChatMessage("user", args.prompt)]
        if args.system is not None:
            prompt.insert(0, ChatMessage("system", args.system))
    generation = engine.generate(engine.prepare(prompt, params))
    finish = None
    for delta in generation:
        sys.stdout.write(delta.text)
        sys.stdout.flush()
        finish = delta.finish_reason
    sys.stdout.write("\n")
    stats = generation.stats()
    logger.info(
        "%s: %d prompt tokens, %d generated (finish: %s), prefill %.2f s, decode %.1f tok/s",
        engine.model_id,
        stats.prompt_tokens,
        stats.generated_tokens,
        finish,
        stats.prefill_s,
        stats.decode_tokens_per_s,
    )
    return 0


def _pull(args: argparse.Namespace) -> int:
    from mlx_trio.engine.model_store import pull_default_model

    path = pull_default_model(force=args.force)
    print(path)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=getattr(logging, args.log_level), format="%(message)s", stream=sys.stderr
    )
    try:
        match args.command:
            case "generate":
                return _generate(args)
            case "pull":
                return _pull(args)
    except MlxTrioError as exc:
        print(f"mlx-trio: error: {exc.message}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    raise AssertionError(f"unhandled command {args.command}")


if __name__ == "__main__":
    sys.exit(main())
