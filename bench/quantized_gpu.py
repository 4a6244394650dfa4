"""On a GPU, 4-bit weights kept quantized or dequantized at load, by row count (issue 39).

Two measurements, one process, each variant warmed up first (MLX compiles CUDA kernels on first
use), then the median of ``--rounds`` timed runs:

- ``matmul``: a chain of 32 products of ``rows`` x K activations with the Llama-3.1-8B shape's
  weights (4096 x 4096, 14336 x 4096, 4096 x 14336), 4-bit group 64 through
  ``mx.quantized_matmul`` against the same weights dequantized to bfloat16 (``x @ w.T``).
- ``step``: the model's bare decode forward (one token a row over mlx-lm's ``KVCache`` after a
  16-token prompt, greedy, evaluated), the 4-bit model against its dequantized copy.

The engine dequantizes on CUDA where the weights fit (``engine/model/dequantize.py``); this is the
figure behind that default. Usage::

    python -m bench.quantized_gpu [--rows 1,4,16,64,128,256] [--shape 8b] [--rounds 5]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from functools import partial

import mlx_trio.engine._blas  # noqa: F401  (loads OpenBLAS: before MLX below)

# isort: split
import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.utils import dequantize_model

from mlx_trio.api.bench.models import make_model

SHAPES = ((4096, 4096), (14336, 4096), (4096, 14336))  # (out, in) of the 8B shape's weights
CHAIN = 32
PROMPT = 16
GROUP, BITS = 64, 4


def timed(run: Callable[[], mx.array], rounds: int) -> float:
    """Median ms of ``run`` evaluated, after two warm-up runs."""
    for _ in range(2):
        mx.eval(run())
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        mx.eval(run())
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def _quantized_chain(x: mx.array, wq: mx.array, scales: mx.array, biases: mx.array) -> mx.array:
    return mx.stack(
        [mx.quantized_matmul(x, wq, scales, biases, True, GROUP, BITS) for _ in range(CHAIN)]
    )


def _plain_chain(x: mx.array, dense: mx.array) -> mx.array:
    return mx.stack([x @ dense.T for _ in range(CHAIN)])


def matmul_table(rows_list: list[int], rounds: int) -> None:
    print("| rows | weight (out x in) | 4-bit us | bf16 us | 4-bit / bf16 |")
    print("| ---: | --- | ---: | ---: | ---: |")
    for out, inner in SHAPES:
        w = (mx.random.normal((out, inner)) * 0.02).astype(mx.bfloat16)
        wq, scales, biases = mx.quantize(w, group_size=GROUP, bits=BITS)
        dense = mx.dequantize(wq, scales, biases, group_size=GROUP, bits=BITS)
        mx.eval(wq, scales, biases, dense)
        for rows in rows_list:
            x = mx.random.normal((rows, inner)).astype(mx.bfloat16)
            mx.eval(x)
            quantized = partial(_quantized_chain, x, wq, scales, biases)
            plain = partial(_plain_chain, x, dense)
            q = timed(quantized, rounds) * 1e3 / CHAIN
            p = timed(plain, rounds) * 1e3 / CHAIN
            print(f"| {rows} | {out} x {inner} | {q:.1f} | {p:.1f} | {q / p:.2f}x |", flush=True)


def step_ms(model: nn.Module, rows: int, rounds: int) -> float:
    """Median ms of one bare decode forward of ``rows`` rows."""
    cache = make_prompt_cache(model)
    prompt = mx.array(
        [[(7 + r * 31 + i * 13) % 1000 + 10 for i in range(PROMPT)] for r in range(rows)]
    )
    mx.eval(model(prompt, cache=cache))
    state = {"token": prompt[:, -1:]}

    def one() -> mx.array:
        logits = model(state["token"], cache=cache)
        state["token"] = mx.argmax(logits[:, -1, :], axis=-1, keepdims=True)
        return state["token"]

    return timed(one, rounds)


def step_table(shape: str, rows_list: list[int], rounds: int) -> None:
    quantized = make_model(False, quantized=True, shape=shape)
    dense = dequantize_model(make_model(False, quantized=True, shape=shape))
    mx.eval(dense.parameters())
    print(f"\n| rows | {shape} 4-bit step ms | dequantized step ms | 4-bit / dequantized |")
    print("| ---: | ---: | ---: | ---: |")
    for rows in rows_list:
        q = step_ms(quantized, rows, rounds)
        d = step_ms(dense, rows, rounds)
        print(f"| {rows} | {q:.2f} | {d:.2f} | {q / d:.2f}x |", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", default="1,4,16,64,128,256")
    parser.add_argument("--shape", choices=["1b", "8b"], default="8b")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--skip-step", action="store_true", help="the matmul table only")
    args = parser.parse_args()
    rows = [int(r) for r in args.rows.split(",")]
    print(f"device: {mx.default_device()}, mlx {mx.__version__}")
    matmul_table(rows, args.rounds)
    if not args.skip_step:
        step_table(args.shape, rows, args.rounds)


if __name__ == "__main__":
    main()
