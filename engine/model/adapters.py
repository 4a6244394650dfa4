"""LoRA adapters served beside their base model, each row of a batch with its own (issue 40).

``mlx_lm.lora`` writes an adapter as a directory: ``adapter_config.json`` (its
``fine_tune_type``, ``num_layers`` and ``lora_parameters``: rank, scale, the module keys) and
``adapters.safetensors`` (``<module path>.lora_a`` of shape (in, rank) and ``.lora_b`` of shape
(rank, out)). mlx-lm's ``load(model, adapter_path=...)`` swaps the named linears for its
``LoRALinear``, whose output is ``linear(x) + scale * (x @ lora_a) @ lora_b``: one adapter per
model.

:func:`mount` serves several over one copy of the base weights. Every linear that some adapter
names becomes a :class:`MultiLoRALinear`: the base layer as it was (fused projections,
``model/fused.py``, and quantized layers included), plus each adapter's ``lora_a`` and
``lora_b`` stacked into one array per layer, slot 0 all zeros (the base model). A forward adds,
for each row of the batch, the product of its own slot's matrices: ``(x @ A[slot]) @ B[slot]``,
a batched matmul over the rows. So rows of different adapters share a step, as vLLM's and
S-LoRA's batched LoRA do, where the seed gave each adapter set steps of its own; a step of base
rows only (the selection unset) runs the base layers alone and costs nothing more.

The slots of a forward's rows are set by whoever calls the model (:meth:`Adapters.selecting`),
from the rows it holds in order: mlx-lm's prompt batch and generation batch
(``engine/batch/lean_step.py``), a prompt prefilled alone (``engine/batch/alone.py``), the solo
row and the serial lane (``Engine.model_for``). Adapters are mounted at load, on the thread
that then owns the model, so mounting is never beside a step; the prompt cache keeps each
adapter's entries apart (``PreparedRequest.cache_partition``).

An adapter that does not fit the model (a module it names is missing or not a linear, a shape
differs, DoRA or full fine-tuning) raises :class:`AdapterError` naming it and the first thing
that does not fit.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .. import _blas  # noqa: F401  (loads OpenBLAS: before MLX below)

# isort: split
import mlx.core as mx
import mlx.nn as nn

from ..errors import AdapterError
from ..options import AdapterSpec
from ..outputs import AdapterInfo

logger = logging.getLogger(__name__)

CONFIG = "adapter_config.json"
WEIGHTS = "adapters.safetensors"
BASE_SLOT = 0


@dataclass(frozen=True, slots=True)
class LoraWeights:
    """One adapter as read from its directory: per module path, its ``(lora_a, lora_b)``."""

    name: str
    path: Path
    scale: float
    rank: int
    modules: dict[str, tuple[mx.array, mx.array]]


def read_adapter(spec: AdapterSpec) -> LoraWeights:
    """The adapter in ``spec.path``; raises :class:`AdapterError` naming what is wrong."""
    where = f"adapter {spec.name!r} ({spec.path})"
    try:
        config = json.loads((spec.path / CONFIG).read_text())
        weights = mx.load(str(spec.path / WEIGHTS))
    except (OSError, ValueError, RuntimeError) as exc:
        raise AdapterError(f"{where}: cannot read {CONFIG} and {WEIGHTS}: {exc}") from None
    kind = config.get("fine_tune_type", "lora")
    if kind != "lora":
        raise AdapterError(f"{where}: fine_tune_type {kind!r} is not served (only lora)")
    parameters = config.get("lora_parameters") or {}
    scale = float(parameters.get("scale", 20.0))
    modules: dict[str, dict[str, mx.array]] = {}
    for key, value in weights.items():  # type: ignore[union-attr]
        path, _, leaf = key.rpartition(".")
        if leaf not in ("lora_a", "lora_b"):
            raise AdapterError(f"{where}: {key} is not a LoRA weight (lora_a or lora_b)")
        modules.setdefault(path, {})[leaf] = value
    pairs = {}
    for path, leaves in modules.items():
        if set(leaves) != {"lora_a", "lora_b"}:
            raise AdapterError(f"{where}: {path} has {sorted(leaves)} only")
        a, b = leaves["lora_a"], leaves["lora_b"]
        if a.ndim != 2 or b.ndim != 2 or a.shape[1] != b.shape[0]:
            raise AdapterError(
                f"{where}: {path}: lora_a {a.shape} and lora_b {b.shape} do not chain"
            )
        pairs[path] = (a, b)
    if not pairs:
        raise AdapterError(f"{where}: {WEIGHTS} holds no LoRA weights")
    rank = max(a.shape[1] for a, _ in pairs.values())
    return LoraWeights(spec.name, spec.path, scale, rank, pairs)


class _Selection:
    """Which adapter each row of the forward being built runs with: ``single``, one slot for
    every row (None: rows differ, or none is set), else ``mask``, (rows, 1, slots x rank)
    with ones on each row's own slot's columns, and ``scales``, each row's (rows, 1, 1)."""

    def __init__(self, rank: int, scales: list[float]) -> None:
        self.rank = rank
        self.slot_scales = scales
        self.single: int | None = None
        self.mask: mx.array | None = None
        self.scales: mx.array | None = None
        self._masks: dict[mx.Dtype, mx.array] = {}

    def set(self, slots: Sequence[int]) -> None:
        if len(set(slots)) == 1:
            self.single = slots[0]
            return
        rows = mx.array(list(slots), dtype=mx.int32)
        columns = mx.arange(len(self.slot_scales) * self.rank) // self.rank
        self.mask = (rows[:, None] == columns[None, :]).astype(mx.float32)[:, None, :]
        self.scales = mx.array([self.slot_scales[s] for s in slots])[:, None, None]

    def mask_in(self, dtype: mx.Dtype) -> mx.array | None:
        """``mask`` in ``dtype``, cast once a forward, not once a layer (None: none set)."""
        if self.mask is None:
            return None
        if (mask := self._masks.get(dtype)) is None:
            mask = self._masks[dtype] = self.mask.astype(dtype)
        return mask

    def clear(self) -> None:
        self.single = self.mask = self.scales = None
        self._masks.clear()


class MultiLoRALinear(nn.Module):
    """A linear layer plus every mounted adapter's LoRA product for it, chosen per row.

    The adapters' matrices are concatenated along the rank: ``lora_a`` (in, slots x rank),
    ``lora_b`` (slots x rank, out), slot 0 zeros. Rows of one adapter use its block alone,
    as mlx-lm's ``LoRALinear`` computes; rows of several multiply every block and keep their
    own through the selection's mask: two small matmuls a layer, no per-row gather of weights.
    """

    def __init__(self, base: nn.Module, a: mx.array, b: mx.array, selection: _Selection) -> None:
        super().__init__()
        self.base = base
        self.lora_a = a
        self.lora_b = b
        object.__setattr__(self, "selection", selection)  # outside the parameter tree

    def __call__(self, x: mx.array) -> mx.array:
        y = self.base(x)
        selection = self.selection
        if (slot := selection.single) is not None:
            block = slice(slot * selection.rank, (slot + 1) * selection.rank)
            z = (x @ self.lora_a[:, block]) @ self.lora_b[block]
            return y + (selection.slot_scales[slot] * z).astype(x.dtype)
        if (mask := selection.mask_in(x.dtype)) is None or selection.scales is None:
            return y
        z = ((x @ self.lora_a) * mask) @ self.lora_b
        return y + (selection.scales.astype(z.dtype) * z).astype(x.dtype)


class Adapters:
    """The adapters mounted over a model, by name, and the selection of each forward's rows."""

    def __init__(self, adapters: Sequence[LoraWeights], selection: _Selection) -> None:
        self._selection = selection
        self.by_name = {a.name: a for a in adapters}
        self.slots = {a.name: slot for slot, a in enumerate(adapters, start=BASE_SLOT + 1)}

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(self.by_name)

    def slot(self, name: str | None) -> int:
        """The slot of the adapter ``name`` (None: the base model's, 0)."""
        return BASE_SLOT if name is None else self.slots[name]

    @contextmanager
    def selecting(self, slots: Sequence[int]) -> Iterator[None]:
        """Forwards built inside run row ``i`` with adapter slot ``slots[i]`` (a single slot:
        every row with it). MLX builds the graph at the call, so the selection is needed only
        while the model is called, not while the result is evaluated."""
        if not any(slots):
            yield
            return
        self._selection.set(slots)
        try:
            yield
        finally:
            self._selection.clear()

    def describe(self) -> tuple[AdapterInfo, ...]:
        """Each adapter as ``/v1/models`` and ``/v1/stats`` show it."""
        return tuple(
            AdapterInfo(a.name, str(a.path), a.rank, a.scale, len(a.modules))
            for a in self.by_name.values()
        )


def mount(model: nn.Module, specs: Sequence[AdapterSpec]) -> Adapters:
    """Read each adapter of ``specs`` and mount them all over ``model`` (see the module
    docstring); raises :class:`AdapterError` for the first that does not fit."""
    names = [s.name for s in specs]
    if len(set(names)) != len(names):
        raise AdapterError(f"adapter names must differ, got {names}")
    adapters = [read_adapter(spec) for spec in specs]
    modules = dict(model.named_modules())
    paths: set[str] = set()
    for adapter in adapters:
        for path, (a, b) in adapter.modules.items():
            _check_fits(adapter, path, modules.get(path), a, b)
            paths.add(path)
    rank = max(adapter.rank for adapter in adapters)
    selection = _Selection(rank, [0.0] + [adapter.scale for adapter in adapters])
    for path in sorted(paths):
        base = modules[path]
        a, b = _concatenate(base, [adapter.modules.get(path) for adapter in adapters], rank)
        parent, _, leaf = path.rpartition(".")
        setattr(modules[parent] if parent else model, leaf, MultiLoRALinear(base, a, b, selection))
    mx.eval(model.parameters())
    logger.info(
        "adapters: %s over %d linear layers",
        ", ".join(f"{a.name} (rank {a.rank}, {len(a.modules)} layers)" for a in adapters),
        len(paths),
    )
    return Adapters(adapters, selection)


def linear_dims(module: nn.Module) -> tuple[int, int]:
    """A linear layer's (in, out) dimensions, quantized or not."""
    out, packed = module.weight.shape
    if isinstance(module, nn.QuantizedLinear):
        return packed * 32 // module.bits, out
    return packed, out


def _check_fits(adapter: LoraWeights, path: str, module: Any, a: mx.array, b: mx.array) -> None:
    where = f"adapter {adapter.name!r} ({adapter.path})"
    if module is None:
        raise AdapterError(f"{where}: the base model has no module {path}")
    if not isinstance(module, nn.Linear | nn.QuantizedLinear):
        kind = type(module).__name__
        raise AdapterError(f"{where}: {path} is a {kind}, not a linear layer")
    inputs, outputs = linear_dims(module)
    if a.shape[0] != inputs or b.shape[1] != outputs:
        raise AdapterError(
            f"{where}: {path} maps {inputs} -> {outputs}, its adapter {a.shape[0]} -> {b.shape[1]}"
        )


def _concatenate(
    base: nn.Module, pairs: list[tuple[mx.array, mx.array] | None], rank: int
) -> tuple[mx.array, mx.array]:
    """One layer's ``lora_a`` and ``lora_b`` of every adapter, concatenated along the rank,
    ``rank`` columns a slot: slot 0 and the adapters that leave the layer alone as zeros, a
    smaller rank padded with zeros."""
    inputs, outputs = linear_dims(base)
    dtype = next(p[0].dtype for p in pairs if p is not None)
    slots = len(pairs) + 1
    a = mx.zeros((inputs, slots * rank), dtype=dtype)
    b = mx.zeros((slots * rank, outputs), dtype=dtype)
    for slot, pair in enumerate(pairs, start=BASE_SLOT + 1):
        if pair is not None:
            start, r = slot * rank, pair[0].shape[1]
            a[:, start : start + r] = pair[0].astype(dtype)
            b[start : start + r, :] = pair[1].astype(dtype)
    return a, b
