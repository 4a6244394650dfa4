"""The two servers under test and how to start them with the same model and batch settings.

Both serve the embedded default model in float32 on CPU: mlx-trio dequantizes it at load;
``mlx_lm.server`` gets a float32 copy made once with ``mlx_lm.convert`` into the model cache
(the same procedure: scales to float32, then dequantize), and OpenBLAS loaded before MLX, as
mlx-trio does for itself.
"""

from __future__ import annotations

import logging
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger(__name__)

SYSTEMS = ("mlx-trio", "mlx_lm")
F32_MODEL_NAME = "smollm2-135m-instruct-f32"
# mlx-trio runs with --max-batch 32; its batch engine prefills up to 8 prompts at once in chunks
# of 256 tokens (engine/batch.py). mlx_lm.server gets the same: --decode-concurrency 32 (rows
# decoded together), --prompt-concurrency 8 (prompts prefilled together), --prefill-step-size 256.
MAX_BATCH = 32
PREFILL_BATCH = 8
PREFILL_CHUNK = 256
CONVERT_TIMEOUT_S = 600.0


@dataclass(frozen=True, slots=True)
class ServerSpec:
    """How to start one system's server, and the model id to request (None: ask the server)."""

    system: str
    argv: tuple[str, ...]
    model: str | None


def ensure_f32_model() -> Path:
    """The float32 copy of the default model in the model cache, made once with mlx_lm.convert.

    The conversion runs in a subprocess (OpenBLAS loaded first) into a temporary folder that is
    renamed into place, so an interrupted conversion leaves no half-written model behind.
    """
    from mlx_trio.engine.model_store import cache_root, pull_default_model

    target = cache_root() / "models" / F32_MODEL_NAME
    if (target / "config.json").is_file():
        logger.info("float32 model: %s (cached)", target)
        return target
    source = pull_default_model()
    logger.info("converting %s to float32 at %s", source, target)
    code = (
        "import sys, mlx_trio.engine; from mlx_lm.convert import convert; "
        "convert(hf_path=sys.argv[1], mlx_path=sys.argv[2], dequantize=True, dtype='float32')"
    )
    with tempfile.TemporaryDirectory(prefix=".convert-", dir=target.parent) as tmp:
        staged = Path(tmp) / "model"
        subprocess.run(
            [sys.executable, "-c", code, str(source), str(staged)],
            check=True,
            timeout=CONVERT_TIMEOUT_S,
        )
        staged.rename(target)
    return target


def server_spec(
    system: str, port: int, f32_dir: Path, *, listen_backlog: int | None = None
) -> ServerSpec:
    """The command line for ``system`` listening on 127.0.0.1:``port``.

    ``listen_backlog`` (mlx_lm only): the listening socket's backlog instead of Python
    ``socketserver``'s 5, past which a burst of new connections is reset.
    """
    host = ("--host", "127.0.0.1", "--port", str(port))
    if system == "mlx-trio":
        argv = (sys.executable, "-m", "mlx_trio.api.cli", "serve", *host)
        return ServerSpec(system, (*argv, "--max-batch", str(MAX_BATCH)), model=None)
    if system == "mlx_lm":
        # Importing mlx_trio.engine first loads OpenBLAS before MLX, as mlx-trio does for itself.
        backlog = (
            ""
            if listen_backlog is None
            else f"socketserver.TCPServer.request_queue_size = {listen_backlog}; "
        )
        code = (
            f"import mlx_trio.engine, socketserver, sys; {backlog}from mlx_lm.server import main; "
            "sys.argv[0] = 'mlx_lm.server'; main()"
        )
        flags = (
            ("--decode-concurrency", str(MAX_BATCH)),
            ("--prompt-concurrency", str(PREFILL_BATCH)),
            ("--prefill-step-size", str(PREFILL_CHUNK)),
        )
        model = str(f32_dir.resolve())
        argv = (sys.executable, "-c", code, "--model", model, *host)
        # The request names the model exactly as --model does: mlx_lm.server reloads weights
        # for any other id, and its GET /v1/models fails without a Hugging Face cache.
        return ServerSpec(system, (*argv, *(f for pair in flags for f in pair)), model=model)
    raise ValueError(f"unknown system {system!r}; choose from {', '.join(SYSTEMS)}")
