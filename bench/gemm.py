"""Our bf16 product for a batch's rows (``engine/model/gemm.py``) against cuBLAS's, on CUDA.

For each of the 8B shape's weights and each row count: the median time of one product over
distinct weights in a round (past the L2, as a forward reads them), cuBLAS's ``x @ w.T`` and
the kernel at its plan and at each split of K, with the largest difference from a float32
reference (the kernel's beside cuBLAS's). A row count or weight where the kernel's answer is
off by more than twice cuBLAS's (plus a bf16 step) fails the run. Usage::

    python -m bench.gemm [--rows 2,8,16,32,64,128,256] [--splits 1,2,4,8] [--rounds 5]

A product alone is short enough (10-40 us) for the host's cost of a call to hide the GPU's. So
``--model-dir`` times what a decode step runs instead: the model's forward over one token a row
(``bench.decode_anatomy``), median ms of ``--steps``, with MLX's products (``cublas``) and with
the kernel at each of ``--configs`` (``auto``: its plan; ``s4``: 4 slices of K; ``bn64``:
blocks of 64 columns; ``bm64``: of 64 rows; ``st3``: 3 stages; ``wg``/``mma``: either kernel), in
one process::

    python -m bench.gemm --model-dir /tmp/m8 --rows 64,128,256 --configs cublas,auto,s1,s4
"""

from __future__ import annotations

import argparse
import functools
import sys
from collections.abc import Callable
from typing import Any

import mlx_trio.engine._blas  # noqa: F401  (loads OpenBLAS: before MLX below)

# isort: split
import mlx.core as mx

from mlx_trio.engine.generate import Engine
from mlx_trio.engine.model import gemm, kernel_check

from .decode_anatomy import forward
from .quantized_gpu import timed
from .splitk import MIN_BYTES, SHAPES

# Odd shapes that only check the answer: rows that fill no block, a weight of N % 128 != 0.
CHECKS = ((3, 1032, 4096), (17, 4096, 1024), (100, 6144, 4096), (200, 520, 14336))


def check(rows: int, n: int, k: int) -> bool:
    """Whether the kernel's answers (each kind, one slice and several) are as close to
    float32's as cuBLAS's (within a bf16 step)."""
    x = mx.random.normal((rows, k)).astype(mx.bfloat16)
    w = (mx.random.normal((n, k)) * 0.02).astype(mx.bfloat16)
    ok = True
    for wgmma in (False, True) if gemm.hopper() else (False,):  # wgmma: Hopper's alone
        for splits in (1, 2):
            ours, theirs = gemm.off_by(x, w, gemm.plan(rows, n, k, splits=splits, wgmma=wgmma))
            fine = kernel_check.close(ours, theirs)
            ok &= fine
            print(
                f"check {rows} x {k} @ {n}, {'wgmma' if wgmma else 'mma'} {splits} slices: "
                f"max diff {ours:.4f} (cuBLAS {theirs:.4f}) {'ok' if fine else 'WRONG'}"
            )
    return ok


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", default="2,8,16,32,64,128,256")
    parser.add_argument("--splits", default="1,2,4,8")
    parser.add_argument("--stages", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--model-dir", default=None)
    parser.add_argument("--configs", default="cublas,auto")
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    if not mx.cuda.is_available():
        sys.exit("bench.gemm times CUDA kernels: MLX sees no CUDA GPU here")
    print(f"device: {mx.default_device()}, mlx {mx.__version__}", flush=True)
    ok = all([check(*shape) for shape in CHECKS])
    if not ok:
        sys.exit("the kernel's answers are off: see WRONG above")
    if args.model_dir:
        forward_table(args)
        return
    rows_list = [int(r) for r in args.rows.split(",")]
    splits = [int(s) for s in args.splits.split(",")]
    print(
        "| weight (out x in) | rows | cuBLAS us (TB/s) | kernel us (TB/s, splits) | "
        + " | ".join(f"split {s} us" for s in splits)
        + " | kernel / cuBLAS |"
    )
    print("| --- | ---: | ---: | ---: | " + " | ".join("---:" for _ in splits) + " | ---: |")
    for out, inner in SHAPES:
        ok &= shape_rows(out, inner, rows_list, splits, args)
    if not ok:
        sys.exit("the kernel's answers are off: see WRONG above")


def configured(name: str) -> Callable[..., gemm.Plan]:
    """:func:`gemm.plan` with the settings ``name`` spells (``s4-bn64-bm64-st3``)."""
    settings: dict[str, Any] = {}
    for part in name.split("-"):
        if part.startswith("s") and part[1:].isdigit():
            settings["splits"] = int(part[1:])
        elif part.startswith("bn"):
            settings["bn"] = int(part[2:])
        elif part.startswith("bm"):
            settings["bm"] = int(part[2:])
        elif part.startswith("st"):
            settings["stages"] = int(part[2:])
        elif part in ("wg", "mma"):
            settings["wgmma"] = part == "wg"
        elif part != "auto":
            raise SystemExit(f"unknown setting {part!r} in {name!r}")
    return functools.partial(gemm.plan, **settings)


def forward_table(args: argparse.Namespace) -> None:
    """Median ms of the model's one-token forward at each row count, each config in turn."""
    engine = Engine.load(args.model_dir)
    gemm.install(engine.model)
    configs = args.configs.split(",")
    rows_list = [int(r) for r in args.rows.split(",")]
    print("| rows | " + " | ".join(configs) + " |")
    print("| ---: | " + " | ".join("---:" for _ in configs) + " |")
    usable = gemm.usable
    for rows in rows_list:
        cells = []
        for name in configs:
            gemm.usable = (lambda x, w: False) if name == "cublas" else usable
            if name != "cublas":
                gemm.planned = configured(name)  # matmul's launches, in place of its default
            _, run = forward(engine, rows, args.steps)
            cells.append(f"{run:.2f}")
        print(f"| {rows} | " + " | ".join(cells) + " |", flush=True)


def per_product(
    product: Callable[[mx.array, mx.array, Any], mx.array],
    x: mx.array,
    weights: list[mx.array],
    launch: Any,
    rounds: int,
) -> float:
    """Seconds a product, the median round of one product a weight."""
    return timed(lambda: [product(x, w, launch) for w in weights], rounds) / 1e3 / len(weights)


def shape_rows(
    out: int, inner: int, rows_list: list[int], splits: list[int], args: argparse.Namespace
) -> bool:
    """The table's rows of one weight shape; whether every answer was close."""
    copies = max(2, -(-MIN_BYTES // (out * inner * 2)))
    weights = [(mx.random.normal((out, inner)) * 0.02).astype(mx.bfloat16) for _ in range(copies)]
    mx.eval(weights)
    ok = True
    tb = out * inner * 2 / 1e12
    for rows in rows_list:
        x = mx.random.normal((rows, inner)).astype(mx.bfloat16)
        mx.eval(x)
        took = per_product(lambda x, w, _: x @ w.T, x, weights, None, args.rounds)
        chosen = gemm.plan(rows, out, inner, stages=args.stages)
        fine = kernel_check.close(*gemm.off_by(x, weights[0], chosen))
        ok &= fine
        t_plan = per_product(gemm.run, x, weights, chosen, args.rounds)
        cells = []
        for s in splits:
            if inner % (gemm.BK * s):
                cells.append("")
                continue
            launch = gemm.plan(rows, out, inner, splits=s, stages=args.stages)
            t = per_product(gemm.run, x, weights, launch, args.rounds)
            cells.append(f"{t * 1e6:.1f}")
        print(
            f"| {out} x {inner} | {rows} | {took * 1e6:.1f} ({tb / took:.2f}) | "
            f"{t_plan * 1e6:.1f} ({tb / t_plan:.2f}, {chosen.splits}) | "
            + " | ".join(cells)
            + f" | {t_plan / took:.2f}x{'' if fine else ' WRONG'} |",
            flush=True,
        )
    return ok


if __name__ == "__main__":
    main()
