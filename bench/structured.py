"""Constrained rows beside free ones: a batch of 32 greedy rows, all free, against the same 32
with half of them held to a JSON schema (``engine/grammar.py``), on the batch engine.

Interleaved rounds in one process on the default model; prints per round the batch's tok/s,
a free row's own tok/s (the free rows' tokens a row, over the time until the last of them
ended) and the
ratios of the mixed batch to the free one, then their medians; checks that the free rows'
greedy tokens are the same in both batches. Issue 24 asks for >= 0.9x the batch's tok/s and
>= 0.95x for the free rows. Usage: ``python -m bench.structured [--rows 32] [--rounds 3]``.

A micro-benchmark beside the harness (design/014-bench.md): the harness's servers run free rows
only, and this times what a grammar costs the rows beside it.
"""

from __future__ import annotations

import argparse
import statistics
import time

from mlx_trio.engine import _blas  # noqa: F401  (loads OpenBLAS: before MLX below)

# isort: split
from mlx_trio.api.bench.scenarios import prompt
from mlx_trio.engine.batch import BatchEngine
from mlx_trio.engine.generate import Engine
from mlx_trio.engine.outputs import RowOutput
from mlx_trio.engine.params import Grammar, SamplingParams
from mlx_trio.engine.prompt import ChatMessage

SCHEMA = {
    "type": "object",
    "properties": {
        "topic": {"type": "string", "maxLength": 24},
        "facts": {"type": "array", "items": {"type": "string", "maxLength": 40}, "maxItems": 3},
        "rating": {"type": "integer", "minimum": 1, "maximum": 5},
    },
    "required": ["topic", "facts", "rating"],
    "additionalProperties": False,
}


def run_batch(
    engine: Engine, rows: int, constrained: bool, max_tokens: int
) -> tuple[float, float, dict[int, list[int]]]:
    """One batch: its tok/s, a free row's tok/s (the free rows' tokens a row, over the time
    until the last of them ended), and the free rows' tokens by prompt."""
    free = SamplingParams(temperature=0, max_tokens=max_tokens)
    held = SamplingParams(temperature=0, max_tokens=max_tokens, grammar=Grammar.json_schema(SCHEMA))
    batch = BatchEngine(engine, max_batch=rows, budget=engine.token_budget)
    kinds: dict[int, int | None] = {}  # row -> its prompt index if free, None if held
    started = time.perf_counter()
    for i in range(rows):
        is_held = constrained and i % 2 == 1
        request = engine.prepare((ChatMessage("user", prompt(i)),), held if is_held else free)
        kinds[batch.add(request)] = None if is_held else i
    tokens: dict[int, list[int]] = {row: [] for row in kinds}
    free_done = started
    while batch.num_rows:
        for event in batch.step(1):
            if isinstance(event, RowOutput):
                tokens[event.row].extend(event.delta.token_ids)
                if event.stats is not None and kinds[event.row] is not None:
                    free_done = time.perf_counter()
    wall = time.perf_counter() - started
    free_tokens = {i: t for r, t in tokens.items() if (i := kinds[r]) is not None}
    total = sum(len(t) for t in tokens.values())
    free_total = sum(len(t) for t in free_tokens.values())
    per_free_row = free_total / len(free_tokens) / (free_done - started)
    return total / wall, per_free_row, free_tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=48)
    args = parser.parse_args()
    engine = Engine.load(None)
    print(f"warming up ({args.rows} rows, the schema compiled once) ...", flush=True)
    run_batch(engine, args.rows, True, 4)
    batch_ratios, free_ratios = [], []
    for r in range(args.rounds):
        order = (False, True) if r % 2 == 0 else (True, False)
        results = {kind: run_batch(engine, args.rows, kind, args.max_tokens) for kind in order}
        (all_free, free_free, tokens_a), (mixed, mixed_free, tokens_b) = (
            results[False],
            results[True],
        )
        same = all(tokens_b[i] == tokens_a[i] for i in tokens_b)
        batch_ratios.append(mixed / all_free)
        free_ratios.append(mixed_free / free_free)
        print(
            f"round {r + 1}: {args.rows} free rows {all_free:.1f} tok/s; half held to a schema "
            f"{mixed:.1f} tok/s ({mixed / all_free:.2f}x); a free row {mixed_free:.2f} tok/s "
            f"against {free_free:.2f} ({mixed_free / free_free:.2f}x); free rows' greedy "
            f"tokens the same: {same}",
            flush=True,
        )
    print(
        f"median of {args.rounds} rounds: the mixed batch {statistics.median(batch_ratios):.2f}x "
        f"the free batch's tok/s (goal >= 0.9x), its free rows "
        f"{statistics.median(free_ratios):.2f}x (goal >= 0.95x)"
    )


if __name__ == "__main__":
    main()
