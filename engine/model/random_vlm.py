"""A tiny random Qwen2-VL or Qwen3.5 checkpoint for mlx-vlm, written to a folder (no download):
its config, weights, byte-level tokenizer with the vision tokens, chat template and image
processor config, as a hub checkpoint has them; the images tests' and benchmark's vision model
(design/031-images.md). Images change its greedy text (its weights are large enough that what
it sees counts), and its head writes printable ASCII only (its other rows are zero, below the
printable ones' maximum), so that every server's detokenizer shows the same text.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .. import _blas  # noqa: F401  (loads OpenBLAS: before MLX below)

# isort: split
import mlx.core as mx
from mlx.utils import tree_flatten, tree_map

from .random_model import byte_level_tokenizer

VISION_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", *VISION_TOKENS]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for c in m['content'] %}"
    "{% if c['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% else %}{{ c['text'] }}{% endif %}{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# The byte-level alphabet sorted: its first 94 symbols are the printable bytes ! to ~.
PRINTABLE_IDS = 94
MAX_PIXELS = 28 * 28 * 16  # the processor resizes to at most 16 merged patches


def save_random_vlm(
    path: Path, *, seed: int = 0, max_pixels: int = MAX_PIXELS, family: str = "qwen2_vl"
) -> Path:
    """The checkpoint in ``path`` (made if need be); ``--model`` and ``mlx_vlm.load`` load it.
    ``max_pixels``: what its processor resizes a larger image down to (28 x 28 a token for
    Qwen2-VL, 32 x 32 for Qwen3.5). ``family``: one of ``FAMILIES``."""
    import importlib

    path.mkdir(parents=True, exist_ok=True)
    wrapper = byte_level_tokenizer([], SPECIALS, eos_token="<|im_end|>")
    tokenizer = wrapper._tokenizer
    tokenizer.pad_token = "<|endoftext|>"
    tokenizer.save_pretrained(str(path))
    (path / "chat_template.jinja").write_text(CHAT_TEMPLATE, encoding="utf-8")
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in SPECIALS}
    config, processor_config = FAMILIES[family](len(tokenizer), max_pixels)
    config.update(
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
        eos_token_id=ids["<|im_end|>"],
        bos_token_id=ids["<|endoftext|>"],
        pad_token_id=ids["<|endoftext|>"],
    )
    (path / "config.json").write_text(json.dumps(config), encoding="utf-8")
    processor_config.update(
        image_mean=[0.48145466, 0.4578275, 0.40821073],
        image_std=[0.26862954, 0.26130258, 0.27577711],
    )
    for name in ("preprocessor_config.json", "video_preprocessor_config.json"):
        (path / name).write_text(json.dumps(processor_config), encoding="utf-8")
    module = importlib.import_module(f"mlx_vlm.models.{family}")
    model_config = module.ModelConfig.from_dict(dict(config))
    text = model_config.text_config
    if isinstance(text, dict):
        model_config.text_config = module.TextConfig.from_dict(text)
    if isinstance(model_config.vision_config, dict):
        model_config.vision_config = module.VisionConfig.from_dict(model_config.vision_config)
    model = module.Model(model_config)
    mx.random.seed(seed)
    model.update(tree_map(lambda p: mx.random.normal(p.shape) * 0.5, model.parameters()))
    if hasattr(model.language_model, "lm_head"):  # a tied head is the embeddings
        head = model.language_model.lm_head.weight
        printable = mx.arange(head.shape[0])[:, None] < PRINTABLE_IDS
        model.language_model.lm_head.weight = mx.where(printable, head, 0.0)
    weights = dict(tree_flatten(model.parameters()))
    mx.save_safetensors(str(path / "model.safetensors"), weights, metadata={"format": "mlx"})
    return path


def _qwen2_vl(vocab_size: int, max_pixels: int) -> tuple[dict[str, Any], dict[str, Any]]:
    config = {
        "model_type": "qwen2_vl",
        "hidden_size": 32,
        "num_hidden_layers": 2,
        "intermediate_size": 64,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "rms_norm_eps": 1e-6,
        "vocab_size": vocab_size,
        "rope_theta": 10000.0,
        "rope_scaling": {"type": "mrope", "mrope_section": [2, 1, 1]},
        "tie_word_embeddings": False,
        "max_position_embeddings": 1024,
        "vision_config": {
            "model_type": "qwen2_vl",
            "depth": 1,
            "embed_dim": 16,
            "hidden_size": 32,
            "num_heads": 2,
            "patch_size": 14,
            "spatial_patch_size": 14,
            "spatial_merge_size": 2,
            "temporal_patch_size": 2,
            "in_channels": 3,
            "mlp_ratio": 2,
        },
    }
    processor = {
        "image_processor_type": "Qwen2VLImageProcessor",
        "processor_class": "Qwen2VLProcessor",
        "patch_size": 14,
        "temporal_patch_size": 2,
        "merge_size": 2,
        "min_pixels": 56 * 56,
        "max_pixels": max_pixels,
    }
    return config, processor


def _qwen3_5(vocab_size: int, max_pixels: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """Qwen3.5: gated delta net layers (a recurrent state) and full attention every other
    layer, interleaved M-RoPE over a quarter of each head; a Qwen3-VL vision tower."""
    text = {
        "model_type": "qwen3_5_text",
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "linear_num_value_heads": 4,
        "linear_num_key_heads": 2,
        "linear_key_head_dim": 8,
        "linear_value_head_dim": 8,
        "linear_conv_kernel_dim": 4,
        "full_attention_interval": 2,
        "rms_norm_eps": 1e-6,
        "vocab_size": vocab_size,
        "max_position_embeddings": 1024,
        "tie_word_embeddings": False,
        "rope_parameters": {
            "rope_type": "default",
            "mrope_section": [1, 1, 0],
            "mrope_interleaved": True,
            "rope_theta": 10000.0,
            "partial_rotary_factor": 0.25,
        },
    }
    config = {
        "model_type": "qwen3_5",
        "tie_word_embeddings": False,
        "text_config": text,
        "vision_config": {
            "model_type": "qwen3_5",
            "depth": 1,
            "hidden_size": 16,
            "intermediate_size": 32,
            "out_hidden_size": 32,
            "num_heads": 2,
            "patch_size": 16,
            "spatial_merge_size": 2,
            "temporal_patch_size": 2,
            "in_channels": 3,
            "num_position_embeddings": 16,
            "deepstack_visual_indexes": [],
        },
    }
    processor = {
        "image_processor_type": "Qwen2VLImageProcessorFast",
        "processor_class": "Qwen3VLProcessor",
        "patch_size": 16,
        "temporal_patch_size": 2,
        "merge_size": 2,
        "size": {"shortest_edge": 64 * 64, "longest_edge": max_pixels},
    }
    return config, processor


def _qwen3_vl(vocab_size: int, max_pixels: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """Qwen3-VL: attention layers with interleaved M-RoPE over the whole head, and deepstack
    (a vision block's features added to the first language layer's image tokens)."""
    config, processor = _qwen3_5(vocab_size, max_pixels)
    config["model_type"] = "qwen3_vl"
    config["text_config"] = {
        "model_type": "qwen3_vl_text",
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "rms_norm_eps": 1e-6,
        "vocab_size": vocab_size,
        "max_position_embeddings": 1024,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
        "rope_scaling": {
            "rope_type": "default",
            "mrope_section": [4, 2, 2],
            "mrope_interleaved": True,
        },
    }
    config["vision_config"].update(model_type="qwen3_vl", depth=2, deepstack_visual_indexes=[0])
    return config, processor


_EXPERTS = {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32}


def _experts(base: Callable[[int, int], tuple[dict[str, Any], dict[str, Any]]], **more: Any):
    """The mixture-of-experts variant of the family ``base`` makes (Qwen3.5-35B-A3B's,
    Qwen3-VL-30B-A3B's): its model types get ``_moe``, its text config experts."""

    def make(vocab_size: int, max_pixels: int) -> tuple[dict[str, Any], dict[str, Any]]:
        config, processor = base(vocab_size, max_pixels)
        family = f"{config['model_type']}_moe"
        config["model_type"] = config["vision_config"]["model_type"] = family
        config["text_config"].update(model_type=f"{family}_text", **_EXPERTS, **more)
        return config, processor

    return make


FAMILIES = {
    "qwen2_vl": _qwen2_vl,
    "qwen3_5": _qwen3_5,
    "qwen3_5_moe": _experts(_qwen3_5, shared_expert_intermediate_size=32),
    "qwen3_vl": _qwen3_vl,
    "qwen3_vl_moe": _experts(_qwen3_vl, decoder_sparse_step=1, mlp_only_layers=[]),
}
