"""A hybrid model directory for the CPU bench: Qwen3.5's layers at SmolLM2-135M's width.

Qwen3.5 interleaves linear-attention layers (a gated delta net: a recurrent state, mlx-lm's
``ArraysCache``) with full attention, one in four. No small Qwen3.5 checkpoint ships on the
package index, so this writes mlx-lm's own ``qwen3_5`` model with seeded random weights, about the
default model's size and speed (hidden 576, 24 layers, float32), and the default model's
tokenizer and chat template, as an mlx-lm directory that ``mlx-trio bench --model-dir`` (every
system: mlx-trio and mlx_lm.server) and ``serve --model`` load. Random weights cost per step what
trained ones cost, which is what a throughput comparison needs.

    python -m bench.hybrid_model DIR
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import mlx_trio.engine._blas  # noqa: F401  (loads OpenBLAS: before MLX below)

# isort: split
import mlx.core as mx
from mlx_lm.models import qwen3_5
from mlx_lm.utils import save_model

from mlx_trio.engine.model.model_store import pull_default_model

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def config(vocab_size: int) -> dict[str, object]:
    return {
        "model_type": "qwen3_5",
        "hidden_size": 576,
        "intermediate_size": 1536,
        "num_hidden_layers": 24,
        "num_attention_heads": 8,
        "num_key_value_heads": 2,
        "head_dim": 64,
        "linear_num_value_heads": 8,
        "linear_num_key_heads": 4,
        "linear_key_head_dim": 64,
        "linear_value_head_dim": 64,
        "linear_conv_kernel_dim": 4,
        "full_attention_interval": 4,
        "rms_norm_eps": 1e-6,
        "vocab_size": vocab_size,
        "max_position_embeddings": 8192,
        "tie_word_embeddings": True,
    }


def build(path: Path, *, seed: int = 0) -> Path:
    default = pull_default_model()
    vocab_size = json.loads((default / "config.json").read_text(encoding="utf-8"))["vocab_size"]
    cfg = config(vocab_size)
    mx.random.seed(seed)
    model = qwen3_5.Model(qwen3_5.ModelArgs.from_dict(cfg))
    mx.eval(model.parameters())
    path.mkdir(parents=True, exist_ok=True)
    save_model(path, model)
    (path / "config.json").write_text(json.dumps(cfg, indent=2), encoding="utf-8")
    for name in TOKENIZER_FILES:
        shutil.copy(default / name, path / name)
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("path", type=Path, help="the model directory to write")
    args = parser.parse_args()
    print(build(args.path))


if __name__ == "__main__":
    main()
