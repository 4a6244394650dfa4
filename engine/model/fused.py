"""Fewer matmul calls a layer: the projections that read the same input, as one (issue 26).

On CUDA a decode step is bound by the host, and a matmul of two or more rows is its costliest
call to encode: MLX builds cuBLASLt descriptors, asks for an algorithm and captures the call
into a child CUDA graph every time, 14-20 us against 2.5 us for a one-row mat-vec kernel
(``bench/decode_levers.py --micro`` on an H200). A Llama layer makes seven of them a step;
its query, key and value projections read the same input, as do its MLP's gate and up
projections.

:func:`fuse_projections` concatenates each such group's weights once, so that the first
projection of a group called on an input computes the whole group in one matmul and the
others hand out their part of it: four calls a layer instead of seven, over mlx-lm's own
modules, caches and forward. Each module's ``weight`` becomes a view of its rows of the
concatenation, so the model holds its weights once, and its parameters read as before.
Numerics: each output is the same dot product; a BLAS may order its sums differently for the
wider matrix. On the H200 the logits came out bit-identical (8 prompts, 64 greedy tokens
each, bare and batched); on CPU tests/test_fused.py compares tokens and logits. Quantized
layers, groups with a bias on some projections only, and model types not in
:data:`MODEL_TYPES` are left as they are.

:func:`wanted` is the engine's policy: on by default on a GPU (on an H200, the 1B shape's
bare step took 0.85-0.94x the time at 1 to 256 rows, mlx-trio's batch step 0.79-0.96x at 8
to 256; design/021), off on the CPU, where a step is the arithmetic and stays as it was;
``MLX_TRIO_FUSE_PROJECTIONS=on|off`` overrides it. A rank of a sharded model keeps its own
layout (its projections are split across ranks).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from .. import _blas  # noqa: F401  (loads OpenBLAS: before MLX below)

# isort: split
import mlx.core as mx
import mlx.nn as nn

from .switches import env_switch

log = logging.getLogger(__name__)

ENV = "MLX_TRIO_FUSE_PROJECTIONS"
GROUPS = (("self_attn", ("q_proj", "k_proj", "v_proj")), ("mlp", ("gate_proj", "up_proj")))
# Model types whose layers call each group's projections on one input, all of them, once a
# forward (read in mlx-lm 0.32.2's models/); another model type is left as it is.
MODEL_TYPES = frozenset(
    {"llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "olmo2", "granite", "internlm3"}
)


def _product(x: mx.array, weight: mx.array) -> mx.array:
    return x @ weight.T


class Group:
    """A group's concatenated weight (and bias), where its output splits into the modules'
    parts (``at``), the views its modules hold, and its last input and outputs (held until
    each part was handed out)."""

    def __init__(self, linears: list[nn.Linear]) -> None:
        self.weight = mx.concatenate([m.weight for m in linears], axis=0)
        biased = all("bias" in m for m in linears)
        self.bias = mx.concatenate([m.bias for m in linears]) if biased else None
        mx.eval(self.weight, *([] if self.bias is None else [self.bias]))
        self.at: list[int] = []
        start = 0
        for m in linears:
            if start:
                self.at.append(start)
            rows = m.weight.shape[0]
            m.weight = self.weight[start : start + rows]
            if self.bias is not None:
                m.bias = self.bias[start : start + rows]
            start += rows
        self.views = [(m, m["weight"], m.get("bias")) for m in linears]
        # x @ w.T for a bias-less group (``gemm.install`` sets the rows' kernel).
        self.product: Callable[[mx.array, mx.array], mx.array] = _product
        self._input: mx.array | None = None
        self._parts: list[mx.array | None] = []
        self._left = 0  # parts of the last input not yet handed out

    def current(self) -> bool:
        """Whether every module still holds its view (``update``, ``load_weights`` or a dtype
        change after fusing replace them: the modules then compute on their own)."""
        for m, weight, bias in self.views:
            if m["weight"] is not weight or m.get("bias") is not bias:
                return False
        return True

    def part(self, x: mx.array, index: int) -> mx.array | None:
        """The group's ``index``-th output for ``x`` (None: the weights changed since fusing).
        The first call on an input computes them all; the group lets go of the input and
        outputs once each part was handed out (a prefill chunk's would otherwise stay in
        memory until the next step)."""
        if x is self._input and (out := self._parts[index]) is not None:
            self._parts[index] = None
            self._left -= 1
            if not self._left:
                self._input, self._parts = None, []
            return out
        if not self.current():
            return None
        y = (
            self.product(x, self.weight)
            if self.bias is None
            else mx.addmm(self.bias, x, self.weight.T)
        )
        parts: list[mx.array | None] = list(mx.split(y, self.at, axis=-1))
        out, parts[index] = parts[index], None
        self._input, self._parts, self._left = x, parts, len(parts) - 1
        return out


class FusedLinear(nn.Linear):
    """A projection of a fused group: its part of the group's one matmul on the same input.
    Not thread-safe: the group keeps its last input; the engine runs a model on one thread."""

    group: Group
    index: int

    def __call__(self, x: mx.array) -> mx.array:
        out = self.group.part(x, self.index)
        return super().__call__(x) if out is None else out


def wanted(device: str, *, given: bool | None = None) -> bool:
    """Whether to fuse a model loaded on ``device`` (``"cpu"`` or ``"gpu"``): ``given`` if not
    None, else ``MLX_TRIO_FUSE_PROJECTIONS`` (``on``/``off``) if set, else on a GPU only."""
    if given is not None:
        return given
    setting = env_switch(ENV)
    return device == "gpu" if setting is None else setting


def _plain(module: Any) -> bool:
    return type(module) is nn.Linear


def fuse_projections(model: nn.Module) -> int:
    """Fuse the projection groups of every layer of ``model`` (a model type of
    ``MODEL_TYPES``) that has them as plain (unquantized) linears, all with biases or none;
    returns how many layers were changed."""
    if getattr(model, "model_type", None) not in MODEL_TYPES:
        log.info("projections not fused: model type %r", getattr(model, "model_type", None))
        return 0
    layers = getattr(getattr(model, "model", None), "layers", None) or []
    fused = 0
    for layer in layers:
        changed = False
        for block_name, names in GROUPS:
            linears = [getattr(getattr(layer, block_name, None), n, None) for n in names]
            if not all(_plain(m) for m in linears):
                continue
            if len({"bias" in m for m in linears}) > 1:
                continue  # some with a bias, some without: left as they are
            group = Group(linears)
            for index, m in enumerate(linears):
                m.__class__ = FusedLinear
                # Plain attributes, outside the module's parameter tree.
                object.__setattr__(m, "group", group)
                object.__setattr__(m, "index", index)
            changed = True
        fused += changed
    mx.clear_cache()  # the unfused weights' buffers
    log.info("fused the projections of %d of %d layers", fused, len(layers))
    return fused
