"""What masked prefill attention costs at a new shape: MLX's (cuDNN on CUDA) and plain ops.

For each (rows, query length, key length): the first call at that shape, then two more, of
``mx.fast.scaled_dot_product_attention`` under mlx-lm's kind of array mask and of
``engine/batch/masked_attention.plain`` (the batch's prefill attention on CUDA). Shapes of the
8B bench model (32 heads, 8 kv heads, dim 128, bfloat16). Usage: ``python -m bench.sdpa_shapes``.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from mlx_trio.engine import _blas  # noqa: F401  (loads OpenBLAS: before MLX below)

# isort: split
import mlx.core as mx

from mlx_trio.engine.batch.masked_attention import plain

HEADS, KV_HEADS, DIM = 32, 8, 128
SHAPES = [(128, 14, 45), (128, 15, 46), (96, 14, 45), (64, 14, 45), (128, 60, 60), (96, 60, 60)]
SHAPES += [(128, 120, 400), (16, 500, 1000)]


def timed(attend: Callable[..., mx.array], *args: object) -> list[float]:
    times = []
    for _ in range(3):
        mx.synchronize()
        began = time.perf_counter()
        mx.eval(attend(*args))
        mx.synchronize()
        times.append(1000 * (time.perf_counter() - began))
    return times


def mlx_attention(q: mx.array, k: mx.array, v: mx.array, scale: float, mask: mx.array) -> mx.array:
    return mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask)


def main() -> None:
    for kind, attend in (("plain", plain), ("mlx", mlx_attention)):
        for rows, length, keys in SHAPES:
            q = mx.random.normal((rows, HEADS, length, DIM)).astype(mx.bfloat16)
            k = mx.random.normal((rows, KV_HEADS, keys, DIM)).astype(mx.bfloat16)
            v = mx.random.normal((rows, KV_HEADS, keys, DIM)).astype(mx.bfloat16)
            mask = mx.ones((rows, 1, length, keys), dtype=mx.bool_)
            mx.eval(q, k, v, mask)
            t = timed(attend, q, k, v, DIM**-0.5, mask)
            print(
                f"{kind:5s} rows {rows:3d} queries {length:3d} keys {keys:4d}: first {t[0]:7.2f} "
                f"ms, then {t[1]:6.2f} {t[2]:6.2f}",
                flush=True,
            )


if __name__ == "__main__":
    main()
