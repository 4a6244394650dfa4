"""The systems under test, and how to start the two servers with the same model and settings.

``SYSTEMS`` is the harness's table, in its run order: each entry names a system, how it is
started (an in-process ``worker`` subprocess, or a server loaded over HTTP) and what it needs.
Both servers serve the embedded default model in float32 on CPU: mlx-trio dequantizes it at load;
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
from typing import Literal

logger = logging.getLogger(__name__)

SERVERS = ("mlx-trio", "mlx_lm")
F32_MODEL_NAME = "smollm2-135m-instruct-f32"
# mlx-trio runs with --max-batch 32; its batch engine prefills up to 8 prompts at once in chunks
# of 256 tokens (engine/batch.py). mlx_lm.server gets the same: --decode-concurrency 32 (rows
# decoded together), --prompt-concurrency 8 (prompts prefilled together), --prefill-step-size 256.
MAX_BATCH = 32
PREFILL_BATCH = 8
PREFILL_CHUNK = 256
CONVERT_TIMEOUT_S = 600.0
MLX_LM_BACKLOG = 128
# Every system is warmed up the same way once started: prompts 0..3, a few tokens each.
WARMUP_CLIENTS = 4
WARMUP_MAX_TOKENS = 8


@dataclass(frozen=True, slots=True)
class SystemDef:
    """How the harness names a system and starts it: a worker's or a server's system name.

    ``needs``: what must be installed for it, said when it cannot start.
    """

    label: str
    kind: Literal["in-process", "http"]
    system: str
    listen_backlog: int | None = None
    is_single_stream: bool = False
    needs: str = "mlx-lm (installed with mlx-trio)"


SYSTEMS = {
    "stream_generate": SystemDef(
        "mlx-lm stream_generate", "in-process", "stream_generate", is_single_stream=True
    ),
    "batch_generator": SystemDef("mlx-lm BatchGenerator", "in-process", "batch_generator"),
    "mlx-trio-inprocess": SystemDef(
        "mlx-trio in-process", "in-process", "mlx-trio", needs="mlx-trio"
    ),
    "mlx-trio-http": SystemDef("mlx-trio HTTP", "http", "mlx-trio", needs="mlx-trio"),
    "mlx_lm-http": SystemDef("mlx_lm.server", "http", "mlx_lm"),
    # Stock mlx_lm.server listens with socketserver's backlog of 5 and resets connections
    # beyond it in a burst; this one gets a backlog of 128, so every stream is served.
    "mlx_lm-http-backlog": SystemDef(
        f"mlx_lm.server, backlog {MLX_LM_BACKLOG}", "http", "mlx_lm", MLX_LM_BACKLOG
    ),
}


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
    from ...engine.model_store import cache_root, pull_default_model

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
    system: str, port: int, f32_dir: Path | None, *, listen_backlog: int | None = None
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
        if f32_dir is None:
            raise ValueError("mlx_lm.server needs the float32 model (ensure_f32_model)")
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
    raise ValueError(f"unknown server {system!r}; choose from {', '.join(SERVERS)}")
