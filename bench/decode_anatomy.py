"""Where a decode step's time goes, at several batch sizes (issue 26's first question).

For each row count: the bare forward of the model (one token a row over mlx-lm's plain
``KVCache``, after a 16-token prompt), split into building its graph in Python and evaluating
it, and the same with four forwards built as one graph and evaluated once; mlx-lm's
``BatchGenerator`` step (``next_generated``) on the same rows; and mlx-trio's batch
engine step (``BatchEngine.step(1)``, the lean step). Greedy, warmed up, then the median of
``--steps`` steps. Usage::

    python -m bench.decode_anatomy [--model DIR] [--rows 1,8,64,256] [--steps 20]
"""

from __future__ import annotations

import argparse
import statistics
import time

from mlx_trio.engine import _blas  # noqa: F401  (loads OpenBLAS: before MLX below)

# isort: split
import mlx.core as mx
from mlx_lm.generate import BatchGenerator
from mlx_lm.models.cache import make_prompt_cache

from mlx_trio.engine.batch.batch import BatchEngine
from mlx_trio.engine.generate import Engine
from mlx_trio.engine.params import PreparedRequest, SamplingParams

PROMPT = 16


def prompts(rows: int) -> list[list[int]]:
    """``rows`` distinct prompts of ``PROMPT`` token ids."""
    return [[(7 + r * 31 + i * 13) % 1000 + 10 for i in range(PROMPT)] for r in range(rows)]


def forward(engine: Engine, rows: int, steps: int) -> tuple[float, float]:
    """Median ms to build a forward's graph and to evaluate it."""
    model = engine.model
    cache = make_prompt_cache(model)
    tokens = mx.array(prompts(rows))
    mx.eval(model(tokens, cache=cache))
    step = tokens[:, -1:]
    build, run = [], []
    for _ in range(steps + 3):
        start = time.perf_counter()
        logits = model(step, cache=cache)
        step = mx.argmax(logits[:, -1, :], axis=-1, keepdims=True)
        built = time.perf_counter()
        mx.eval(step)
        build.append(built - start)
        run.append(time.perf_counter() - built)
    return statistics.median(build[3:]) * 1e3, statistics.median(run[3:]) * 1e3


def chained(engine: Engine, rows: int, steps: int, chain: int) -> float:
    """Median ms a step when ``chain`` greedy steps are built as one graph and evaluated once
    (the issue's "several steps per evaluation")."""
    model = engine.model
    cache = make_prompt_cache(model)
    tokens = mx.array(prompts(rows))
    mx.eval(model(tokens, cache=cache))
    step = tokens[:, -1:]
    times = []
    for _ in range(steps // chain + 2):
        start = time.perf_counter()
        for _ in range(chain):
            step = mx.argmax(model(step, cache=cache)[:, -1, :], axis=-1, keepdims=True)
        mx.eval(step)
        times.append((time.perf_counter() - start) / chain)
    return statistics.median(times[2:]) * 1e3


def generator_step(engine: Engine, rows: int, steps: int) -> float:
    """Median ms of a ``BatchGenerator`` step once every row decodes."""
    generator = BatchGenerator(engine.model, completion_batch_size=rows, prefill_batch_size=rows)
    generator.insert(prompts(rows), max_tokens=[steps + 40] * rows)
    times = []
    for _ in range(steps + 8):
        start = time.perf_counter()
        generator.next_generated()
        times.append(time.perf_counter() - start)
    generator.close()
    return statistics.median(times[8:]) * 1e3


def engine_step(engine: Engine, rows: int, steps: int) -> float:
    """Median ms of mlx-trio's batch step once every row decodes."""
    batch = BatchEngine(engine, max_batch=rows)
    params = SamplingParams(temperature=0, max_tokens=steps + 40)
    for p in prompts(rows):
        batch.add(PreparedRequest(tuple(p), params))
    times = []
    for _ in range(steps + 8):
        start = time.perf_counter()
        batch.step(1)
        times.append(time.perf_counter() - start)
    batch.close()
    return statistics.median(times[8:]) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--rows", default="1,8,64,256")
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    engine = Engine.load(args.model, fuse=False)  # mlx-lm's own model
    ours_engine = Engine.load(args.model)  # as the server loads it (fused projections on a GPU)
    print(
        "| rows | forward: build ms | forward: eval ms | 4 forwards an eval, ms each | "
        "BatchGenerator step ms | mlx-trio step ms (fused on a GPU) | step / forward |"
    )
    print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for rows in (int(r) for r in args.rows.split(",")):
        build, run = forward(engine, rows, args.steps)
        four = chained(engine, rows, args.steps, 4)
        generator = generator_step(engine, rows, args.steps)
        ours = engine_step(ours_engine, rows, args.steps)
        print(
            f"| {rows} | {build:.2f} | {run:.2f} | {four:.2f} | {generator:.2f} | {ours:.2f} | "
            f"{generator / (build + run):.1f}x / {ours / (build + run):.1f}x |",
            flush=True,
        )


if __name__ == "__main__":
    main()
