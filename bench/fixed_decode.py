"""A decode step of fixed shapes for Llama-family models: issue 26's experiment, not the engine's.

mlx-lm's forward builds its graph anew every step, with a KV cache that grows by
concatenation and Python integers for positions. This step is shaped to let MLX reuse work:

- the query, key and value projections are one matmul, and the MLP's gate and up projections
  another (``engine/model/fused.py``'s groups: weights concatenated once);
- the KV cache is preallocated per row (``capacity`` positions) and written in place at each
  row's position, so shapes do not change from step to step and rows need no left padding;
- positions are an input array (RoPE and the mask read them), so ``mx.compile`` traces the step
  once per (rows, capacity) and replays it, fusing its elementwise work.

What it showed on an H200 (``bench/decode_levers.py``, design/021): compiling takes the Python
graph building from 1.4 to 0.6-0.8 ms a step, but MLX still encodes every kernel of the
replayed graph each step, and the per-row mask sends attention to MLX's unfused path (the
vector kernel takes no array mask), so the compiled step takes 0.79-0.81x mlx-lm's time at
8-64 rows, 1.0x at 256 and 1.04x at 1 row. The fused projections were the part worth
keeping: ``engine/model/fused.py``.

It works on the model's own modules (norms, RoPE, embedding, head), so weights and numerics
stay mlx-lm's (greedy tokens equal: tests/test_decode_levers.py).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from mlx_trio.engine.model.fused import FusedLinear, fuse_projections

Step = Callable[..., tuple[mx.array, list[mx.array], list[mx.array]]]
MatMul = Callable[[mx.array, mx.array], mx.array]


def _matmul(x: mx.array, weight: mx.array) -> mx.array:
    return x @ weight.T


def supports(model: nn.Module) -> bool:
    """Whether ``model`` has the Llama layout this step knows (plain attention, SwiGLU MLP)."""
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if not layers or getattr(model, "model_type", None) not in {"llama", "mistral", "qwen2"}:
        return False
    if any(getattr(layer, "use_sliding", False) for layer in layers):
        return False
    attn, mlp = layers[0].self_attn, layers[0].mlp
    fusable = (attn.q_proj, attn.k_proj, attn.v_proj, mlp.gate_proj, mlp.up_proj)
    plain = all(type(m) in (nn.Linear, FusedLinear) for m in fusable)
    return plain and all(type(m) is nn.Linear for m in (attn.o_proj, mlp.down_proj))


class FixedDecoder:
    """The model's decode step with fused projections over a preallocated cache."""

    def __init__(
        self, model: nn.Module, *, compiled: bool = True, matmul: MatMul | None = None
    ) -> None:
        if not supports(model):
            raise ValueError("the fixed decode step supports Llama-layout models only")
        self.model = model
        layers = model.model.layers
        attn = layers[0].self_attn
        self.heads, self.kv_heads = attn.n_heads, attn.n_kv_heads
        self.head_dim = attn.q_proj.weight.shape[0] // attn.n_heads
        self.matmul = matmul or _matmul
        fuse_projections(model)  # the engine's own (a model fused already is left as it is)
        self.fused = [(layer.self_attn.q_proj.group, layer.mlp.gate_proj.group) for layer in layers]
        self.step: Step = mx.compile(self._step) if compiled else self._step

    def cache(self, rows: int, capacity: int) -> tuple[list[mx.array], list[mx.array]]:
        """Zeroed keys and values for ``rows`` rows of ``capacity`` positions, one per layer."""
        dtype = self.model.model.embed_tokens.weight.dtype
        shape = (rows, self.kv_heads, capacity, self.head_dim)
        keys = [mx.zeros(shape, dtype) for _ in self.fused]
        values = [mx.zeros(shape, dtype) for _ in self.fused]
        mx.eval(keys, values)
        return keys, values

    def _step(
        self, tokens: mx.array, positions: mx.array, keys: list[mx.array], values: list[mx.array]
    ) -> tuple[mx.array, list[mx.array], list[mx.array]]:
        """Logits (rows, vocab) for one token a row at ``positions``; the updated caches."""
        inner = self.model.model
        rows, capacity = tokens.shape[0], keys[0].shape[2]
        h = inner.embed_tokens(tokens)[:, None, :]
        visible = mx.arange(capacity)[None, :] <= positions[:, None]
        mask = visible[:, None, None, :]
        where = positions.reshape(rows, 1, 1, 1)
        new_keys, new_values = [], []
        for layer, (qkv_group, gu_group), k_cache, v_cache in zip(
            inner.layers, self.fused, keys, values, strict=True
        ):
            attn = layer.self_attn
            x = layer.input_layernorm(h)
            qkv = self._linear(x, qkv_group.weight, qkv_group.bias)
            q, k, v = mx.split(qkv, qkv_group.at, axis=-1)
            q = q.reshape(rows, 1, self.heads, -1).transpose(0, 2, 1, 3)
            k = k.reshape(rows, 1, self.kv_heads, -1).transpose(0, 2, 1, 3)
            v = v.reshape(rows, 1, self.kv_heads, -1).transpose(0, 2, 1, 3)
            q = attn.rope(q, offset=positions)
            k = attn.rope(k, offset=positions)
            k_cache = mx.put_along_axis(k_cache, where, k, axis=2)
            v_cache = mx.put_along_axis(v_cache, where, v, axis=2)
            new_keys.append(k_cache)
            new_values.append(v_cache)
            out = mx.fast.scaled_dot_product_attention(
                q, k_cache, v_cache, scale=attn.scale, mask=mask
            )
            h = h + self._linear(out.transpose(0, 2, 1, 3).reshape(rows, 1, -1), attn.o_proj)
            x = layer.post_attention_layernorm(h)
            gu = self._linear(x, gu_group.weight, gu_group.bias)
            gate, up = mx.split(gu, gu_group.at, axis=-1)
            h = h + self._linear(nn.silu(gate) * up, layer.mlp.down_proj)
        h = inner.norm(h)
        logits = self._head(h)
        return logits[:, 0, :], new_keys, new_values

    def _linear(
        self, x: mx.array, weight: mx.array | nn.Linear, bias: mx.array | None = None
    ) -> mx.array:
        if isinstance(weight, nn.Linear):
            weight, bias = weight.weight, weight.get("bias")
        y = self.matmul(x, weight)
        return y if bias is None else y + bias

    def _head(self, h: mx.array) -> mx.array:
        model: Any = self.model
        head = getattr(model, "lm_head", None)
        if head is not None and type(head) is not nn.Linear:
            return head(h)
        return self._linear(h, head or model.model.embed_tokens.weight)
