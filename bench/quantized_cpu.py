"""On CPU, 4-bit weights kept quantized or dequantized to float32 at load (issue 35).

The loader dequantizes a quantized checkpoint on CPU (``engine/model/loader.py``): MLX's CPU
quantized matmul is not BLAS-backed. This measures both forms of the default model on the real step,
in one process, rounds interleaved: decode at 1 row (``generate_step``) and 32 rows (mlx-lm's
``BatchGenerator``), and a prefill of 1,000 tokens; and the weights' bytes of each. Keeping the
weights quantized would be chosen where its time is within 1.25x of float32's everywhere.

    python -m bench.quantized_cpu [--rounds 3]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import mlx_trio.engine._blas  # noqa: F401  (loads OpenBLAS: before MLX below)

# isort: split
import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten
from mlx_lm.generate import BatchGenerator, generate_step
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.utils import dequantize_model
from mlx_lm.utils import load_model as mlx_lm_load_model

from mlx_trio.engine.model.model_store import pull_default_model

DECODE_TOKENS = 16
PREFILL_TOKENS = 1000
THRESHOLD = 1.25


def load(form: str) -> nn.Module:
    model, _ = mlx_lm_load_model(pull_default_model())
    model.set_dtype(mx.float32)  # float params (norms, scales) in float32 either way
    if form == "float32":
        model = dequantize_model(model)
    mx.eval(model.parameters())
    return model


def decode_one(model: nn.Module) -> float:
    """Seconds per token of one row's decode."""
    steps = generate_step(mx.array(list(range(100, 140))), model, max_tokens=DECODE_TOKENS + 1)
    next(steps)  # the prompt and first token: not decode
    start = time.perf_counter()
    for _ in steps:
        pass
    return (time.perf_counter() - start) / DECODE_TOKENS


def decode_rows(model: nn.Module, rows: int = 32) -> float:
    """Seconds per step of ``rows`` rows decoding together."""
    generator = BatchGenerator(model, completion_batch_size=rows, prefill_batch_size=rows)
    generator.insert(
        [[100 + i, 7, 9, 11] for i in range(rows)], max_tokens=[DECODE_TOKENS + 4] * rows
    )
    while len(generator._generation_batch) < rows:
        generator.next()
    for _ in range(2):
        generator.next()
    start = time.perf_counter()
    for _ in range(DECODE_TOKENS):
        generator.next()
    elapsed = (time.perf_counter() - start) / DECODE_TOKENS
    generator.close()
    return elapsed


def prefill(model: nn.Module) -> float:
    """Seconds to prefill ``PREFILL_TOKENS`` tokens (chunks of 512, as the engine does)."""
    tokens = mx.array([[(7 * i) % 20000 + 10 for i in range(PREFILL_TOKENS)]])
    cache = make_prompt_cache(model)
    start = time.perf_counter()
    for at in range(0, PREFILL_TOKENS, 512):
        model(tokens[:, at : at + 512], cache=cache)
        mx.eval([c.state for c in cache])
    return time.perf_counter() - start


MEASURES: dict[str, Callable[[nn.Module], float]] = {
    "decode, 1 row (s/token)": decode_one,
    "decode, 32 rows (s/step)": decode_rows,
    f"prefill, {PREFILL_TOKENS} tokens (s)": prefill,
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    models = {form: load(form) for form in ("float32", "4-bit")}
    for form, model in models.items():
        size = sum(v.nbytes for _, v in tree_flatten(model.parameters()))
        print(f"{form}: weights {size / 2**20:.0f} MiB")
    for model in models.values():  # warm-up: first calls compile and allocate
        for measure in MEASURES.values():
            measure(model)
    times: dict[tuple[str, str], list[float]] = {}
    for round_ in range(args.rounds):
        for name, measure in MEASURES.items():
            for form, model in models.items():
                times.setdefault((name, form), []).append(measure(model))
        print(f"round {round_ + 1} of {args.rounds} done", flush=True)
    print(f"\n| step | float32 | 4-bit | 4-bit / float32 (<= {THRESHOLD} keeps 4-bit) |")
    print("| --- | --- | --- | --- |")
    worst = 0.0
    for name in MEASURES:
        f32 = statistics.median(times[(name, "float32")])
        q4 = statistics.median(times[(name, "4-bit")])
        worst = max(worst, q4 / f32)
        print(f"| {name} | {f32:.4f} | {q4:.4f} | {q4 / f32:.2f}x |")
    verdict = "keep 4-bit" if worst <= THRESHOLD else "dequantize to float32 (today's choice)"
    print(f"\nworst ratio {worst:.2f}x: {verdict}")


if __name__ == "__main__":
    main()
