"""``mlx-trio serve``'s flags and the ``ServeOptions`` they make: each flag not given takes
its dataclass's default, so that each default is defined once."""

from __future__ import annotations

import argparse
import os

from ..actors.config import CPU_MAX_BATCH, GPU_MAX_BATCH, RuntimeConfig
from .cli_args import (
    MAX_BYTES,
    MAX_ROWS,
    MAX_SESSIONS,
    MAX_TOKENS,
    PORT,
    TOKENS,
    given,
    integer,
    model,
    nonempty,
    seconds,
)
from .cli_flags import (
    MODEL_HELP,
    add_default_flags,
    add_device,
    add_kv_bits,
    add_memory_limit,
    add_speculative,
    engine_options,
    flag_defaults,
    lora_spec,
)
from .cli_ranks import add_rank_flags
from .http_state import HttpSettings
from .images import ImageSettings
from .server import ServeOptions

RUNTIME = RuntimeConfig()  # the defaults the flags' help shows
HTTP = HttpSettings()
IMAGES = ImageSettings()
SERVE = ServeOptions()


def add_serve_flags(serve: argparse.ArgumentParser) -> None:
    """The serve command's flags: where it listens, the model, the runtime's limits, the HTTP
    edge's settings and the sampling defaults."""
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
    add_device(serve)
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
        help=f"rows per batch (1: no batching; default: {CPU_MAX_BATCH} on the CPU, "
        f"{GPU_MAX_BATCH} on a GPU)",
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
        help="require 'Authorization: Bearer KEY' (or 'x-api-key: KEY'); repeat for several "
        "keys, each with its own prompt-cache entries (default: $MLX_TRIO_API_KEY)",
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
        help="largest request body, 1 KiB to 1 GiB (default: 2 MiB; a vision model's: "
        "2 MiB more than --max-image-bytes as base64)",
    )
    images = serve.add_argument_group("images, for a vision model (design/031-images.md)")
    images.add_argument(
        "--allow-image-urls",
        action="store_true",
        default=None,
        help="fetch http(s) image URLs (never from private or local addresses); default: "
        "only data: URLs and base64 images",
    )
    images.add_argument(
        "--max-image-bytes",
        type=integer(1024, 1 << 30),
        default=None,
        help=f"an image's largest size, sent or fetched (default: {IMAGES.max_bytes})",
    )
    images.add_argument(
        "--max-image-pixels",
        type=integer(1, 1 << 30),
        default=None,
        help=f"an image's largest width x height (default: {IMAGES.max_pixels})",
    )
    add_default_flags(
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
        "--prefill-alone-from",
        type=integer(0, MAX_TOKENS),
        default=None,
        metavar="TOKENS",
        help="prompts with at least this many tokens to prefill go one at a time, not in the "
        "padded batch (0: never; default: the device's, never on CPU, 512 on GPU)",
    )
    serve.add_argument(
        "--lora",
        type=lora_spec,
        action="append",
        default=None,
        metavar="NAME=PATH",
        help="serve an mlx-lm LoRA adapter directory beside the model as the model id NAME "
        "(repeatable; requests name it as their model, or in mlx_lm.server's adapters field; "
        "rows of different adapters share batch steps; default: none)",
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
    add_memory_limit(serve)
    add_kv_bits(serve)
    add_speculative(serve)
    add_rank_flags(serve)


def _once(given: list[str] | None) -> tuple[str, ...] | None:
    """A repeatable flag's values, each once, in order; None if not given."""
    return tuple(dict.fromkeys(given)) if given else None


def _api_keys(given: list[str] | None) -> tuple[str, ...]:
    """``--api-key`` as given (each once), else ``$MLX_TRIO_API_KEY``, else none."""
    if given:
        return tuple(dict.fromkeys(given))
    from_env = os.environ.get("MLX_TRIO_API_KEY")
    return (from_env,) if from_env else ()


def serve_options(args: argparse.Namespace) -> ServeOptions:
    """``serve``'s options from its flags: each flag not given takes its dataclass's default."""
    return given(
        ServeOptions,
        host=args.host,
        port=args.port,
        engine=engine_options(args),
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
            sampling=flag_defaults(args),
            request_timeout_s=args.request_timeout,
            images=given(
                ImageSettings,
                allow_urls=args.allow_image_urls,
                max_bytes=args.max_image_bytes,
                max_pixels=args.max_image_pixels,
            ),
        ),
    )
