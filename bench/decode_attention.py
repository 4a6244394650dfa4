"""The batch's decode attention kernel (``engine/batch/decode_attention.py``) against MLX's own
path for one query under an array mask, on CUDA.

First the answers: the kernel's and MLX's largest difference from float32 attention at odd
shapes (rows, heads, KV heads, head size, keys; keys strided in a longer buffer, rows
left-padded by different amounts), for each of ``--plans`` (warps a block x keys a group of
lanes loads ahead; by default the kernel's own). A shape where the kernel is off fails the
run. Then:

- **a step's attention**: 32 layers' attention of ``rows`` rows over ``keys`` keys (``--heads``
  query heads / KV heads of 128; by default the 8B shape's, 32/8), built as one graph and
  evaluated once, median ms, MLX's path and the kernel in each plan;
- **with ``--model-dir``, the batch step**: mlx-trio's ``BatchEngine.step(1)`` on ``rows``
  prompts of 40-120 tokens (so the rows are left-padded), median ms of ``--steps``, the kernel
  off and on in turn on one engine (off, on, off, on).

    python -m bench.decode_attention [--model-dir /tmp/m8] [--rows 16,64,128,256] [--plans 8x4,4x4]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable

from mlx_trio.engine import _blas  # noqa: F401  (loads OpenBLAS: before MLX below)

# isort: split
import mlx.core as mx

from mlx_trio.engine.batch import decode_attention as kernel
from mlx_trio.engine.batch.batch import BatchEngine
from mlx_trio.engine.generate import Engine
from mlx_trio.engine.model import kernel_check
from mlx_trio.engine.params import PreparedRequest, SamplingParams

from .quantized_gpu import timed

# rows, heads, KV heads, head size, keys: partial warps of keys, one key, groups of 1 to 8.
CHECKS = (
    (16, 32, 8, 128, 1),
    (17, 32, 8, 128, 77),
    (128, 32, 8, 128, 300),
    (64, 16, 16, 64, 1000),
    (32, 32, 8, 128, 2049),
    (200, 8, 2, 64, 45),
    (32, 64, 8, 128, 300),
    (48, 28, 4, 128, 100),
)
LAYERS = 32


Plan = tuple[int, int]  # warps a block, keys a group of lanes loads ahead


def pairs(separator: str) -> Callable[[str], list[tuple[int, int]]]:
    """An argparse type: comma-separated pairs of positive integers, ``4x4,8x2`` (``x``) or
    ``32/8`` (``/``); anything else is the parser's one-line error."""

    def parse(text: str) -> list[tuple[int, int]]:
        try:
            found = [tuple(int(n) for n in part.split(separator)) for part in text.split(",")]
        except ValueError:
            found = []
        if not found or any(len(p) != 2 or min(p) < 1 for p in found):
            raise argparse.ArgumentTypeError(f"{text!r}: want pairs like 4{separator}4")
        return found  # type: ignore[return-value]

    return parse


def check(plans: list[Plan]) -> bool:
    """Whether the kernel's answers, in every plan, are as close to float32's as MLX's at every
    shape."""
    ok = True
    for rows, heads, kv_heads, size, keys in CHECKS:
        inputs = kernel.sample(rows, heads, kv_heads, size, keys)
        for warps, unroll in plans:
            ours, theirs = kernel.off_by(
                *inputs[:3], size**-0.5, inputs[3], warps=warps, unroll=unroll
            )
            fine = kernel_check.close(ours, theirs)
            ok &= fine
            print(
                f"check {rows} rows, {heads}/{kv_heads} heads of {size}, {keys} keys, plan "
                f"{warps}x{unroll}: max diff {ours:.4f} (MLX {theirs:.4f}) "
                f"{'ok' if fine else 'WRONG'}"
            )
    return ok


def layers(
    rows: int, keys: int, plans: list[Plan], heads: tuple[int, int] = (32, 8)
) -> list[float]:
    """Median ms of 32 layers' decode attention (``heads``: query heads, KV heads, of 128):
    MLX's path, then the kernel in each plan."""
    parts = [kernel.sample(rows, *heads, 128, keys) for _ in range(4)]  # 4 distinct caches
    scale = 128**-0.5

    def chain(plan: Plan | None) -> mx.array:
        outs = []
        for layer in range(LAYERS):
            q, k, v, mask = parts[layer % len(parts)]
            if plan is None:
                outs.append(kernel._fused(q, k, v, scale=scale, mask=mask))
            else:
                outs.append(kernel.run(q, k, v, scale, mask, warps=plan[0], unroll=plan[1]))
        return mx.stack(outs)

    return [timed(lambda p=plan: chain(p), 20) for plan in [None, *plans]]


def engine_steps(engine: Engine, rows: int, steps: int) -> list[float]:
    """Median ms of a batch step for ``steps`` steps at a time, the kernel off, on, off, on."""
    batch = BatchEngine(engine, max_batch=rows)
    params = SamplingParams(temperature=0, max_tokens=4 * steps + 60)
    for r in range(rows):
        length = 40 + (r * 7) % 80
        batch.add(
            PreparedRequest(
                tuple((11 + r * 31 + i * 13) % 1000 + 10 for i in range(length)), params
            )
        )
    generation = batch._batch._generator._generation_batch  # the lean step's batch
    for _ in range(10):  # the rows join, the first steps compile
        batch.step(1)
    medians = []
    for on in (False, True, False, True):
        generation.decode_kernel = on
        times = []
        for _ in range(steps):
            start = time.perf_counter()
            batch.step(1)
            times.append(time.perf_counter() - start)
        medians.append(statistics.median(times[2:]) * 1e3)
    batch.close()
    return medians


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-dir", default=None)
    parser.add_argument("--rows", default="16,64,128,256")
    parser.add_argument("--keys", default="64,256,1024")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument(
        "--plans",
        type=pairs("x"),
        default=[(kernel.WARPS, kernel.UNROLL)],
        help="warps x keys loaded ahead, comma-separated (default: the kernel's)",
    )
    parser.add_argument(
        "--heads",
        type=pairs("/"),
        default=[(32, 8)],
        help="query heads / KV heads of the timed layers (of 128), a table each",
    )
    args = parser.parse_args()
    if not mx.cuda.is_available():
        sys.exit("bench.decode_attention needs a CUDA GPU")
    print(f"device: {mx.default_device()}, mlx {mx.__version__}")
    plans: list[Plan] = args.plans
    if not check(plans):
        sys.exit("the kernel's answers are off")
    row_counts = [int(r) for r in args.rows.split(",")]
    names = [f"{w}x{u}" for w, u in plans]
    for query_heads, kv_heads in args.heads:
        print(f"\n{query_heads} query heads, {kv_heads} KV heads of 128:")
        print(f"\n| rows | keys | MLX ms (32 layers) | {' | '.join(names)} | first / MLX |")
        print("| ---: | ---: | ---: |" + " ---: |" * (len(plans) + 1))
        for rows in row_counts:
            for keys in (int(k) for k in args.keys.split(",")):
                theirs, *ours = layers(rows, keys, plans, (query_heads, kv_heads))
                cells = " | ".join(f"{t:.3f}" for t in ours)
                print(
                    f"| {rows} | {keys} | {theirs:.3f} | {cells} | {ours[0] / theirs:.2f}x |",
                    flush=True,
                )
    if args.model_dir is None:
        return
    engine = Engine.load(args.model_dir)
    print("\n| rows | step ms: off | on | off | on | on / off |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: |")
    for rows in row_counts:
        off1, on1, off2, on2 = engine_steps(engine, rows, args.steps)
        ratio = (on1 + on2) / (off1 + off2)
        print(
            f"| {rows} | {off1:.2f} | {on1:.2f} | {off2:.2f} | {on2:.2f} | {ratio:.2f}x |",
            flush=True,
        )


if __name__ == "__main__":
    main()
