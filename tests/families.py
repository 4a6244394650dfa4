"""Tiny random models of the mlx-lm families users serve, built in memory (no download).

Each is a few layers of mlx-lm's own model class for that family, with seeded random weights
and the tests' byte-level tokenizer (``tests/tiny.py``), so its caches are the family's real
ones: key-value caches (llama, qwen3, the MoE families), sliding windows shorter than the tests'
prompts (gemma3_text, gpt_oss: ``RotatingKVCache``), recurrent states beside attention
(qwen3_5, qwen3_next: ``ArraysCache``; falcon_h1: a ``CacheList`` of both in each layer) or
alone (mamba2), and a 4-bit checkpoint. The
reference for every test is mlx-lm's own greedy ``generate_step`` over the same model.
"""

from __future__ import annotations

import importlib
import json
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.generate import generate_step
from mlx_lm.utils import save_model

from mlx_trio.engine.generate import Engine
from mlx_trio.engine.model.random_model import in_memory
from tests.tiny import make_tokenizer

WINDOW = 16  # the sliding windows: shorter than most test prompts
_ATTENTION = dict(
    hidden_size=64,
    intermediate_size=128,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    rms_norm_eps=1e-5,
    max_position_embeddings=512,
    tie_word_embeddings=False,
    rope_theta=10000.0,
)
_LINEAR = dict(  # Qwen3.5's and Qwen3-Next's gated delta net layers
    linear_num_value_heads=4,
    linear_num_key_heads=2,
    linear_key_head_dim=16,
    linear_value_head_dim=16,
    linear_conv_kernel_dim=4,
    full_attention_interval=2,  # every other layer full attention
)
_MOE = dict(
    num_experts=4,
    num_experts_per_tok=2,
    decoder_sparse_step=1,
    mlp_only_layers=[],
    moe_intermediate_size=32,
    norm_topk_prob=True,
)

# config.json of each family, less its vocabulary size; "quantization" makes it 4-bit.
CONFIGS: dict[str, dict[str, Any]] = {
    "llama": dict(model_type="llama", num_hidden_layers=2, **_ATTENTION),
    "llama-4bit": dict(
        model_type="llama",
        num_hidden_layers=2,
        quantization={"group_size": 32, "bits": 4},
        **_ATTENTION,
    ),
    "qwen3": dict(model_type="qwen3", num_hidden_layers=2, **_ATTENTION),
    "gemma3_text": dict(
        model_type="gemma3_text",
        num_hidden_layers=3,
        sliding_window=WINDOW,
        sliding_window_pattern=3,  # two windowed layers, then a global one
        query_pre_attn_scalar=16,
        **{k: v for k, v in _ATTENTION.items() if k != "tie_word_embeddings"},
    ),
    "qwen3_moe": dict(model_type="qwen3_moe", num_hidden_layers=2, **_ATTENTION, **_MOE),
    "gpt_oss": dict(
        model_type="gpt_oss",
        num_hidden_layers=2,
        num_local_experts=4,
        num_experts_per_tok=2,
        sliding_window=WINDOW,
        layer_types=["sliding_attention", "full_attention"],
        **{k: v for k, v in _ATTENTION.items() if k != "tie_word_embeddings"},
    ),
    "qwen3_5": dict(model_type="qwen3_5", num_hidden_layers=4, **_ATTENTION, **_LINEAR),
    "qwen3_next": dict(
        model_type="qwen3_next",
        num_hidden_layers=4,
        shared_expert_intermediate_size=64,
        partial_rotary_factor=0.25,
        **_ATTENTION,
        **_LINEAR,
        **_MOE,
    ),
    "mamba2": dict(
        model_type="mamba2",
        num_heads=4,
        head_dim=16,
        hidden_size=64,
        intermediate_size=128,
        state_size=16,
        num_hidden_layers=2,
        layer_norm_epsilon=1e-5,
        conv_kernel=4,
        n_groups=1,
        use_bias=False,
        use_conv_bias=True,
        tie_word_embeddings=False,
        time_step_limit=[0.0, 1e9],
        time_step_rank="auto",
    ),
    "falcon_h1": dict(  # each layer a CacheList: a Mamba2 state beside attention
        model_type="falcon_h1",
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        mamba_d_conv=4,
        mamba_d_head=16,
        mamba_d_ssm=64,
        mamba_d_state=16,
        mamba_n_heads=4,
        mamba_chunk_size=16,
        tie_word_embeddings=False,  # tied, its random text is one token over and over
        max_position_embeddings=512,
        rope_theta=10000.0,
    ),
}
FAMILIES = list(CONFIGS)
RECURRENT = ["qwen3_5", "qwen3_next", "mamba2", "falcon_h1"]  # caches that cannot rewind


def config(family: str) -> dict[str, Any]:
    return {**CONFIGS[family], "vocab_size": len(make_tokenizer())}


def make_model(family: str, *, seed: int = 0) -> nn.Module:
    """The family's tiny model with seeded random weights, evaluated (quantized if its
    config says so, as mlx-lm's loader quantizes)."""
    cfg = config(family)
    module = importlib.import_module(f"mlx_lm.models.{cfg['model_type']}")
    mx.random.seed(seed)
    model = module.Model(module.ModelArgs.from_dict(cfg))
    if (quantization := cfg.get("quantization")) is not None:
        nn.quantize(model, group_size=quantization["group_size"], bits=quantization["bits"])
    mx.eval(model.parameters())
    return model


def make_engine(family: str, *, prompt_cache_bytes: int = 0) -> Engine:
    tokenizer = make_tokenizer()
    loaded = in_memory(
        make_model(family),
        tokenizer,
        f"tiny-{family}",
        dtype="float32",
        is_quantized="quantization" in CONFIGS[family],
        context_length=512,
        device="cpu",
    )
    return Engine(loaded, prefill_step_size=16, prompt_cache_bytes=prompt_cache_bytes)


def save(family: str, path: Path) -> Path:
    """The family's tiny model as a checkpoint folder that ``--model`` loads."""
    path.mkdir(parents=True, exist_ok=True)
    save_model(path, make_model(family))
    (path / "config.json").write_text(json.dumps(config(family)), encoding="utf-8")
    make_tokenizer()._tokenizer.save_pretrained(str(path))
    return path


def mlx_lm_greedy(model: nn.Module, prompt: list[int], max_tokens: int) -> list[int]:
    """mlx-lm's own greedy tokens for ``prompt``, up to its end token (not included: a reply's
    tokens do not include the token that ended it)."""
    end = set(make_tokenizer().eos_token_ids)
    tokens = []
    for token, _ in generate_step(mx.array(prompt), model, max_tokens=max_tokens):
        if int(token) in end:
            break
        tokens.append(int(token))
    return tokens
