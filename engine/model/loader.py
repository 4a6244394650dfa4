"""Load a resolved model with mlx-lm, in the form that runs fastest on the chosen device.

On CPU, quantized weights are dequantized to float32 once at load: MLX's CPU quantized matmul
is not BLAS-backed, so the 4-bit default model decodes at about 7 tok/s against about 17 tok/s
in float32 with OpenBLAS. On a GPU the weights stay as stored here; on CUDA the engine then
dequantizes them where they fit (``dequantize.py``).
"""

from __future__ import annotations

import json
import logging
import sys
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .. import _blas  # noqa: F401  (loads OpenBLAS: before MLX below)

# isort: split
import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten
from mlx_lm.tokenizer_utils import TokenizerWrapper
from mlx_lm.utils import dequantize_model, load_config, load_tokenizer
from mlx_lm.utils import load_model as mlx_lm_load_model

from .._blas import gfortran_source, openblas_path
from ..devices import Device
from ..errors import InvalidRequestError, UnsupportedModelError
from ..vocabulary.sampling_defaults import NO_DEFAULTS, SamplingDefaults
from .gguf import Progress
from .model_store import resolve_model
from .vision import (
    VisionParts,
    language_model,
    load_processor,
    load_vision_model,
    takes_images,
)

logger = logging.getLogger(__name__)

_FALLBACK_CONTEXT = 2048


@dataclass(frozen=True, slots=True)
class LoadedModel:
    """A model and tokenizer in memory, evaluated and ready to generate; ``sampling_defaults``
    are those of its ``generation_config.json``. ``vision``: a vision-language model's vision
    tower and processor (``vision.py``; None: a text model), ``model`` being its language
    model."""

    model: nn.Module
    tokenizer: TokenizerWrapper
    model_id: str
    path: Path
    dtype: str
    is_quantized: bool
    context_length: int
    device: str
    sampling_defaults: SamplingDefaults = NO_DEFAULTS
    weights: str = ""  # the weights' form where it is not the checkpoint's (dequantized, say)
    vision: VisionParts | None = None

    @property
    def form(self) -> str:
        """The weights' form as they run: ``bfloat16``, ``bfloat16, quantized``, or what the
        engine made of them at load."""
        return self.weights or f"{self.dtype}{', quantized' if self.is_quantized else ''}"


def load_model(
    spec: str | None,
    *,
    device: Device = "auto",
    progress: Progress | None = None,
    split: Callable[[nn.Module], None] | None = None,
) -> LoadedModel:
    """Resolve ``spec`` (see ``resolve_model``) and load it onto ``device``.

    ``split``: keeps this rank's part of the model (``distributed.shard``), applied before any
    weight is read, so that a rank reads only the weights it keeps (a pipeline stage's layers;
    a tensor shard's slices, a tensor at a time): a model larger than one machine's memory
    loads over several.

    ``"cpu"`` and ``"gpu"`` set MLX's default device for the whole process; ``"auto"`` keeps
    the current one. Raises ModelNotFoundError or UnsupportedModelError as ``resolve_model``
    does, UnsupportedModelError when mlx-lm cannot build or fill the model, and
    InvalidRequestError for ``"gpu"`` where MLX sees no GPU. Nothing stays loaded on failure.
    """
    on_cpu = _select_device(device)
    resolved = resolve_model(spec, progress=progress)
    start = time.perf_counter()  # a download's time is not the load's
    vision: VisionParts | None = None
    try:
        if takes_images(resolved.path):
            if split is not None:
                raise UnsupportedModelError("a vision model cannot be split over ranks yet")
            vision, config = load_vision_model(resolved.path, resolved.model_id)
            model = vision.model  # its tower too, cast below; the language model after
        else:
            model, config = mlx_lm_load_model(resolved.path, lazy=split is not None)
        if split is not None:
            split(model)
        tokenizer = load_tokenizer(resolved.path, eos_token_ids=config.get("eos_token_id"))
    except (ValueError, KeyError, OSError, RuntimeError) as exc:
        logger.warning("mlx-lm could not load %s: %s", resolved.model_id, exc)
        if str(exc).startswith("Model type"):
            model_type = _model_type(resolved.path)
            message = f"model type {model_type!r} is not supported by mlx-lm"
        else:
            message = f"mlx-lm could not load model {resolved.model_id!r} ({type(exc).__name__})"
        raise UnsupportedModelError(message) from exc
    weights = ""
    if on_cpu:
        if bits := quantized_bits(model):
            weights = f"float32, {dequantized_from(bits)}"
        # Scales go to float32 first: dequantizing from float16 is much slower on CPU (design/024).
        model.set_dtype(mx.float32)
        model = dequantize_model(model)
    if on_cpu or split is not None:
        mx.eval(model.parameters())
    if vision is not None:
        model = language_model(vision, config)  # on the arrays the cast made
    loaded = LoadedModel(
        model=model,
        tokenizer=tokenizer,
        model_id=resolved.model_id,
        path=resolved.path,
        dtype=main_dtype(model),
        is_quantized=any("scales" in m for _, m in model.named_modules()),
        context_length=_context_length(config, tokenizer),
        device="cpu" if on_cpu else "gpu",
        sampling_defaults=SamplingDefaults.read(resolved.path),
        weights=weights,
        vision=vision,
    )
    logger.info(
        "loaded %s on %s (%s%s, context %d) in %.1f s",
        loaded.model_id,
        loaded.device,
        loaded.dtype,
        ", quantized" if loaded.is_quantized else "",
        loaded.context_length,
        time.perf_counter() - start,
    )
    logger.info("backend: %s", backend_description(loaded.device))
    return loaded


def backend_description(device: str) -> str:
    """What MLX computes on, for the log: ``cuda (NVIDIA H200)``, ``metal (Apple M2)`` or
    ``cpu (<name>, OpenBLAS <path>)``; ``device`` is a LoadedModel's (``"cpu"`` or ``"gpu"``)."""
    if device == "gpu":
        return f"{_gpu_backend()} ({_device_name(mx.gpu)})"
    return f"cpu ({_device_name(mx.cpu)}, {_cpu_blas()})"


def _gpu_backend() -> str:
    if mx.cuda.is_available():
        return "cuda"
    return "metal" if mx.metal.is_available() else "gpu"


def _device_name(device: mx.Device) -> str:
    try:
        return str(mx.device_info(device).get("device_name", "?"))
    except (RuntimeError, ValueError):  # a backend that does not describe its devices
        return "?"


def _cpu_blas() -> str:
    path = openblas_path()
    if path is not None:
        runtime = gfortran_source()
        return f"OpenBLAS {path}" + (f", libgfortran from {runtime}" if runtime else "")
    return "Accelerate" if sys.platform == "darwin" else "reference BLAS"


@dataclass(frozen=True, slots=True)
class LoadedTokenizer:
    """A model's tokenizer and context length, without its weights."""

    tokenizer: TokenizerWrapper
    model_id: str
    context_length: int
    processor: Any = None  # a vision model's (``vision.load_processor``)


def load_tokenizer_only(spec: str | None, *, progress: Progress | None = None) -> LoadedTokenizer:
    """Resolve ``spec`` as ``load_model`` does (importing it first if need be) and load only its
    tokenizer: what an engine process's parent needs to tokenize requests."""
    resolved = resolve_model(spec, progress=progress)
    try:
        config = load_config(resolved.path)
        tokenizer = load_tokenizer(resolved.path, eos_token_ids=config.get("eos_token_id"))
        processor = load_processor(resolved.path) if takes_images(resolved.path) else None
    except (ValueError, KeyError, OSError) as exc:
        message = f"mlx-lm could not load the tokenizer of {resolved.model_id!r}"
        raise UnsupportedModelError(f"{message} ({type(exc).__name__})") from exc
    context = _context_length(config, tokenizer)
    return LoadedTokenizer(tokenizer, resolved.model_id, context, processor)


def _select_device(device: Device) -> bool:
    """Apply ``device`` to MLX's default device; return whether it is the CPU."""
    if device == "cpu":
        mx.set_default_device(mx.cpu)
    elif device == "gpu":
        if not mx.is_available(mx.gpu):
            raise InvalidRequestError(
                "device 'gpu' was requested but MLX sees no GPU", param="device"
            )
        mx.set_default_device(mx.gpu)
    return mx.default_device().type == mx.DeviceType.cpu


def quantized_modules(model: nn.Module) -> list[Any]:
    """``model``'s quantized layers (linears, embeddings, MoE experts)."""
    return [m for _, m in model.named_modules() if "scales" in m and hasattr(m, "bits")]


def quantized_bits(model: nn.Module) -> list[int]:
    """The bit widths of ``model``'s quantized layers, sorted (empty: none)."""
    return sorted({m.bits for m in quantized_modules(model)})


def dequantized_from(bits: list[int]) -> str:
    """How a form dequantized at load says so: ``dequantized from 4-bit at load``."""
    return f"dequantized from {'/'.join(map(str, bits))}-bit at load"


def main_dtype(model: nn.Module) -> str:
    """The floating dtype that holds most of the model's parameter elements."""
    sizes: Counter[str] = Counter()
    for _, value in tree_flatten(model.parameters()):
        if mx.issubdtype(value.dtype, mx.floating):
            sizes[str(value.dtype).removeprefix("mlx.core.")] += value.size
    return sizes.most_common(1)[0][0] if sizes else "unknown"


def _context_length(config: dict[str, Any], tokenizer: TokenizerWrapper) -> int:
    for value in (config.get("max_position_embeddings"), tokenizer.model_max_length):
        if isinstance(value, int) and 0 < value < 10_000_000:
            return value
    logger.warning("the model states no context length; assuming %d", _FALLBACK_CONTEXT)
    return _FALLBACK_CONTEXT


def _model_type(path: Path) -> str | None:
    try:
        return json.loads((path / "config.json").read_text(encoding="utf-8")).get("model_type")
    except (OSError, ValueError):
        return None
