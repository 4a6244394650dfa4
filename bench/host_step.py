"""The batch engine's host time a call, on a model whose arithmetic is next to nothing (issue 39).

On a GPU a batch step is paced by the device or by the host that encodes the next step's kernels
and does the rows' work (mlx-lm's batch, the rows' tokens, detokenizing, the hand-out). This
measures the host's part alone: a model of the bench's quick shape (2 layers, hidden 128) over
the 256 byte ids, so a step's arithmetic is microseconds and a call's time is MLX's scheduling
and Python. ``--rows`` greedy rows of ``--max-tokens`` each join at once (the vocabulary holds no
stop token: every row runs to ``max_tokens``), one step a call, as ``BatchEngine.step(1)`` is
called; the mean time of a call after the join, the best of ``--runs`` runs on one engine.
``--profile`` prints cProfile's top functions of one more run.

    python -m bench.host_step --rows 32,128 --max-tokens 96
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import time

from mlx_trio.engine import _blas  # noqa: F401  (loads OpenBLAS: before MLX below)

# isort: split
import mlx.core as mx
from mlx_lm.models.llama import ModelArgs

from mlx_trio.api.bench.models import SHAPE_QUICK, SPECIALS, make_engine
from mlx_trio.engine.batch.batch import BatchEngine
from mlx_trio.engine.generate import Engine
from mlx_trio.engine.model.random_model import byte_level_tokenizer, random_llama
from mlx_trio.engine.params import SamplingParams

JOINED_BY = 3  # calls: the rows' prefill and first step, before the decode steps timed


def build_engine() -> Engine:
    """The quick shape over the 256 byte ids; the tokenizer's specials lie past the model's
    vocabulary, so no row samples its stop token."""
    args = ModelArgs(model_type="llama", rms_norm_eps=1e-5, vocab_size=256, **SHAPE_QUICK)
    model = random_llama(args)
    # Unit-scale embeddings: greedy tokens wander instead of repeating one.
    model.update({"model": {"embed_tokens": {"weight": mx.random.normal((256, args.hidden_size))}}})
    mx.eval(model.parameters())
    tokenizer = byte_level_tokenizer([], SPECIALS, eos_token=SPECIALS[2], bos_token=SPECIALS[0])
    return make_engine(model, tokenizer, dtype="float32", quantized=False)


def call_time(
    engine: Engine, rows: int, max_tokens: int, profile: cProfile.Profile | None
) -> float:
    """Seconds a call, mean over the calls after the join."""
    batch = BatchEngine(engine, max_batch=rows)
    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    for i in range(rows):
        batch.add(engine.prepare(f"row {i}: the rows' work and MLX's scheduling, timed", params))
    calls, started = 0, 0.0
    while batch.num_rows:
        if calls == JOINED_BY:
            started = time.perf_counter()
            if profile is not None:
                profile.enable()
        batch.step(1)
        calls += 1
    if profile is not None:
        profile.disable()
    return (time.perf_counter() - started) / (calls - JOINED_BY)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="32,128", help="comma-separated row counts")
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--profile", action="store_true", help="cProfile one more run a size")
    args = parser.parse_args()
    engine = build_engine()
    for rows in (int(n) for n in args.rows.split(",")):
        times = [call_time(engine, rows, args.max_tokens, None) for _ in range(args.runs)]
        listed = ", ".join(f"{t * 1e3:.2f}" for t in times)
        print(f"{rows} rows: {min(times) * 1e3:.2f} ms a call (runs: {listed})", flush=True)
        if args.profile:
            profile = cProfile.Profile()
            call_time(engine, rows, args.max_tokens, profile)
            pstats.Stats(profile).sort_stats("tottime").print_stats(15)


if __name__ == "__main__":
    main()
