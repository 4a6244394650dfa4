"""What a prefill shape costs the first time a GPU meets it (issue 39's lone-stream first token).

A short prompt's first token on the H200 took 67-120 ms where its forward needs about 10 ms.
MLX builds per shape what a prefill runs (attention for each query and key length, the
products' plans for each row count), so this times one forward of ``new`` tokens on top of
caches already holding ``hit`` tokens, evaluated, for shapes met the first time and again:

- ``repeat``: the same (hit, new) as the warm-up: the forward's own cost;
- ``new length``: no hit, a new prompt length each time (what ``generate_step`` does);
- ``padded, fresh hit``: the new tokens padded to 128, on a hit of a new length each time (a
  prompt cache's hit is the prompt's common prefix with an earlier one: any length);
- ``padded, hit cut to 128s``: the same, the hit cut back to a multiple of 128 (the tokens
  cut off prefilled again with the rest), so that both lengths repeat.

Usage::

    python -m bench.prefill_shapes [--model DIR|ID] [--times 6]
"""

from __future__ import annotations

import argparse
import statistics
import time

from mlx_trio.engine import _blas  # noqa: F401  (loads OpenBLAS: before MLX below)

# isort: split
import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache

from mlx_trio.engine.generate import Engine

G = 128


def forward_ms(model: object, hit: int, new: int, token: int = 7) -> float:
    """One forward of ``new`` tokens over caches holding ``hit``, evaluated; its ms."""
    caches = make_prompt_cache(model)
    if hit:
        model(mx.array([[token] * hit]), cache=caches)  # type: ignore[operator]
        mx.eval([c.state for c in caches])
    start = time.perf_counter()
    logits = model(mx.array([[token] * new]), cache=caches)  # type: ignore[operator]
    mx.eval(logits, [c.state for c in caches])
    return (time.perf_counter() - start) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="a directory or hub id (default: ours)")
    parser.add_argument("--times", type=int, default=6, help="fresh shapes of each kind")
    args = parser.parse_args()
    engine = Engine.load(args.model, prompt_cache_bytes=0)
    model = engine.model
    print(f"model {engine.model_id} ({engine.loaded.dtype} on {engine.loaded.device})")
    for hit in (0, G):  # warm-up: the repeated shapes, and the hits' own prefills
        forward_ms(model, hit, G)
        forward_ms(model, hit, G)

    rows: dict[str, list[float]] = {
        "repeat (hit 128, new 128)": [forward_ms(model, G, G) for _ in range(args.times)],
        "new length (no hit, new 40+k)": [forward_ms(model, 0, 40 + k) for k in range(args.times)],
        "padded, fresh hit (hit 20+k, new 128)": [
            forward_ms(model, 20 + k, G) for k in range(args.times)
        ],
        "padded, hit cut to 128s (hit 128, new 128)": [
            forward_ms(model, (130 + k) // G * G, G) for k in range(args.times)
        ],
    }
    print("| shapes | first forward of each, ms | median |")
    print("| --- | --- | ---: |")
    for name, values in rows.items():
        each = ", ".join(f"{v:.1f}" for v in values)
        print(f"| {name} | {each} | {statistics.median(values):.1f} |")


if __name__ == "__main__":
    main()
