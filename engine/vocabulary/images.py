"""Images in a prompt: the bytes a request brought, decoded and checked, and the arrays a
vision model's processor makes of them (design/031-images.md).

Decoding runs where requests are prepared, on a worker thread (``CorePort.prepare``), never
on the event loop. An image is bounded twice: in bytes at the edge (``ImageInput`` is built
only from data under the limit) and in pixels here, from its header, before a pixel is
decoded. Whatever fails, the error names the part (``ImageError``) and nothing decoded stays.
"""

from __future__ import annotations

import io
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from PIL import Image, ImageOps, UnidentifiedImageError

from ..errors import ImageError

FORMATS = ("PNG", "JPEG", "GIF", "WEBP", "BMP")  # what Pillow may open: no PDF, EPS, ...


@dataclass(frozen=True, slots=True)
class ImageInput:
    """One image of a message, as sent: its bytes, the part it came from in its API's words
    (``messages[0].content[1]``), and how many pixels it may have."""

    data: bytes
    where: str
    max_pixels: int

    def __repr__(self) -> str:  # never a megabyte of bytes in a log or a traceback
        return f"ImageInput({self.where}, {len(self.data)} bytes)"


@dataclass(frozen=True, slots=True)
class PreparedImages:
    """A prompt's images as its model's vision tower takes them: ``arrays`` as the processor
    made them (``pixel_values``, ``image_grid_thw``, ... as numpy arrays, which pickle to an
    engine process), and what was sent: how many images, how many pixels in all."""

    arrays: dict[str, np.ndarray]
    num_images: int
    num_pixels: int

    def __repr__(self) -> str:
        return f"PreparedImages({self.num_images} images, {self.num_pixels} pixels)"


def decode_image(image: ImageInput) -> Image.Image:
    """``image`` decoded to RGB, upright (its EXIF orientation applied); raises
    ``ImageError`` for data that is not an image of a known format, an image over its pixel
    limit (read from the header, before decoding) or one that fails to decode."""
    try:
        with warnings.catch_warnings():  # Pillow's bomb warning: the limit below is ours
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            opened = Image.open(io.BytesIO(image.data), formats=FORMATS)
    except Image.DecompressionBombError:  # past twice Pillow's own limit (178 MP)
        raise ImageError(
            image.where, f"the image is over this server's limit of {image.max_pixels} pixels"
        ) from None
    except (UnidentifiedImageError, OSError, ValueError):
        raise ImageError(
            image.where, f"the data is not an image Pillow reads ({', '.join(FORMATS)})"
        ) from None
    with opened:
        width, height = opened.size
        if width * height > image.max_pixels:
            raise ImageError(
                image.where,
                f"the image is {width}x{height} ({width * height} pixels), over this server's "
                f"limit of {image.max_pixels} pixels (--max-image-pixels)",
            )
        try:
            opened.load()
            return ImageOps.exif_transpose(opened).convert("RGB")
        except (OSError, ValueError, SyntaxError, Image.DecompressionBombError) as exc:
            raise ImageError(
                image.where, f"the image could not be decoded ({type(exc).__name__})"
            ) from None


def process_images(
    processor: Any, text: str, images: Sequence[ImageInput]
) -> tuple[list[int], PreparedImages]:
    """Decode ``images``, then let ``processor`` (a Hugging Face style processor: mlx-vlm's)
    resize them and expand each placeholder of the rendered prompt ``text`` into the image's
    tokens: the prompt's token ids and its images' arrays."""
    placeholder = getattr(processor, "image_token", None)
    if placeholder is not None and text.count(placeholder) != len(images):
        raise ImageError(
            images[0].where,
            f"the prompt holds {text.count(placeholder)} image placeholders for "
            f"{len(images)} images (a message's text may not contain {placeholder!r})",
        )
    decoded = [decode_image(image) for image in images]
    num_pixels = sum(d.width * d.height for d in decoded)
    try:
        out = processor(text=[text], images=decoded, padding=False, return_tensors="np")
    except ValueError as exc:  # an aspect ratio the resizer refuses, say
        raise ImageError(images[0].where, f"the model's processor refused it: {exc}") from None
    finally:
        for d in decoded:
            d.close()
    arrays = {k: np.asarray(v) for k, v in out.items() if k not in ("input_ids", "attention_mask")}
    token_ids = np.asarray(out["input_ids"])[0].tolist()
    return token_ids, PreparedImages(arrays, len(images), num_pixels)
