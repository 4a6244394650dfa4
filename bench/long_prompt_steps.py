"""Where a long-prompt load's time goes in the batch engine, step by step (issue 38).

The load of ``long-context-gpu`` in-process, without HTTP: ``--requests`` unique prompts of
75-100% of ``--tokens`` tokens, ``--max-batch`` rows at a time (a new request takes the place of
each row that finishes), ``--max-tokens`` new tokens each, greedy. For each variant (long prompts
prefilled alone or in mlx-lm's padded batch; the prompt cache on or off) it prints the wall
time, TTFT p50/p99, and the steps by kind: how many, their time in all and on average, and
the time spent giving finished rows' KV to the prompt cache.

    python -m bench.long_prompt_steps --model-dir /tmp/m1b
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from collections import defaultdict
from dataclasses import dataclass, field

from mlx_trio.engine import _blas  # noqa: F401  (loads OpenBLAS: before MLX below)

# isort: split
import mlx.core as mx

from mlx_trio.engine.batch import batch_rows
from mlx_trio.engine.batch.batch import BatchEngine
from mlx_trio.engine.generate import Engine
from mlx_trio.engine.outputs import RowOutput
from mlx_trio.engine.params import PreparedRequest, SamplingParams


@dataclass
class Tally:
    steps: dict[str, list[float]] = field(default_factory=lambda: defaultdict(list))
    commit_s: float = 0.0
    commits: int = 0


def prompts(count: int, tokens: int, vocab: int, seed: int) -> list[tuple[int, ...]]:
    rng = random.Random(seed)
    return [
        tuple(rng.randrange(300, vocab - 300) for _ in range(rng.randint(tokens * 3 // 4, tokens)))
        for _ in range(count)
    ]


def kind_of(batch: BatchEngine) -> str:
    rows = batch._batch  # a benchmark's look inside
    alone = len(rows._alone)
    waiting = rows.num_preparing - alone
    decoding = rows.num_decoding
    parts = [f"alone {min(alone, 4)}{'+' if alone > 4 else ''}" if alone else ""]
    parts.append("batch-prefill" if waiting else "")
    parts.append("decode" if decoding else "")
    return " + ".join(p for p in parts if p) or "idle"


def run(engine: Engine, load: list[tuple[int, ...]], args: argparse.Namespace) -> None:
    tally = Tally()
    original = batch_rows.commit

    def timed_commit(*a, **k):  # type: ignore[no-untyped-def]
        start = time.perf_counter()
        original(*a, **k)
        tally.commit_s += time.perf_counter() - start
        tally.commits += 1

    batch_rows.commit = timed_commit  # type: ignore[assignment]
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    batch = BatchEngine(engine, max_batch=args.max_batch, budget=engine.token_budget)
    pending = list(load)
    sent: dict[int, float] = {}
    ttft: dict[int, float] = {}
    start = time.perf_counter()
    while pending and batch.num_rows < args.max_batch:
        sent[batch.add(PreparedRequest(prompt_tokens=pending.pop(0), params=params))] = start
    while batch.num_rows:
        kind = kind_of(batch)
        before = time.perf_counter()
        events = batch.step()
        now = time.perf_counter()
        tally.steps[kind].append(now - before)
        for event in events:
            if isinstance(event, RowOutput):
                ttft.setdefault(event.row, now - sent[event.row])
        while pending and batch.num_rows < args.max_batch:
            sent[batch.add(PreparedRequest(prompt_tokens=pending.pop(0), params=params))] = now
    wall = time.perf_counter() - start
    batch.close()
    batch_rows.commit = original  # type: ignore[assignment]
    firsts = sorted(ttft.values())
    print(
        f"  wall {wall:.2f} s, {len(load) * args.max_tokens / wall:,.0f} tok/s, "
        f"{sum(map(len, load)) / wall:,.0f} prompt tok/s; TTFT p50 {statistics.median(firsts):.2f} "
        f"s, p99 {firsts[int(0.99 * (len(firsts) - 1))]:.2f} s; prompt-cache puts "
        f"{tally.commits} in {tally.commit_s:.2f} s"
    )
    for kind, times in sorted(tally.steps.items(), key=lambda kv: -sum(kv[1])):
        print(
            f"    {kind:32s} {len(times):5d} steps {sum(times):7.2f} s, "
            f"mean {1000 * statistics.fmean(times):7.1f} ms, max {1000 * max(times):7.1f} ms"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-dir", required=True)
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--max-batch", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument(
        "--variants",
        default="alone+cache,alone,batched+cache,batched",
        help="each 'alone' or 'batched', with '+cache' (the prompt cache on) and '+it=N' (the "
        "iteration budget) if wanted",
    )
    parser.add_argument("--alone-from", type=int, default=None, help="(default: the device's)")
    args = parser.parse_args()
    for round_, variant in enumerate(["alone+cache (warm-up)", *args.variants.split(",")]):
        parts = variant.split(" ")[0].split("+")
        iteration = [int(p[3:]) for p in parts if p.startswith("it=")]
        engine = Engine.load(
            args.model_dir,
            prompt_cache_bytes=None if "cache" in parts else 0,
            prefill_alone_from=0 if "batched" in parts else args.alone_from,
            max_iteration_tokens=iteration[0] if iteration else None,
        )
        load = prompts(args.requests, args.tokens, engine.vocab_size, seed=round_)
        print(f"{variant}: {engine.token_budget}")
        run(engine, load, args)
        del engine
        mx.clear_cache()


if __name__ == "__main__":
    main()
