"""A model cut for the kernel primers (``engine/primers.py``): the fewest first layers that
compile every kernel the whole model needs, cut before any weight is read.

Kernels are named by their ops and dtypes, not by shapes or by how many layers run them, so one
layer of each kind compiles them all: a 1B Llama's warm-up after a primer over its first layer
took 7.0 s, as after a full warm-up's (7.3 s; design/027).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from . import _blas  # noqa: F401  (loads OpenBLAS: before MLX below)

# isort: split
from mlx.utils import tree_flatten

MAX_KEPT_LAYERS = 4  # more, and the primers (four hold a cut model at once) load too much


class LayersDiffer(Exception):
    """A cut model would not compile all of the model's kernels: its layers are of more kinds
    than a few first layers hold."""


def keep_first_layers(model: Any, *, alike: bool = True) -> int:
    """Cut ``model``, in place and before its weights are read, to its first layer, or where its
    layers are of several kinds (``alike``), to the fewest first layers that hold one of each
    kind (up to ``MAX_KEPT_LAYERS``); returns how many it kept. A kind is a layer's modules and
    parameter shapes (a hybrid's linear and full attention, dense and MoE layers), and where the
    config says so its attention (Gemma 3's ``sliding_window_pattern``, gpt-oss's
    ``layer_types``: their masks come from the caches at fixed positions, so a first layer
    alone does not run a prefill). ``alike`` off: one layer, for a primer that reads the
    vocabulary and dtype, never a layer. Raises :class:`LayersDiffer` where more would be
    needed, or where the model's layers are not a list it keeps (no cut: every weight would be
    read)."""
    layers = model.layers
    args = getattr(model, "args", None)
    keep = _layers_per_kind(layers, args) if alike else 1
    if keep > MAX_KEPT_LAYERS:
        raise LayersDiffer(f"{keep} layers before one of each kind")
    modules, before = _modules(model), len(layers)
    del _layer_list(modules, layers)[keep:]
    if len(model.layers) != keep:
        raise LayersDiffer("the model's layers are not a list it keeps")
    # What makes its caches, one a layer, counts from the config: it must count the kept ones
    # (a cache no layer fills breaks the batch's merge).
    if isinstance(getattr(args, "num_hidden_layers", None), int):
        args.num_hidden_layers = keep
    for holder in (vars(args) if args is not None and hasattr(args, "__dict__") else {}, *modules):
        types = holder.get("layer_types")
        if isinstance(types, list) and len(types) == before:
            del types[keep:]
    return keep


def _modules(model: Any) -> list[dict[str, Any]]:
    """``model`` and every module under it, as the dicts they are (their own attributes:
    MLX's ``children()`` hands out copies of their lists)."""
    found: list[dict[str, Any]] = []
    pending: list[Any] = [model]
    while pending:
        value = pending.pop(0)
        if isinstance(value, dict):
            found.append(value)
            pending.extend(v for v in value.values() if isinstance(v, dict | list))
        else:
            pending.extend(v for v in value if isinstance(v, dict | list))
    return found


def _layer_list(modules: list[dict[str, Any]], layers: list[Any]) -> list[Any]:
    """The list the model keeps its layers in: ``model.layers`` may hand out a copy (mlx-lm's
    ``pipeline_layers``, a slice), so the first list among its modules' attributes that holds
    the same layers, else ``layers`` itself."""
    for module in modules:
        for value in module.values():
            if (
                isinstance(value, list)
                and len(value) == len(layers)
                and all(a is b for a, b in zip(value, layers, strict=True))
            ):
                return value
    return layers


def _layers_per_kind(layers: Sequence[Any], args: Any) -> int:
    """How many first layers hold one layer of each kind (see :func:`keep_first_layers`)."""
    types = getattr(args, "layer_types", None)
    pattern = getattr(args, "sliding_window_pattern", None)
    kinds = []
    for index, layer in enumerate(layers):
        kind: tuple[Any, ...] = _signature(layer)
        if isinstance(types, list | tuple) and index < len(types):
            kind += (types[index],)
        if isinstance(pattern, int) and pattern > 1:
            kind += (index % pattern == pattern - 1,)  # mlx-lm's: a full layer ends a pattern
        kinds.append(kind)
    keep = 1 + max(kinds.index(kind) for kind in set(kinds))
    if isinstance(pattern, int) and pattern > 1:
        keep = max(keep, pattern)  # the full layer's cache is read at ``pattern - 1``
    return keep


def _signature(layer: Any) -> tuple[Any, ...]:
    modules = tuple((name, type(module).__name__) for name, module in layer.named_modules())
    params = tuple(
        (name, value.shape, value.dtype) for name, value in tree_flatten(layer.parameters())
    )
    return modules, params
