"""Per-row sampling: mlx-trio's ``RowSampler`` against mlx-lm's ``make_sampler``.

Both sample every row of a batch on its own, as ``BatchGenerator`` does when rows have their own
samplers; same log-probabilities, interleaved rounds in one process; prints the median time per
batch step of each and their ratio. Usage:
``python -m bench.sampling [--rows 32] [--vocab 49152] [--rounds 7]``.

A micro-benchmark beside the harness (design/014-bench.md): the harness's streams are greedy,
and this times one piece of a sampled step, with no model at all.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

from mlx_trio.engine import _blas  # noqa: F401  (loads OpenBLAS: before MLX below)

# isort: split
import mlx.core as mx

from mlx_trio.engine.params import SamplingParams
from mlx_trio.engine.vocabulary.sampling import RowSampler, Sampler

CASES = {
    "temperature": SamplingParams(temperature=0.8),
    "top_p": SamplingParams(temperature=0.8, top_p=0.9),
    "all filters": SamplingParams(temperature=0.8, top_p=0.9, min_p=0.05, top_k=40),
}


def mlx_lm_sampler(params: SamplingParams) -> Sampler:
    from mlx_lm.sample_utils import make_sampler

    return make_sampler(
        temp=params.temperature, top_p=params.top_p, min_p=params.min_p, top_k=params.top_k
    )


def step_ms(make: Callable[[], Sampler], logprobs: mx.array, steps: int) -> float:
    """Milliseconds per batch step, each row sampled by its own sampler."""
    samplers = [make() for _ in range(logprobs.shape[0])]

    def step() -> None:
        mx.eval(mx.concatenate([s(logprobs[i : i + 1]) for i, s in enumerate(samplers)]))

    step()  # trace and warm up
    start = time.perf_counter()
    for _ in range(steps):
        step()
    return (time.perf_counter() - start) / steps * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rows", type=int, default=32)
    parser.add_argument("--vocab", type=int, default=49152)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args()

    logits = mx.random.normal((args.rows, args.vocab))
    logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    mx.eval(logprobs)
    print(f"{args.rows} rows, vocabulary {args.vocab}, device {mx.default_device()}")
    print(f"{'case':<12} {'mlx-lm ms':>10} {'mlx-trio ms':>12} {'ratio':>6}")
    for name, params in CASES.items():
        theirs, ours = [], []
        for round_ in range(args.rounds):
            pair = [
                (theirs, lambda p=params: mlx_lm_sampler(p)),
                (ours, lambda p=params: RowSampler(p)),
            ]
            for times, make in pair if round_ % 2 == 0 else pair[::-1]:
                times.append(step_ms(make, logprobs, args.steps))
        a, b = statistics.median(theirs), statistics.median(ours)
        print(f"{name:<12} {a:>10.2f} {b:>12.2f} {b / a:>6.2f}")


if __name__ == "__main__":
    main()
