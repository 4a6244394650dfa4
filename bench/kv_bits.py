"""Quantized KV under a fixed memory limit: rows admitted and tok/s, full against 4-bit KV.

The same load, ``--requests`` greedy chat streams sent at once, each a unique prompt of about
``--prompt-words`` words and ``--max-tokens`` new tokens, runs on one runtime per scheme, each
under ``--memory-limit``: admission counts each request's projected KV against the budget's KV
pool, so the smaller a token's KV, the more rows run together. Reports per scheme the budget's
KV bytes a token, the most rows live at once (sampled), the wall time and generated tok/s,
with the ratios 4-bit / full (the goals: >= 2.5x rows, >= 1.5x tok/s). The order of the
schemes alternates over ``--rounds``.
Usage: ``python -m bench.kv_bits [--memory-limit 1GB] [--requests 32] [--rounds 2]``.

``--micro``: the model's forward alone, per scheme: a prompt of ``--context`` tokens prefilled,
then decode steps of 8, 11 and 24 rows at that context (tok/s of each): where a step's time goes.
"""

from __future__ import annotations

import argparse
import logging
import statistics
import time
from dataclasses import dataclass

import trio

from mlx_trio.actors.messages import GenerationRequest
from mlx_trio.api.inprocess import RuntimeHandle, open_runtime
from mlx_trio.engine.budget import MemoryLimit
from mlx_trio.engine.params import SamplingParams
from mlx_trio.engine.vocabulary.prompt import ChatMessage

WORDS = [
    "river",
    "stone",
    "bread",
    "clock",
    "owl",
    "glass",
    "tide",
    "map",
    "bee",
    "lamp",
    "cloud",
    "seed",
]


@dataclass(frozen=True, slots=True)
class Run:
    bits: int | None
    kv_bytes_per_token: int
    most_rows: int
    seconds: float
    tokens: int

    @property
    def tok_s(self) -> float:
        return self.tokens / self.seconds


def prompt(i: int, words: int) -> tuple[ChatMessage, ...]:
    body = " ".join(WORDS[(i * 7 + k * 5) % len(WORDS)] for k in range(words))
    return (ChatMessage("user", f"Note {i}. Summarize these words: {body}"),)


async def load(rt: RuntimeHandle, args: argparse.Namespace, offset: int) -> tuple[int, int, float]:
    """The load once: (tokens generated, most rows live at once, seconds)."""
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens)
    tokens = most = 0

    async def one(i: int) -> None:
        nonlocal tokens
        collected = await rt.collect(
            GenerationRequest(prompt(offset + i, args.prompt_words), params)
        )
        tokens += len(collected.token_ids)

    started = time.perf_counter()
    async with trio.open_nursery() as nursery:
        for i in range(args.requests):
            nursery.start_soon(one, i)

        async def watch() -> None:
            nonlocal most
            while True:
                most = max(most, rt.statistics().active_rows)
                await trio.sleep(0.05)

        nursery.start_soon(watch)
        while tokens == 0 or rt.statistics().live_sessions:
            await trio.sleep(0.1)
        nursery.cancel_scope.cancel()
    return tokens, most, time.perf_counter() - started


async def run_scheme(args: argparse.Namespace, bits: int | None, offset: int) -> Run:
    async with open_runtime(
        device="cpu",
        memory_limit=MemoryLimit.parse(args.memory_limit),
        kv_bits=bits,
        max_batch=args.requests,
        prompt_cache_bytes=0,
    ) as rt:
        budget = rt.statistics().memory_budget
        await load(rt, argparse.Namespace(**{**vars(args), "requests": 2, "max_tokens": 4}), 10**6)
        tokens, most, seconds = await load(rt, args, offset)
    assert budget is not None
    return Run(bits, budget.kv_bytes_per_token, most, seconds, tokens)


def micro(context: int) -> None:
    """Prefill and decode-step times of the default model's forward, float32 against 4 bits."""
    import copy

    import mlx.core as mx

    from mlx_trio.engine.batch.quantized_kv import KVScheme
    from mlx_trio.engine.generate import Engine

    engine = Engine.load(None, device="cpu")
    model = engine.model
    tokens = mx.array([[(i * 31) % 40_000 + 100 for i in range(context)]])
    for bits in (None, 4, 8):
        make = KVScheme(bits).maker()
        mx.eval(model(tokens, cache=make(model)))  # warm
        caches = make(model)
        started = time.perf_counter()
        mx.eval(model(tokens, cache=caches))
        prefill = time.perf_counter() - started
        rates = []
        for rows in (8, 11, 24):
            batch = [c.merge([copy.deepcopy(c) for _ in range(rows)]) for c in caches]
            step = mx.array([[5]] * rows)
            mx.eval(model(step, cache=batch))
            started = time.perf_counter()
            for _ in range(5):
                mx.eval(model(step, cache=batch))
            rates.append(f"{rows} rows {5 * rows / (time.perf_counter() - started):.1f} tok/s")
        name = "full KV" if bits is None else f"{bits}-bit KV"
        print(f"{name}: prefill of {context} tokens {prefill:.2f} s; decode {', '.join(rates)}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--memory-limit", default="1GB")
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--prompt-words", type=int, default=300)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--micro", action="store_true", help="the forward alone (see above)")
    parser.add_argument("--context", type=int, default=700, help="--micro's prompt tokens")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    if args.micro:
        micro(args.context)
        return
    rows, rates = [], []
    for r in range(args.rounds):
        order = (None, 4) if r % 2 == 0 else (4, None)
        runs = {}
        for bits in order:
            run = trio.run(run_scheme, args, bits, 1000 * (r + 1))
            runs[bits] = run
            print(
                f"round {r + 1}, {'full KV' if bits is None else f'{bits}-bit KV'}: "
                f"{run.kv_bytes_per_token} B a token, at most {run.most_rows} rows at once, "
                f"{run.tokens} tokens in {run.seconds:.1f} s = {run.tok_s:.1f} tok/s",
                flush=True,
            )
        rows.append(runs[4].most_rows / runs[None].most_rows)
        rates.append(runs[4].tok_s / runs[None].tok_s)
        print(f"round {r + 1}, 4-bit / full: rows {rows[-1]:.2f}x, tok/s {rates[-1]:.2f}x")
    print(
        f"median 4-bit / full: rows {statistics.median(rows):.2f}x (goal >= 2.5x), "
        f"tok/s {statistics.median(rates):.2f}x (goal >= 1.5x)"
    )


if __name__ == "__main__":
    main()
