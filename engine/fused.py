"""Fewer matmul calls a layer: the projections that read the same input, as one (issue 26).

On CUDA a decode step is bound by the host, and a matmul of two or more rows is its costliest
call to encode: MLX builds cuBLASLt descriptors, asks for an algorithm and captures the call
into a child CUDA graph every time, 14-20 us against 2.5-5 us for an elementwise kernel
(``bench/decode_levers.py --micro`` on an H200). A Llama layer makes seven of them a step;
its query, key and value projections read the same input, as do its MLP's gate and up
projections.

:func:`fuse_projections` concatenates each such group's weights once, so that the first
projection of a group called on an input computes the whole group in one matmul and the
others hand out their part of it: four calls a layer instead of seven, over mlx-lm's own
modules, caches and forward. Each module's ``weight`` becomes a view of its rows of the
concatenation, so the model holds its weights once, and its parameters read as before.
Numerics: each output is the same dot product; cuBLAS may order its sums differently for the
wider matrix (greedy tokens are compared in tests/test_fused.py).

:func:`wanted` is the engine's policy: on by default on a GPU (an H200 step of the 1B shape
took 0.74-0.96x the time, 1 to 256 rows, design/021), off on the CPU, where a step is the
arithmetic and stays as it was; ``MLX_TRIO_FUSE_PROJECTIONS=on|off`` overrides it. A rank of
a sharded model keeps its own layout (its projections are split across ranks).
"""

from __future__ import annotations

import logging
import os
from typing import Any

from . import _blas  # noqa: F401  (loads OpenBLAS: before MLX below)

# isort: split
import mlx.core as mx
import mlx.nn as nn

log = logging.getLogger(__name__)

ENV = "MLX_TRIO_FUSE_PROJECTIONS"
GROUPS = (("self_attn", ("q_proj", "k_proj", "v_proj")), ("mlp", ("gate_proj", "up_proj")))


class _Group:
    """A group's concatenated weight, and its last input and output (held until the next)."""

    def __init__(self, linears: list[nn.Linear]) -> None:
        self.weight = mx.concatenate([m.weight for m in linears], axis=0)
        has_bias = ["bias" in m for m in linears]
        if any(has_bias) and not all(has_bias):
            raise ValueError("a group's projections must all have biases or none")
        self.bias = mx.concatenate([m.bias for m in linears]) if all(has_bias) else None
        mx.eval(self.weight, *([] if self.bias is None else [self.bias]))
        self.splits: list[int] = []
        start = 0
        for m in linears:
            rows = m.weight.shape[0]
            m.weight = self.weight[start : start + rows]
            if self.bias is not None:
                m.bias = self.bias[start : start + rows]
            start += rows
            self.splits.append(start)
        self._input: mx.array | None = None
        self._parts: list[mx.array | None] = []

    def part(self, x: mx.array, index: int) -> mx.array:
        """The group's ``index``-th output for ``x``: the first call on an input computes them
        all; the group lets go of the input and outputs once each part was handed out (a
        prefill chunk's would otherwise stay in memory until the next step)."""
        if x is not self._input or self._parts[index] is None:
            y = x @ self.weight.T if self.bias is None else mx.addmm(self.bias, x, self.weight.T)
            self._input, self._parts = x, list(mx.split(y, self.splits[:-1], axis=-1))
        out, self._parts[index] = self._parts[index], None
        if all(p is None for p in self._parts):
            self._input, self._parts = None, []
        assert out is not None
        return out


class FusedLinear(nn.Linear):
    """A projection of a fused group: its part of the group's one matmul on the same input."""

    _group: _Group
    _index: int

    def __call__(self, x: mx.array) -> mx.array:
        return self._group.part(x, self._index)


def wanted(device: str, *, given: bool | None = None) -> bool:
    """Whether to fuse a model loaded on ``device`` (``"cpu"`` or ``"gpu"``): ``given`` if not
    None, else ``MLX_TRIO_FUSE_PROJECTIONS`` (``on``/``off``) if set, else on a GPU only."""
    if given is not None:
        return given
    setting = os.environ.get(ENV, "auto").strip().lower()
    if setting in {"on", "1", "true", "yes"}:
        return True
    if setting in {"off", "0", "false", "no"}:
        return False
    if setting != "auto":
        raise ValueError(f"{ENV} must be on, off or auto, not {setting!r}")
    return device == "gpu"


def _plain(module: Any) -> bool:
    return type(module) is nn.Linear


def fuse_projections(model: nn.Module) -> int:
    """Fuse the projection groups of every layer of ``model`` that has them as plain
    (unquantized) linears; returns how many layers were changed."""
    layers = getattr(getattr(model, "model", None), "layers", None) or []
    fused = 0
    for layer in layers:
        changed = False
        for block_name, names in GROUPS:
            block = getattr(layer, block_name, None)
            linears = [getattr(block, n, None) for n in names]
            if block is None or not all(_plain(m) for m in linears):
                continue
            group = _Group(linears)
            for index, m in enumerate(linears):
                m.__class__ = FusedLinear
                object.__setattr__(m, "_group", group)
                object.__setattr__(m, "_index", index)
            changed = True
        fused += changed
    log.info("fused the projections of %d of %d layers", fused, len(layers))
    return fused
