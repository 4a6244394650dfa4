"""What each lever does to a decode step's host and device time (issue 26's experiments).

For each row count, greedy steps of the model after a 16-token prompt, each split three ways:
building the graph in Python (``build``), encoding and launching it (``encode``: until
``mx.async_eval`` returns) and waiting for the device (``wait``). The variants:

- ``mlx-lm``: the model's own forward over mlx-lm's ``KVCache`` (today's step);
- ``mlx-lm fused``: the same with ``engine/model/fused.py``'s projections (4 matmul calls a layer);
- ``fixed``: :class:`FixedDecoder`'s step (fused projections, preallocated cache, positions
  as an array), eager;
- ``compiled``: the same under ``mx.compile``;
- ``compiled+skinny``: with :mod:`bench.cuda_skinny`'s matmul for up to 16 rows (CUDA);
- ``compiled x4``: four compiled steps built as one graph and evaluated once.

Then whole engine steps at the same row counts (``--engine``): mlx-lm's ``BatchGenerator``,
mlx-trio's batch step, and mlx-trio's with fused projections. Before them (``--micro``), the
cost of one matmul in a chain of 64: MLX's matmul and the skinny kernel, per call. Run it
under ``MLX_MAX_OPS_PER_BUFFER`` or ``MLX_USE_CUDA_GRAPHS=0`` to see what MLX's CUDA graph
batching does. Variants run in ``--rounds`` interleaved rounds (each
in another order); the table has the medians of their medians. Usage::

    python -m bench.decode_levers [--model DIR] [--rows 1,8,64,256] [--steps 20]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from functools import partial

from mlx_trio.engine import _blas  # noqa: F401  (loads OpenBLAS: before MLX below)

# isort: split
import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache

from mlx_trio.engine.generate import Engine

from . import cuda_skinny
from .decode_anatomy import PROMPT, engine_step, generator_step, prompts
from .fixed_decode import FixedDecoder

CAPACITY = 64


def timed(step: Callable[[], mx.array], steps: int, per_eval: int = 1) -> tuple[float, ...]:
    """Median ms (build, encode, wait) a step, over ``steps`` after three warm-ups."""
    split: list[tuple[float, float, float]] = []
    for _ in range(steps + 3):
        start = time.perf_counter()
        out = step()
        built = time.perf_counter()
        mx.async_eval(out)
        encoded = time.perf_counter()
        mx.eval(out)
        done = time.perf_counter()
        split.append((built - start, encoded - built, done - encoded))
    return tuple(statistics.median(s[i] for s in split[3:]) * 1e3 / per_eval for i in range(3))


def mlx_lm_step(engine: Engine, rows: int) -> Callable[[], mx.array]:
    cache = make_prompt_cache(engine.model)
    tokens = mx.array(prompts(rows))
    state = [mx.argmax(engine.model(tokens, cache=cache)[:, -1, :], axis=-1)]

    def step() -> mx.array:
        for c in cache:  # a fixed length: time the same shapes every step
            c.offset = min(c.offset, PROMPT + 8)
        logits = engine.model(state[0][:, None], cache=cache)
        state[0] = mx.argmax(logits[:, -1, :], axis=-1)
        return state[0]

    return step


def fixed_step(decoder: FixedDecoder, rows: int, chain: int = 1) -> Callable[[], mx.array]:
    keys, values = decoder.cache(rows, CAPACITY)
    state = {"tokens": mx.array(prompts(rows))[:, -1], "keys": keys, "values": values}
    position = mx.full((rows,), PROMPT, mx.int32)

    def step() -> mx.array:
        for _ in range(chain):
            logits, state["keys"], state["values"] = decoder.step(
                state["tokens"], position, state["keys"], state["values"]
            )
            state["tokens"] = mx.argmax(logits, axis=-1)
        return state["tokens"]

    return step


def micro(rows: int, steps: int) -> dict[str, tuple[float, ...]]:
    """ms a call (build, encode, wait) of a chain of 64 (rows, 2048) x (2048, 2048) matmuls."""
    w = (mx.random.normal((2048, 2048)) * 0.02).astype(mx.bfloat16)
    x0 = mx.random.normal((rows, 2048)).astype(mx.bfloat16)
    mx.eval(w, x0)
    found = {}
    kinds: dict[str, Callable[[mx.array, mx.array], mx.array]] = {"matmul": lambda x, w: x @ w.T}
    if mx.cuda.is_available() and rows <= cuda_skinny.MAX_ROWS:
        kinds["skinny"] = cuda_skinny.matmul
        diff = mx.abs(cuda_skinny.matmul(x0, w) - x0 @ w.T).max().item()
        print(f"# skinny vs matmul at {rows} rows: max abs difference {diff:.4f}")

    for name, mm in kinds.items():

        def chain(mm: Callable[[mx.array, mx.array], mx.array] = mm) -> mx.array:
            x = x0
            for _ in range(64):
                x = mm(x, w)
            return x

        found[name] = tuple(t / 64 * 1e3 for t in timed(chain, steps))
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--rows", default="1,8,64,256")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds")
    parser.add_argument("--engine", action="store_true", help="time whole engine steps too")
    parser.add_argument("--micro", action="store_true", help="time single matmuls too")
    args = parser.parse_args()
    rows_list = [int(r) for r in args.rows.split(",")]
    if args.micro:
        print("| rows | op | build us | encode us | wait us |")
        print("| ---: | --- | ---: | ---: | ---: |")
        for rows in rows_list:
            for name, (b, e, w) in micro(rows, args.steps).items():
                print(f"| {rows} | {name} | {b:.1f} | {e:.1f} | {w:.1f} |", flush=True)
    engine = Engine.load(args.model, fuse=False)
    fused = Engine.load(args.model, fuse=True)
    # The fixed steps' own copy of the model (FixedDecoder rebinds its projections to views of
    # their concatenation), so that "mlx-lm" runs on the model as loaded.
    model = Engine.load(args.model, fuse=False).model
    eager = FixedDecoder(model, compiled=False)
    compiled = FixedDecoder(model)
    skinny = FixedDecoder(model, matmul=cuda_skinny.matmul)
    print("| rows | step | build ms | encode ms | wait ms | total ms | tok/s |")
    print("| ---: | --- | ---: | ---: | ---: | ---: | ---: |")
    for rows in rows_list:
        variants = {
            "mlx-lm": (mlx_lm_step(engine, rows), 1),
            "mlx-lm fused": (mlx_lm_step(fused, rows), 1),
            "fixed": (fixed_step(eager, rows), 1),
            "compiled": (fixed_step(compiled, rows), 1),
            "compiled x4": (fixed_step(compiled, rows, chain=4), 4),
        }
        if mx.cuda.is_available() and rows <= cuda_skinny.MAX_ROWS:
            variants["compiled+skinny"] = (fixed_step(skinny, rows), 1)
        found: dict[str, list[tuple[float, ...]]] = {name: [] for name in variants}
        names = list(variants)
        for r in range(args.rounds):  # interleaved: each round in another order
            for name in names[r % len(names) :] + names[: r % len(names)]:
                step, chain = variants[name]
                found[name].append(timed(step, args.steps, chain))
        for name, splits in found.items():
            b, e, w = (statistics.median(s[i] for s in splits) for i in range(3))
            total = statistics.median(sum(s) for s in splits)
            print(
                f"| {rows} | {name} | {b:.2f} | {e:.2f} | {w:.2f} | {total:.2f} | "
                f"{rows * 1e3 / total:,.0f} |",
                flush=True,
            )

    if args.engine:
        engine_steps(engine, fused, rows_list, args.steps, args.rounds)


def engine_steps(
    engine: Engine, fused: Engine, rows_list: list[int], steps: int, rounds: int
) -> None:
    """Median ms of whole batch steps, interleaved rounds: BatchGenerator, ours, ours fused."""
    print("| rows | BatchGenerator ms | mlx-trio ms | mlx-trio fused ms | fused / mlx-trio |")
    print("| ---: | ---: | ---: | ---: | ---: |")
    for rows in rows_list:
        runs: dict[str, Callable[[], float]] = {
            "generator": partial(generator_step, engine, rows, steps),
            "ours": partial(engine_step, engine, rows, steps),
            "fused": partial(engine_step, fused, rows, steps),
        }
        found: dict[str, list[float]] = {name: [] for name in runs}
        names = list(runs)
        for r in range(rounds):
            for name in names[r % len(names) :] + names[: r % len(names)]:
                found[name].append(runs[name]())
        g, o, f = (statistics.median(found[n]) for n in names)
        print(f"| {rows} | {g:.2f} | {o:.2f} | {f:.2f} | {f / o:.2f}x |", flush=True)


if __name__ == "__main__":
    main()
