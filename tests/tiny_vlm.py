"""Images for the images tests; the tiny vision model is ``random_vlm``'s (a folder that
``--model`` and ``mlx_vlm.load`` load)."""

from __future__ import annotations

import base64
import io

import numpy as np
from PIL import Image

from mlx_trio.engine.model.random_vlm import save_random_vlm as build

__all__ = ["build", "data_url", "png"]


def png(width: int, height: int, *, seed: int = 0) -> bytes:
    """A PNG of random colours."""
    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="PNG")
    return out.getvalue()


def data_url(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"
