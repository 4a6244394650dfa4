"""Single-stream decode: mlx-trio's engine against mlx-lm's own ``stream_generate``.

Same model object, same prompt, greedy, interleaved rounds in one process; prints each
round and the median ratio. Usage: ``python -m bench.engine_decode [--model M] [--rounds N]``.

A micro-benchmark beside the harness (design/014-bench.md): the harness measures systems through
the runtime or a server; this measures the engine's own serial path (``Engine.generate``, no
runtime, no event loop), decode only (from the first token to the last).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Iterable

from mlx_trio.engine.generate import Engine
from mlx_trio.engine.params import SamplingParams

PROMPT = "Write a long story about a lighthouse keeper who finds a map in a bottle."


def decode_rate(items: Iterable[object], count) -> tuple[float, int]:
    """Tokens per second between the first and the last item, and the token count."""
    first = last = None
    n = 0
    for item in items:
        now = time.perf_counter()
        first = first or now
        last = now
        n += count(item)
    assert first is not None and last is not None and n > 1
    return (n - 1) / (last - first), n


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default=None)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--max-tokens", type=int, default=128)
    args = parser.parse_args()

    from mlx_lm.generate import stream_generate

    engine = Engine.load(args.model)
    raw = Engine.load(args.model, fuse=False)  # mlx-lm's own model (ours may fuse projections)
    print(f"model {engine.model_id} ({engine.loaded.dtype} on {engine.loaded.device})", flush=True)
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens)
    request = engine.prepare([{"role": "user", "content": PROMPT}], params)
    prompt = list(request.prompt_tokens)

    def ours() -> tuple[float, int]:
        return decode_rate(engine.generate(request), lambda d: len(d.token_ids) or 1)

    def mlx_lm() -> tuple[float, int]:
        stream = stream_generate(raw.model, raw.tokenizer, prompt, max_tokens=args.max_tokens)
        return decode_rate(stream, lambda _: 1)

    ours()
    mlx_lm()  # warm-up
    rates: dict[str, list[float]] = {"mlx-trio engine": [], "mlx-lm stream_generate": []}
    for r in range(args.rounds):
        for name, run in (("mlx-trio engine", ours), ("mlx-lm stream_generate", mlx_lm)):
            rate, n = run()
            rates[name].append(rate)
            print(
                f"round {r + 1}/{args.rounds}  {name:24s} {rate:7.2f} tok/s ({n} tokens)",
                flush=True,
            )

    ours_median = statistics.median(rates["mlx-trio engine"])
    theirs_median = statistics.median(rates["mlx-lm stream_generate"])
    print()
    print("| system | decode tok/s (median) |")
    print("| --- | --- |")
    print(f"| mlx-lm stream_generate | {theirs_median:.2f} |")
    print(f"| mlx-trio engine | {ours_median:.2f} |")
    print(f"ratio mlx-trio / mlx-lm: {ours_median / theirs_median:.3f} (goal >= 0.97)")


if __name__ == "__main__":
    main()
