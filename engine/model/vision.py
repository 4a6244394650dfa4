"""Vision-language models through mlx-vlm (design/031-images.md).

A checkpoint whose ``config.json`` has a ``vision_config`` is loaded by mlx-vlm: its vision
tower, its language model and its processor. The engine runs the language model as any other
model (:class:`LanguageModelOnly`: tokens in, logits out, mlx-lm's caches), so text-only
requests batch as they do on a text model; a request with images is prefilled from the
embeddings the whole model makes of its tokens and pixels (:func:`prefill_with_images`), on
the serial lane, then decodes as text.

The families here are those whose language model places tokens with M-RoPE (three position
components, text tokens on the diagonal): the wrapper gives every token its explicit position,
``offset + i`` on all three, and an image prompt's positions are shifted by the constant
that makes its last token's position its index, which RoPE, relative, does not see. Qwen3.5's
text runs through mlx-lm's own class instead, on the same weights (``TEXT_THROUGH_MLX_LM``):
its text positions are plain RoPE's, which interleaved M-RoPE is on the diagonal. Other
vision-language checkpoints load through mlx-lm as text models (:func:`takes_images`).
"""

from __future__ import annotations

import importlib.util
import json
import logging
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .. import _blas  # noqa: F401  (loads OpenBLAS: before MLX below)

# isort: split
import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from ..errors import UnsupportedModelError
from ..vocabulary.images import PreparedImages

logger = logging.getLogger(__name__)

# mlx-vlm model types whose language model takes explicit M-RoPE ``position_ids``: Qwen2-VL's
# and Qwen2.5-VL's (sections one after another), Qwen3-VL's (interleaved; its image prompt also
# adds deepstack features to early layers) and Qwen3.5's (interleaved, over a part of each head).
FAMILIES = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe", "qwen3_5", "qwen3_5_moe")
# Families whose text runs through mlx-lm's own class for the language model, sharing mlx-vlm's
# weights: Qwen3.5's gated delta net layers keep recurrent caches, which mlx-lm's batch merges
# and pads as for the text-only checkpoint, and mlx-vlm's model batches its own way. Its image
# prompt is prefilled by mlx-vlm's language model into mlx-vlm's caches, whose state then goes
# to mlx-lm's (the same arrays: a conv window and a recurrent state, keys and values).
TEXT_THROUGH_MLX_LM = ("qwen3_5", "qwen3_5_moe")


@dataclass(frozen=True, slots=True)
class VisionParts:
    """What a vision-language model adds to its language model: mlx-vlm's whole model (the
    vision tower and the embeddings) and the processor that turns images into its input."""

    model: nn.Module
    processor: Any
    family: str


def vision_family(path: Path) -> str | None:
    """The model type of the checkpoint at ``path`` where it is a vision-language model (its
    config has a ``vision_config``), else None."""
    try:
        config = json.loads((path / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(config, dict) or not isinstance(config.get("vision_config"), dict):
        return None
    return str(config.get("model_type"))


def takes_images(path: Path) -> bool:
    """Whether the checkpoint at ``path`` loads here as a vision model: a vision-language
    model of a family in ``FAMILIES``, with mlx-vlm installed. Others load through mlx-lm as
    they did before images (Gemma 3, Mistral 3 and others: mlx-lm drops their vision
    weights), their language model serving text, and an image request to them is refused."""
    family = vision_family(path)
    if family is None:
        return False
    if family not in FAMILIES:
        logger.info(
            "%s: a vision model of type %r, whose images this server does not take yet "
            "(it takes %s); its language model serves text",
            path.name,
            family,
            ", ".join(FAMILIES),
        )
        return False
    if not has_vision_weights(path):
        logger.info(
            "%s: a vision model's config without vision weights (a text-only conversion); "
            "its language model serves text",
            path.name,
        )
        return False
    if importlib.util.find_spec("mlx_vlm") is None:
        logger.warning(
            "%s: a vision model, and mlx-vlm is not installed (scripts/setup.sh installs it); "
            "its language model serves text",
            path.name,
        )
        return False
    return True


# Where a checkpoint's vision tower lives, by its weights' names: mlx-vlm's and Hugging Face's.
VISION_WEIGHTS = ("vision_tower.", "visual.", "model.visual.", "vision_model.")


def has_vision_weights(path: Path) -> bool:
    """Whether the checkpoint at ``path`` holds a vision tower's weights, by their names in its
    safetensors index or headers (a text-only conversion of a vision model, as mlx-lm makes,
    keeps the ``vision_config`` and drops the tower)."""
    index = path / "model.safetensors.index.json"
    try:
        if index.is_file():
            names: Iterable[str] = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        else:
            names = [name for file in path.glob("*.safetensors") for name in _header(file)]
    except (OSError, ValueError, KeyError, TypeError):
        return False
    return any(name.startswith(VISION_WEIGHTS) for name in names)


def _header(file: Path) -> dict[str, Any]:
    """A safetensors file's header: its tensors by name (a length, then that much JSON)."""
    with file.open("rb") as stream:
        size = int.from_bytes(stream.read(8), "little")
        return json.loads(stream.read(size))


def load_vision_model(path: Path, model_id: str) -> tuple[VisionParts, dict[str, Any]]:
    """Load the checkpoint at ``path`` with mlx-vlm: its whole model, processor and config
    (:func:`takes_images` first); :func:`language_model` then gives the model the engine runs.
    Raises ``UnsupportedModelError`` for a checkpoint mlx-vlm cannot build."""
    from mlx_vlm.utils import load_config
    from mlx_vlm.utils import load_model as vlm_load_model

    config = load_config(path)
    family = config.get("model_type")
    try:
        model = vlm_load_model(path)
        processor = load_processor(path)
    except (ValueError, KeyError, OSError, RuntimeError) as exc:
        logger.warning("mlx-vlm could not load %s: %s", model_id, exc)
        raise UnsupportedModelError(
            f"mlx-vlm could not load model {model_id!r} ({type(exc).__name__})"
        ) from exc
    return VisionParts(model, processor, family), config


def language_model(parts: VisionParts, config: dict[str, Any]) -> nn.Module:
    """The model the engine runs for text: :class:`LanguageModelOnly` over mlx-vlm's language
    model, or, for a ``TEXT_THROUGH_MLX_LM`` family, mlx-lm's own class holding the same arrays
    (no copy; quantized as they are). Made once the whole model has its final dtype: a cast
    makes new arrays."""
    if parts.family not in TEXT_THROUGH_MLX_LM:
        return LanguageModelOnly(parts.model.language_model)
    from mlx_lm.utils import _get_classes

    model_class, args_class = _get_classes(config)
    text = model_class(args_class.from_dict(config))
    weights = {
        f"language_model.{k}": v for k, v in tree_flatten(parts.model.language_model.parameters())
    }
    quantization = config.get("quantization")
    if any(k.endswith(".scales") for k in weights) and isinstance(quantization, dict):
        nn.quantize(
            text,
            group_size=quantization["group_size"],
            bits=quantization["bits"],
            mode=quantization.get("mode", "affine"),
            class_predicate=lambda p, _m: f"{p}.scales" in weights,
        )
    try:
        text.load_weights(list(weights.items()), strict=True)
    except ValueError as exc:  # names or shapes that do not match
        logger.warning("mlx-lm's %s class does not take mlx-vlm's arrays: %s", parts.family, exc)
        raise UnsupportedModelError(
            f"mlx-lm's {parts.family} class does not take this checkpoint's weights"
        ) from exc
    return text


def load_processor(path: Path) -> Any:
    """The checkpoint's processor (mlx-vlm's, as ``mlx_vlm.load`` makes it), for preparing
    requests; offline where the files are all there."""
    from mlx_vlm.utils import load_processor as vlm_load_processor

    return vlm_load_processor(path, add_detokenizer=False)


class LanguageModelOnly(nn.Module):
    """A vision model's language model as mlx-lm calls a model: ``model(tokens, cache=...)``
    gives logits, every token at its explicit position (its cache's offset on), so rows of a
    batch, each at its own offset, and decode after an image prefill place tokens right."""

    def __init__(self, language_model: nn.Module) -> None:
        super().__init__()
        self.language_model = language_model

    @property
    def layers(self) -> list[nn.Module]:
        return self.language_model.layers

    def __call__(
        self, inputs: mx.array, cache: list[Any] | None = None, input_embeddings: Any = None
    ) -> mx.array:
        offset = cache[0].offset if cache else 0
        out = self.language_model(
            inputs,
            inputs_embeds=input_embeddings,
            cache=cache,
            position_ids=text_positions(offset, *inputs.shape),
        )
        return out.logits


def text_positions(offset: int | mx.array, batch: int, length: int) -> mx.array:
    """M-RoPE positions (3, batch, length) of text tokens after ``offset`` (one per row where
    it is an array, as a batch's caches keep it)."""
    steps = mx.arange(length)
    if isinstance(offset, mx.array) and offset.ndim > 0:
        rows = offset.reshape(-1, 1) + steps
    else:
        rows = mx.broadcast_to(int(offset) + steps, (batch, length))
    return mx.broadcast_to(rows[None], (3, batch, length))


def prefill_with_images(
    parts: VisionParts,
    tokens: list[int],
    images: PreparedImages,
    kv: list[Any],
    *,
    step: int,
    on_progress: Callable[[int, int], None] | None,
) -> Iterator[int]:
    """Prefill ``kv`` with a prompt's ``tokens`` but the last, from the embeddings the whole
    model makes of its tokens and ``images``, in chunks of ``step`` tokens, yielding the
    tokens done after each (lazy: nothing runs until iterated; closed early, it stops between
    chunks). The last token then decodes through :class:`LanguageModelOnly` at its index."""
    model = parts.model
    # Qwen3.5's prefill runs in mlx-vlm's own caches, handed to ``kv`` (mlx-lm's) at the end.
    through = parts.family in TEXT_THROUGH_MLX_LM
    own = model.language_model.make_cache() if through else kv
    ids = mx.array(tokens)[None]
    arrays = {k: mx.array(v) for k, v in images.arrays.items()}
    features = model.get_input_embeddings(ids, arrays.pop("pixel_values"), **arrays)
    embeds = features.inputs_embeds
    positions = features.position_ids - features.rope_deltas.reshape(1, -1, 1)
    mx.eval(embeds, positions)
    # Qwen3-VL's deepstack: features of vision blocks added to the image tokens of its first
    # layers; it takes the whole prompt's mask and features, and picks a chunk's by the offset.
    deepstack = {}
    if features.deepstack_visual_embeds is not None:
        deepstack = {
            "visual_pos_masks": features.visual_pos_masks,
            "deepstack_visual_embeds": features.deepstack_visual_embeds,
        }
    total = len(tokens)
    for start in range(0, total - 1, step):
        end = min(start + step, total - 1)
        model.language_model(
            ids[:, start:end],
            inputs_embeds=embeds[:, start:end],
            cache=own,
            position_ids=positions[:, :, start:end],
            **deepstack,
        )
        mx.eval([c.state for c in own])
        if end == total - 1 and own is not kv:
            _hand_over(own, kv)
        if on_progress is not None:
            on_progress(end, total)
        yield end


def _hand_over(own: list[Any], kv: list[Any]) -> None:
    """Give mlx-lm's caches ``kv`` the state of mlx-vlm's ``own``, layer by layer: keys and
    values up to the offset, or a recurrent layer's arrays."""
    for source, target in zip(own, kv, strict=True):
        if hasattr(target, "keys"):
            keys, values = source.state[:2]
            target.keys, target.values, target.offset = keys, values, keys.shape[2]
        else:
            target.cache = list(source.cache)
