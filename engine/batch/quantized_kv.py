"""Quantized KV caches that batch: ``--kv-bits 4|8`` (issue 40, part 2).

mlx-lm's ``QuantizedKVCache`` keeps a row's keys and values quantized (``mx.quantize``: packed
integers plus a scale and a bias per group of ``group_size``), and mlx-lm's attention takes the
quantized path for any cache with ``bits`` (``models/base.py``). But it cannot merge into
mlx-lm's ``BatchGenerator``: there is no batch class for it, so ``generate_step`` alone uses
it (mlx_lm.server's ``--kv-bits`` runs one request at a time).

:class:`BatchQuantizedKVCache` is mlx-lm's ``BatchKVCache`` (left-padded rows, one index for
all) over quantized triples: the same padding, filtering, extending, rolling and masking, each
applied to the three arrays of the keys and of the values. :class:`QuantizedRowCache` is
mlx-lm's ``QuantizedKVCache`` that merges into it, and what ``extract`` gives back, so that
rows join, leave, park and go to the prompt cache as plain rows do. Padding is zeros (scale
and bias 0 too): it dequantizes to zero and the mask hides it.

:class:`KVScheme` makes a model's caches for a scheme: every plain ``KVCache`` layer quantized,
other layers (windows, recurrent states) as mlx-lm makes them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .. import _blas  # noqa: F401  (loads OpenBLAS: before MLX below)

# isort: split
import mlx.core as mx
from mlx.utils import tree_map
from mlx_lm.models.cache import BatchKVCache, KVCache, QuantizedKVCache, dynamic_roll
from mlx_lm.models.cache import make_prompt_cache as mlx_lm_caches

Triple = tuple[mx.array, mx.array, mx.array]


@dataclass(frozen=True, slots=True)
class KVScheme:
    """How a row's keys and values are kept: ``bits`` None, as the model's dtype; else
    quantized to ``bits`` with a scale and bias per ``group_size`` values."""

    bits: int | None = None
    group_size: int = 64

    def describe(self) -> str:
        if self.bits is None:
            return "KV in the model's dtype"
        return f"KV quantized to {self.bits} bits, groups of {self.group_size}"

    def maker(self) -> Callable[[Any], list[Any]]:
        """``make(model)``: a fresh set of the model's caches under this scheme."""
        if self.bits is None:
            return mlx_lm_caches
        bits, group_size = self.bits, self.group_size

        def make(model: Any) -> list[Any]:
            return [
                QuantizedRowCache(group_size=group_size, bits=bits)
                if type(cache) is KVCache
                else cache
                for cache in mlx_lm_caches(model)
            ]

        return make


FULL_KV = KVScheme()  # the model's own caches, keys and values in its dtype


class PromptChunksInFullPrecision:
    """A quantized cache whose prompt chunks attend in the model's dtype.

    mlx-lm's attention takes the quantized path for any cache with ``bits``: scores by
    ``quantized_matmul``, a mask applied by hand, a softmax; on 2 CPU cores a 700-token prompt
    prefilled so took 2.4x the time of the fused kernel. mlx-lm's own ``generate_step`` with
    ``kv_bits`` prefills its first chunk unquantized and quantizes the cache after it. Here a
    step of more than one token (a prompt chunk) stores its keys and values quantized as
    always, but attends to the history dequantized and to itself as computed, through the
    fused kernel: ``bits`` reads as absent once, to the attention right after the step
    (``hasattr``, which mlx-lm's ``scaled_dot_product_attention`` asks first), and as itself
    to anything after. A decode step attends quantized."""

    _bits: int
    _chunk: bool = False

    @property
    def bits(self) -> int:
        if self._chunk:
            self._chunk = False
            raise AttributeError("bits")  # this step's attention: in full precision
        return self._bits

    @bits.setter
    def bits(self, value: int) -> None:
        self._bits = value

    def _attend(
        self, held: tuple[Triple, Triple], end: int, keys: mx.array, values: mx.array
    ) -> tuple[Any, Any]:
        """What this step attends to: the quantized ``held`` (up to ``end``, this step's
        tokens included) for one token; for a chunk, the history before it dequantized, and
        the chunk's own ``keys`` and ``values``."""
        n = keys.shape[2]
        self._chunk = n > 1
        if not self._chunk:
            return _cut(held[0], end), _cut(held[1], end)
        start = end - n
        if start == 0:
            return keys, values
        bits, size = self._bits, self.group_size
        old = [
            mx.dequantize(*_cut(h, start), group_size=size, bits=bits).astype(new.dtype)
            for h, new in zip(held, (keys, values), strict=True)
        ]
        return (
            mx.concatenate([old[0], keys], axis=2),
            mx.concatenate([old[1], values], axis=2),
        )


class QuantizedRowCache(PromptChunksInFullPrecision, QuantizedKVCache):
    """mlx-lm's ``QuantizedKVCache``, mergeable into a :class:`BatchQuantizedKVCache`, its
    prompt chunks attending in full precision."""

    group_size: int

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[Any, Any]:
        self._chunk = False
        super().update_and_fetch(keys, values)
        return self._attend((self.keys, self.values), self.offset, keys, values)

    def merge(self, caches: list[QuantizedRowCache]) -> BatchQuantizedKVCache:
        return BatchQuantizedKVCache.merge(caches)

    @property
    def state(self) -> tuple[Any, ...]:
        return self.keys, self.values, self.offset, self.group_size, self._bits

    @state.setter
    def state(self, v: tuple[Any, ...]) -> None:
        self.keys, self.values, self.offset, self.group_size, self._bits = v

    @property
    def nbytes(self) -> int:
        """Bytes held (mlx-lm's raises for a cache that has read nothing yet)."""
        return 0 if self.keys is None else super().nbytes


class BatchQuantizedKVCache(PromptChunksInFullPrecision, BatchKVCache):
    """mlx-lm's ``BatchKVCache`` over quantized keys and values (see the module docstring)."""

    def __init__(self, left_padding: list[int], *, group_size: int, bits: int) -> None:
        super().__init__(left_padding)
        self.group_size = group_size
        self.bits = bits

    def _zeros(self, rows: int, heads: int, steps: int, dim: int, dtype: mx.Dtype) -> Triple:
        per_int = 32 // self._bits
        groups = dim // self.group_size
        return (
            mx.zeros((rows, heads, steps, dim // per_int), dtype=mx.uint32),
            mx.zeros((rows, heads, steps, groups), dtype=dtype),
            mx.zeros((rows, heads, steps, groups), dtype=dtype),
        )

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[Any, Any]:
        self._chunk = False
        prev, n = self._idx, keys.shape[2]
        if self.keys is None or prev + n > self.keys[0].shape[2]:
            rows, heads = keys.shape[:2]
            steps = (self.step + n - 1) // self.step * self.step
            new_k = self._zeros(rows, heads, steps, keys.shape[3], keys.dtype)
            new_v = self._zeros(rows, heads, steps, values.shape[3], values.dtype)
            if self.keys is not None:
                if prev % self.step != 0:
                    self.keys, self.values = _cut(self.keys, prev), _cut(self.values, prev)
                self.keys = _join(self.keys, new_k)
                self.values = _join(self.values, new_v)
            else:
                self.keys, self.values = new_k, new_v
        self.offset = self.offset + n
        self._idx += n
        quantized = (
            mx.quantize(keys, group_size=self.group_size, bits=self._bits),
            mx.quantize(values, group_size=self.group_size, bits=self._bits),
        )
        for held, new in zip((self.keys, self.values), quantized, strict=True):
            for i in range(3):
                held[i][..., prev : self._idx, :] = new[i]
        return self._attend((self.keys, self.values), self._idx, keys, values)

    def keys_and_values(self) -> tuple[Triple, Triple]:
        return _cut(self.keys, self._idx), _cut(self.values, self._idx)

    def finalize(self) -> None:
        if self._right_padding is not None:
            padding = self._right_padding
            roll = lambda x: dynamic_roll(x, padding[:, None], axis=2)  # noqa: E731
            self.keys, self.values = tree_map(roll, (self.keys, self.values))
            self.offset = self.offset - padding
            self.left_padding += padding
            self._right_padding = None

    def filter(self, batch_indices: Any) -> None:
        if self.keys is not None:
            pick = lambda x: x[batch_indices]  # noqa: E731
            self.keys, self.values = tree_map(pick, (self.keys, self.values))
        self.offset = self.offset[batch_indices]
        self.left_padding = self.left_padding[batch_indices]
        shift = min(self.left_padding.tolist())
        if shift > 0:
            if self.keys is not None:
                drop = lambda x: x[..., shift:, :]  # noqa: E731
                self.keys, self.values = tree_map(drop, (self.keys, self.values))
            self._idx -= shift
            self.left_padding -= shift

    def extend(self, other: BatchQuantizedKVCache) -> None:
        if self.keys is None and other.keys is None:
            self.left_padding = mx.concatenate([self.left_padding, other.left_padding])
            self.offset = mx.concatenate([self.offset, other.offset])
            return
        idx = max(self._idx, other._idx)
        size = max(c.keys[0].shape[2] for c in (self, other) if c.keys is not None)
        like = self if self.keys is not None else other

        def padded(c: BatchQuantizedKVCache) -> tuple[Triple, Triple, mx.array, mx.array]:
            keys, values = c.keys, c.values
            if keys is None:  # no row has read a token: empty triples shaped as the other's
                rows = c.offset.shape[0]
                keys, values = (
                    tuple(mx.zeros((rows, x.shape[1], 0, x.shape[3]), x.dtype) for x in held)
                    for held in (like.keys, like.values)
                )
            left = idx - c._idx
            right = size - keys[0].shape[2] - left

            def fit(x: mx.array) -> mx.array:
                r = right
                if r < 0:
                    x, r = x[..., :r, :], 0
                if left or r:
                    x = mx.pad(x, [(0, 0), (0, 0), (left, r), (0, 0)])
                return x

            return tree_map(fit, keys), tree_map(fit, values), c.offset, c.left_padding + left

        (k1, v1, o1, p1), (k2, v2, o2, p2) = padded(self), padded(other)
        self.keys = tuple(mx.concatenate([a, b]) for a, b in zip(k1, k2, strict=True))
        self.values = tuple(mx.concatenate([a, b]) for a, b in zip(v1, v2, strict=True))
        self.offset = mx.concatenate([o1, o2])
        self.left_padding = mx.concatenate([p1, p2])
        self._idx = idx

    def extract(self, idx: int) -> QuantizedRowCache:
        cache = QuantizedRowCache(group_size=self.group_size, bits=self._bits)
        padding = self.left_padding.tolist()[idx]
        row = lambda x: mx.contiguous(x[idx : idx + 1, :, padding : self._idx])  # noqa: E731
        cache.keys, cache.values = tree_map(row, (self.keys, self.values))
        cache.offset = self._idx - padding
        return cache

    @classmethod
    def merge(cls, caches: list[QuantizedRowCache]) -> BatchQuantizedKVCache:  # type: ignore[override]
        first = caches[0]
        lengths = [c.offset for c in caches]
        longest = max(lengths)
        padding = [longest - n for n in lengths]
        cache = cls(padding, group_size=first.group_size, bits=first._bits)
        if longest == 0:
            return cache
        full = next(c for c in caches if c.keys is not None)

        def stacked(pick: Callable[[QuantizedRowCache], Triple]) -> Triple:
            out = []
            for i, x in enumerate(pick(full)):
                buffer = mx.zeros((len(caches), x.shape[1], longest, x.shape[3]), dtype=x.dtype)
                for row, (pad, c) in enumerate(zip(padding, caches, strict=True)):
                    if c.keys is not None and c.offset:
                        buffer[row : row + 1, :, pad:] = pick(c)[i][..., : c.offset, :]
                out.append(buffer)
            return tuple(out)  # type: ignore[return-value]

        cache.keys = stacked(lambda c: c.keys)
        cache.values = stacked(lambda c: c.values)
        cache.offset += longest
        cache._idx = longest
        return cache

    @property
    def nbytes(self) -> int:
        if self.keys is None:
            return 0
        return sum(x.nbytes for x in (*self.keys, *self.values))


def _cut(triple: Triple, end: int) -> Triple:
    return tuple(x[..., :end, :] for x in triple)  # type: ignore[return-value]


def _join(a: Triple, b: Triple) -> Triple:
    return tuple(mx.concatenate([x, y], axis=2) for x, y in zip(a, b, strict=True))  # type: ignore[return-value]
