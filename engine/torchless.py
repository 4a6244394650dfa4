"""Torch kept out of the processes that never use it: the engine process, the kernel primers
and the server of a text model.

mlx-lm imports transformers for its tokenizers, and transformers imports torch, and its own
modules built on torch, wherever torch is installed. Neither MLX, mlx-lm's models nor a tokenizer
needs it. Measured on an H100 loan whose system packages hold torch (design/027): importing the
engine's modules took 12-14 s there, where the same import takes 1.8 s on a machine without
torch. A cold start pays it in every process, and the server pays it before it starts the engine
process.

:func:`keep_out` makes torch look absent to the imports that follow: ``sys.modules["torch"]``
set to None, so that ``importlib.util.find_spec("torch")`` answers None and ``import torch``
raises ``ImportError``. transformers then leaves its torch-backed parts out, as it does where
torch is not installed. A vision model's processor may need torch (transformers' fast image
processors do), so its processes keep it; ``MLX_TRIO_TORCH=on`` keeps it everywhere.
"""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

logger = logging.getLogger(__name__)

ENV = "MLX_TRIO_TORCH"


def wanted(model_path: Path | None) -> bool:
    """Whether a process that serves the model at ``model_path`` (None: the embedded default,
    a text model) keeps torch out: unless its config has a vision part, or
    ``MLX_TRIO_TORCH=on``."""
    from .model.vision import vision_family

    if os.environ.get(ENV, "").lower() == "on":
        return False
    return model_path is None or vision_family(model_path) is None


def wanted_for(spec: str | None) -> bool:
    """:func:`wanted` for the model ``spec`` names, where that is known before anything is
    resolved or downloaded: the embedded default (None), a model directory here, or a Hugging
    Face id whose config is in the hub's local cache. A GGUF file, or an id not cached yet,
    keeps torch."""
    from .model.hub import parse_hub_id

    if spec is None:
        return wanted(None)
    path = Path(spec).expanduser()
    if (path / "config.json").is_file():
        return wanted(path)
    hub_id = parse_hub_id(spec)
    if hub_id is None:
        return False
    from huggingface_hub import try_to_load_from_cache  # the cache only: nothing goes online

    config = try_to_load_from_cache(hub_id.repo, "config.json", revision=hub_id.revision)
    return isinstance(config, str) and wanted(Path(config).parent)


def keep_out_for(spec: str | None) -> bool:
    """:func:`keep_out` where :func:`wanted_for` says the model ``spec`` names lets it: what a
    command that serves a model in its own process calls before it imports the engine."""
    return wanted_for(spec) and keep_out()


def keep_out() -> bool:
    """Make torch look absent to this process's later imports, unless it is imported already;
    returns whether it did."""
    if "torch" in sys.modules:
        return sys.modules["torch"] is None
    sys.modules["torch"] = None  # type: ignore[assignment]
    logger.debug("torch kept out of this process (engine/torchless.py)")
    return True
