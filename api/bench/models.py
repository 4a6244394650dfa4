"""The GPU run's model: the Llama-3.2-1B shape with random weights, in bfloat16 or 4-bit.

Built in memory by ``engine/model/random_model.py`` (nothing to download): hidden 2048, 16 layers,
MLP 8192, 32 query and 8 key-value heads, Llama 3's rope scaling, tied embeddings, and a
tokenizer with exactly the 128,256 ids of the real vocabulary (bytes, then made-up words, then
the three special tokens), so the embedding and the LM head are the real size. ``quick`` keeps
the vocabulary and everything else but shrinks the layers to a CPU's size: a check of the
whole path, not a measurement. 4-bit is ``mlx.nn.quantize`` in groups of 64.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from ...engine import _blas  # noqa: F401  (loads OpenBLAS: before MLX below)

# isort: split
import mlx.core as mx
from mlx_lm.models.llama import Model, ModelArgs
from mlx_lm.tokenizer_utils import TokenizerWrapper

from ...engine.generate import Engine
from ...engine.model.random_model import byte_level_tokenizer, in_memory, random_llama

MODEL_ID = "llama-3.2-1b-shaped-random"
VOCAB = 128256
CONTEXT_LENGTH = 131072
SPECIALS = ("<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>")
SHAPE_1B = dict(
    hidden_size=2048,
    num_hidden_layers=16,
    intermediate_size=8192,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=64,
)
# Llama-3.1-8B's shape (its embedding and LM head untied), for the long-prompt runs (issue 38).
SHAPE_8B = dict(
    hidden_size=4096,
    num_hidden_layers=32,
    intermediate_size=14336,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=128,
    tie_word_embeddings=False,
)
SHAPE_QUICK = dict(
    hidden_size=128,
    num_hidden_layers=2,
    intermediate_size=256,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
)


def model_args(quick: bool, shape: str = "1b") -> ModelArgs:
    """The model's arguments: the 1B shape (``shape`` "8b": Llama-3.1-8B's), or ``quick``'s."""
    layers = SHAPE_QUICK if quick else SHAPE_8B if shape == "8b" else SHAPE_1B
    return ModelArgs(
        model_type="llama",
        vocab_size=VOCAB,
        rms_norm_eps=1e-5,
        **{"tie_word_embeddings": True, **layers},  # type: ignore[arg-type]
        rope_theta=500000.0,
        rope_scaling={
            "factor": 32.0,
            "high_freq_factor": 4.0,
            "low_freq_factor": 1.0,
            "original_max_position_embeddings": 8192,
            "rope_type": "llama3",
        },
        max_position_embeddings=CONTEXT_LENGTH,
    )


def make_model(quick: bool, quantized: bool, shape: str = "1b") -> Model:
    """Random weights in bfloat16; ``quantized``: then 4-bit, group 64 (mlx-lm's default)."""
    return random_llama(
        model_args(quick, shape), dtype=mx.bfloat16, quantize_bits=4 if quantized else None
    )


def _words(first: int, stop: int) -> Iterator[str]:
    """A made-up word for each id from ``first`` to ``stop``: the id in base 26, in letters."""
    letters = "abcdefghijklmnopqrstuvwxyz"
    for n in range(first, stop):
        word = ""
        while True:
            n, r = divmod(n, 26)
            word += letters[r]
            if n == 0:
                break
        yield "Ġ" + word


def make_tokenizer() -> TokenizerWrapper:
    """A byte-level BPE tokenizer with exactly VOCAB ids; ids past the bytes decode to words."""
    words = _words(256, VOCAB - len(SPECIALS))
    tokenizer = byte_level_tokenizer(words, SPECIALS, eos_token=SPECIALS[2], bos_token=SPECIALS[0])
    assert len(tokenizer) == VOCAB, len(tokenizer)
    return tokenizer


def device_name() -> str:
    return "cpu" if mx.default_device().type == mx.DeviceType.cpu else "gpu"


def make_engine(model: Any, tokenizer: Any, *, dtype: str, quantized: bool) -> Engine:
    loaded = in_memory(
        model,
        tokenizer,
        MODEL_ID,
        dtype=dtype,
        is_quantized=quantized,
        context_length=CONTEXT_LENGTH,
        device=device_name(),
    )
    return Engine(loaded)


def build_engine(quick: bool, quantized: bool) -> Engine:
    """The whole engine, built where it will run: in an engine process, this is its ``build``."""
    model = make_model(quick, quantized)
    return make_engine(model, make_tokenizer(), dtype="bfloat16", quantized=quantized)
