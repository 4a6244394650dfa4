"""The systems under test, and how to start the two servers with the same model and settings.

``SYSTEMS`` is the harness's table, in its run order: each entry names a system, how it is
started (an in-process ``worker`` subprocess, or a server loaded over HTTP) and what it needs.
Both servers serve the embedded default model in float32 on CPU: mlx-trio dequantizes it at load;
``mlx_lm.server`` gets a float32 copy made once with ``mlx_lm.convert`` into the model cache
(the same procedure: scales to float32, then dequantize), and OpenBLAS loaded before MLX, as
mlx-trio does for itself, at OpenBLAS's own thread count (one a core, or
``OPENBLAS_NUM_THREADS``): what mlx-lm gets with OpenBLAS preloaded. Each server otherwise
runs with its own defaults (mlx_lm.server: 32 rows decoded together, 8 prompts prefilled
together in steps of 2,048 tokens; mlx-trio: its token budget, ``engine/batch/schedule.py``).
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
# The in-process systems batch up to 32 rows; `mlx-trio serve` runs with its default (32 rows
# on the CPU, 256 on a GPU) and mlx_lm.server with its own (32). The in-process raw
# BatchGenerator prefills 8 prompts at once in chunks of 256 tokens, as mlx-trio's batch
# engine did before its token budget (engine/batch/batch.py without one).
MAX_BATCH = 32
PREFILL_BATCH = 8
PREFILL_CHUNK = 256
CONVERT_TIMEOUT_S = 600.0
MLX_LM_BACKLOG = 128
# Every system is warmed up the same way once started: two bursts of 8 streams (prompts 0..7,
# then 8..15), a few tokens each. A server's first burst comes as soon as /health turns 200;
# its TTFT against the next burst's says whether the server's own warm-up left kernels to
# compile for the first users (issue 23: within 2x).
WARMUP_CLIENTS = 8
WARMUP_BURSTS = 2
WARMUP_MAX_TOKENS = 8


@dataclass(frozen=True, slots=True)
class SystemDef:
    """How the harness names a system and starts it: a worker's or a server's system name.

    ``needs``: what must be installed for it, said when it cannot start. ``on_request``: run
    only when asked for (the baseline, which needs ``--baseline``), not by default.
    """

    label: str
    kind: Literal["in-process", "http"]
    system: str
    listen_backlog: int | None = None
    is_single_stream: bool = False
    needs: str = "mlx-lm (installed with mlx-trio)"
    on_request: bool = False


SYSTEMS = {
    "stream_generate": SystemDef(
        "mlx-lm stream_generate", "in-process", "stream_generate", is_single_stream=True
    ),
    "batch_generator": SystemDef("mlx-lm BatchGenerator", "in-process", "batch_generator"),
    "mlx-trio-inprocess": SystemDef(
        "mlx-trio in-process", "in-process", "mlx-trio", needs="mlx-trio"
    ),
    "mlx-trio-http": SystemDef("mlx-trio HTTP", "http", "mlx-trio", needs="mlx-trio"),
    # mlx-trio as another install serves it (--baseline PYTHON: that install's interpreter, say
    # a venv of an earlier commit's checkout), to measure a change against what it changed.
    "mlx-trio-http-baseline": SystemDef(
        "mlx-trio HTTP, baseline",
        "http",
        "mlx-trio",
        needs="--baseline PYTHON, the interpreter of another install of mlx-trio",
        on_request=True,
    ),
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
    renamed into place, so an interrupted conversion leaves no half-written model behind. The
    copy is about 517 MB: where it is and its size are logged, each run, since it stays.
    """
    from ...engine.model.model_store import cache_root, pull_default_model

    target = cache_root() / "models" / F32_MODEL_NAME
    if (target / "config.json").is_file():
        logger.info(
            "float32 copy of the default model for mlx_lm.server: %s (%s, cached; delete it to "
            "free the space)",
            target,
            _size(target),
        )
        return target
    source = pull_default_model()
    logger.info(
        "mlx_lm.server serves the default model in float32: converting %s into a copy at %s",
        source,
        target,
    )
    code = (
        "import sys, mlx_trio.engine; from mlx_lm.convert import convert; "
        "convert(hf_path=sys.argv[1], mlx_path=sys.argv[2], dequantize=True, dtype='float32')"
    )
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".convert-", dir=target.parent) as tmp:
        staged = Path(tmp) / "model"
        subprocess.run(
            [sys.executable, "-c", code, str(source), str(staged)],
            check=True,
            timeout=CONVERT_TIMEOUT_S,
        )
        staged.rename(target)
    logger.warning(
        "wrote a float32 copy of the default model for mlx_lm.server: %s (%s); it stays in the "
        "cache for the next runs (delete it to free the space)",
        target,
        _size(target),
    )
    return target


def _size(directory: Path) -> str:
    """The size of the files in ``directory``, in MB of 2**20 bytes (as ``du -h`` counts)."""
    size = sum(p.stat().st_size for p in directory.rglob("*") if p.is_file())
    return f"{size / 2**20:,.0f} MB"


DEFAULT_SYSTEMS = tuple(key for key, d in SYSTEMS.items() if not d.on_request)
BASELINE = "mlx-trio-http-baseline"


def server_spec(
    system: str,
    port: int,
    f32_dir: Path | None,
    *,
    model_dir: Path | None = None,
    listen_backlog: int | None = None,
    python: str = sys.executable,
) -> ServerSpec:
    """The command line for ``system`` listening on 127.0.0.1:``port``.

    ``model_dir``: the MLX model directory both servers serve instead of the default model
    (mlx_lm.server's float32 copy of it, ``f32_dir``). ``listen_backlog`` (mlx_lm only): the
    listening socket's backlog instead of Python ``socketserver``'s 5, past which a burst of
    new connections is reset. ``python`` (mlx-trio only): the interpreter whose install
    serves.
    """
    host = ("--host", "127.0.0.1", "--port", str(port))
    if system == "mlx-trio":
        argv = (python, "-m", "mlx_trio.api.cli", "serve", *host)
        if model_dir is not None:
            argv += ("--model", str(model_dir.resolve()))
        return ServerSpec(system, argv, model=None)
    if system == "mlx_lm":
        f32_dir = model_dir or f32_dir
        if f32_dir is None:
            raise ValueError("mlx_lm.server needs the float32 model (ensure_f32_model)")
        # Importing mlx_trio.engine._blas first loads OpenBLAS before MLX, as mlx-trio does for
        # itself; then OpenBLAS gets back the thread count it loaded with, which _blas pinned.
        backlog = (
            ""
            if listen_backlog is None
            else f"socketserver.TCPServer.request_queue_size = {listen_backlog}; "
        )
        code = (
            "import os, socketserver, sys; import mlx_trio.engine._blas as blas; "
            "'OPENBLAS_NUM_THREADS' in os.environ or blas.set_threads(blas.own_threads() or 1); "
            f"{backlog}from mlx_lm.server import main; sys.argv[0] = 'mlx_lm.server'; main()"
        )
        model = str(f32_dir.resolve())
        # The request names the model exactly as --model does: mlx_lm.server reloads weights
        # for any other id, and its GET /v1/models fails without a Hugging Face cache.
        return ServerSpec(system, (sys.executable, "-c", code, "--model", model, *host), model)
    raise ValueError(f"unknown server {system!r}; choose from {', '.join(SERVERS)}")
