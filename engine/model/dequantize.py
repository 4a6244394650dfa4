"""On CUDA, a quantized model's weights dequantized once at load (issue 39).

MLX's CUDA quantized matmul does not batch: on an H200 the Llama-3.1-8B shape in 4-bit served
64 streams at about 300 tok/s, where the same model in bfloat16 served 2,810, and one stream at
105 tok/s against 114 (issue 39's table). So on CUDA a quantized model is dequantized to its
scales' dtype at load, when the result takes at most ``SHARE`` of the GPU's memory: the
weights then cost what the unquantized model's do (about 4x the 4-bit form), which the memory
budget counts as it measures the loaded model, and rows get the rest. What it gains, measured,
is in design/030.

:func:`wanted` is the policy: on a CUDA GPU, for a model that fits; ``MLX_TRIO_DEQUANTIZE=on|off``
overrides it. Metal keeps the weights as stored (its quantized kernels are the ones mlx-lm is
tuned on); the CPU loader dequantizes to float32 anyway (``loader.py``). A rank's part of a
sharded model keeps the form it was sharded in.
"""

from __future__ import annotations

import logging
import math
from dataclasses import replace

from .. import _blas  # noqa: F401  (loads OpenBLAS: before MLX below)

# isort: split
import mlx.core as mx
import mlx.nn as nn
from mlx_lm.utils import dequantize_model

from ..memory import device_memory_bytes
from .loader import LoadedModel, dequantized_from, main_dtype, quantized_bits, quantized_modules
from .switches import env_switch

logger = logging.getLogger(__name__)

ENV = "MLX_TRIO_DEQUANTIZE"
# The dequantized weights may take at most this share of the GPU's memory; the rest is KV,
# activations and MLX's buffer cache.
SHARE = 0.5


def dequantized_bytes(model: nn.Module) -> int:
    """What ``model``'s quantized weights take once dequantized to their scales' dtype."""
    total = 0
    for module in quantized_modules(model):
        *outer, packed = module.weight.shape
        total += math.prod(outer) * packed * 32 // module.bits * module.scales.dtype.size
    return total


def wanted(loaded: LoadedModel, *, given: bool | None = None) -> bool:
    """Whether to dequantize ``loaded``: never a model that is not quantized; else ``given``
    if not None, else ``MLX_TRIO_DEQUANTIZE`` if set, else on a CUDA GPU when the dequantized
    weights take at most ``SHARE`` of its memory."""
    if not loaded.is_quantized:
        return False
    setting = given if given is not None else env_switch(ENV)
    if setting is not None:
        return setting
    if loaded.device != "gpu" or not mx.cuda.is_available():
        return False
    size, memory = dequantized_bytes(loaded.model), device_memory_bytes(on_gpu=True)
    if size > SHARE * memory:
        logger.info(
            "weights kept quantized: dequantized they would take %.1f GiB of the GPU's %.1f",
            size / 2**30,
            memory / 2**30,
        )
        return False
    return True


def expected(on_gpu: bool) -> bool:
    """Whether a quantized model loaded here would be dequantized, asked without loading it (a
    kernel primer, which loads one layer, cannot tell whether the whole model fits: a model
    too large to dequantize costs only its primers' time)."""
    setting = env_switch(ENV)
    return setting if setting is not None else on_gpu and mx.cuda.is_available()


def dequantize(loaded: LoadedModel) -> LoadedModel:
    """``loaded`` with its quantized layers replaced by plain ones, evaluated."""
    bits = quantized_bits(loaded.model)
    model = dequantize_model(loaded.model)
    mx.eval(model.parameters())
    dtype = main_dtype(model)
    form = f"{dtype}, {dequantized_from(bits)}"
    logger.info("%s: weights %s (CUDA's quantized matmul does not batch)", loaded.model_id, form)
    return replace(loaded, model=model, dtype=dtype, is_quantized=False, weights=form)
