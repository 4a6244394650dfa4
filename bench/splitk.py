"""A decode step's products at a few to a few hundred rows: cuBLAS against split-K in MLX ops.

Issue 39's 8B forward at 128 rows took 10.4-12.5 ms on an H200, where reading its 16 GB of
weights takes 3.3 ms (design/030, section 5). At M = 128 rows a (rows x K) @ (K x N) product
has N / 128 output tiles of 128 x 128: 32 for a 4096-wide weight, on 132 SMs. Split-K cuts K
into ``s`` slices, computes the ``s`` partial products as one batched matmul (``s`` times the
tiles) and sums them. Here the weight is stored split, ``(s, N, K / s)``, once, as a layer
would hold it.

For each of the 8B shape's weights (the fused q/k/v and gate/up projections included) and
each row count: the median time of one product, over ``COPIES`` distinct weights in a round
(more than the H200's 50 MB L2 holds, as a forward reads them), for ``x @ w.T`` and split-K
at each ``s``, with the largest difference from a float32 reference. Usage::

    python -m bench.splitk [--rows 1,32,128,256] [--splits 2,4,8] [--rounds 5]
"""

from __future__ import annotations

import argparse

import mlx_trio.engine._blas  # noqa: F401  (loads OpenBLAS: before MLX below)

# isort: split
import mlx.core as mx

from .quantized_gpu import timed

# (out, in) of the Llama-3.1-8B shape's products a decode step runs: q/k/v fused, o, gate/up
# fused, down, the head.
SHAPES = ((6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336), (128256, 4096))
MIN_BYTES = 512 * 2**20  # weights read in one round, well past L2


def split(w: mx.array, s: int) -> mx.array:
    """``w`` (N, K) as ``s`` contiguous slices of K: (s, N, K / s)."""
    n, k = w.shape
    return mx.contiguous(w.reshape(n, s, k // s).transpose(1, 0, 2))


def split_k(x: mx.array, ws: mx.array) -> mx.array:
    """``x @ w.T`` from ``w`` stored split (:func:`split`): one batched product, then a sum."""
    s, _, part = ws.shape
    xs = x.reshape(x.shape[0], s, part).transpose(1, 0, 2)
    return (xs @ ws.swapaxes(-1, -2)).sum(axis=0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", default="1,32,128,256")
    parser.add_argument("--splits", default="2,4,8")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    rows_list = [int(r) for r in args.rows.split(",")]
    splits = [int(s) for s in args.splits.split(",")]
    print(f"device: {mx.default_device()}, mlx {mx.__version__}")
    print(
        "| weight (out x in) | rows | cuBLAS us | TB/s | "
        + " | ".join(f"split {s} us (max diff)" for s in splits)
        + " | best / cuBLAS |"
    )
    print("| --- | ---: | ---: | ---: | " + " | ".join("---:" for _ in splits) + " | ---: |")
    for out, inner in SHAPES:
        shape_rows(out, inner, rows_list, splits, args.rounds)


def shape_rows(out: int, inner: int, rows_list: list[int], splits: list[int], rounds: int) -> None:
    """The table's rows of one weight shape."""
    copies = max(2, -(-MIN_BYTES // (out * inner * 2)))
    weights = [(mx.random.normal((out, inner)) * 0.02).astype(mx.bfloat16) for _ in range(copies)]
    mx.eval(weights)
    stored = {s: [split(w, s) for w in weights] for s in splits if inner % s == 0}
    for rows in rows_list:
        x = mx.random.normal((rows, inner)).astype(mx.bfloat16)
        mx.eval(x)
        reference = x.astype(mx.float32) @ weights[0].astype(mx.float32).T

        def error(product: mx.array, reference: mx.array = reference) -> float:
            return mx.abs(product.astype(mx.float32) - reference).max().item()

        def plain(x: mx.array = x) -> list[mx.array]:
            return [x @ w.T for w in weights]

        took = timed(plain, rounds) / 1e3 / copies
        cells, best = [], took
        for s in splits:
            if s not in stored:
                cells.append("")
                continue
            mx.eval(stored[s])

            def splitted(x: mx.array = x, parts: list[mx.array] = stored[s]) -> list[mx.array]:
                return [split_k(x, w) for w in parts]

            t = timed(splitted, rounds) / 1e3 / copies
            cells.append(f"{t * 1e6:.1f} ({error(split_k(x, stored[s][0])):.3f})")
            best = min(best, t)
        print(
            f"| {out} x {inner} | {rows} | {took * 1e6:.1f} ({error(x @ weights[0].T):.3f}) | "
            f"{out * inner * 2 / took / 1e12:.2f} | "
            + " | ".join(cells)
            + f" | {best / took:.2f}x |",
            flush=True,
        )


if __name__ == "__main__":
    main()
