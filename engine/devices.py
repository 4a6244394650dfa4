"""Where a model runs, asked without loading anything (MLX's core alone, not mlx-lm)."""

from __future__ import annotations

from typing import Literal

from . import _blas  # noqa: F401  (loads OpenBLAS: before MLX below)

# isort: split
import mlx.core as mx

Device = Literal["auto", "cpu", "gpu"]


def runs_on_gpu(device: Device) -> bool:
    """Whether a model loaded with ``device`` runs on a GPU (the loader's rule), asked without
    selecting or loading anything."""
    if device == "cpu":
        return False
    return device == "gpu" or mx.default_device().type == mx.DeviceType.gpu
