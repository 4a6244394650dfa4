"""Constrained rows beside free ones: a batch of 32 greedy rows, all free, against the same 32
with half of them held to a JSON schema (``engine/vocabulary/grammar.py``), on the batch engine; the
held rows' masks computed together (``lean_step.py``) and, for comparison, each in its own row's
processor call.

Interleaved rounds in one process on the default model; prints per round the batch's tok/s,
a free row's own tok/s (the free rows' tokens a row, over the time until the last of them
ended) and the ratios of the held batches to the free one, then their medians; checks that the
free rows' greedy tokens are the same in every batch. The schema asks for more than
``--max-tokens``, so every row, held or free, decodes that many tokens: the ratios are of a
step's cost. Issue 24 asks for >= 0.9x the batch's tok/s and >= 0.95x for the free rows.
Usage: ``python -m bench.structured [--rows 32] [--rounds 3] [--model DIR]``.

A micro-benchmark beside the harness (design/014-bench.md): the harness's servers run free rows
only, and this times what a grammar costs the rows beside it.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from mlx_trio.engine import _blas  # noqa: F401  (loads OpenBLAS: before MLX below)

# isort: split
from mlx_trio.api.bench.scenarios import prompt
from mlx_trio.engine.batch import lean_step
from mlx_trio.engine.batch.batch import BatchEngine
from mlx_trio.engine.generate import Engine
from mlx_trio.engine.outputs import RowOutput
from mlx_trio.engine.params import Grammar, SamplingParams
from mlx_trio.engine.vocabulary.prompt import ChatMessage

# Longer than any run's max_tokens (16 records of ~15 tokens): a held row decodes as many
# tokens as a free one, so that the batches compare the cost of a step, not how soon a JSON
# reply closes. Records of numbers, booleans and short strings: JSON's structure throughout.
RECORD = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 0, "maximum": 999},
        "ok": {"type": "boolean"},
        "tag": {"type": "string", "maxLength": 8},
    },
    "required": ["id", "ok", "tag"],
    "additionalProperties": False,
}
SCHEMA = {
    "type": "object",
    "properties": {
        "topic": {"type": "string", "maxLength": 24},
        "rating": {"type": "integer", "minimum": 1, "maximum": 5},
        "records": {"type": "array", "items": RECORD, "minItems": 16, "maxItems": 16},
    },
    "required": ["topic", "rating", "records"],
    "additionalProperties": False,
}


class PerRowMasks(lean_step.BatchMasks):
    """No rows for the batched masks: each grammar masks its own row in its processor call,
    as design/018's first version did."""

    def __init__(self, processors: Sequence[Sequence[Any] | None]) -> None:
        super().__init__(processors)
        self.rows = []


@contextmanager
def masks_per_row(per_row: bool) -> Iterator[None]:
    if not per_row:
        yield
        return
    batched, lean_step.BatchMasks = lean_step.BatchMasks, PerRowMasks  # type: ignore[misc]
    try:
        yield
    finally:
        lean_step.BatchMasks = batched  # type: ignore[misc]


def run_batch(
    engine: Engine, rows: int, kind: str, max_tokens: int
) -> tuple[float, float, dict[int, list[int]]]:
    """One batch of ``kind`` (see ``KINDS``): its tok/s, a free row's tok/s (the free rows'
    tokens a row, over the time until the last of them ended), and the free rows' tokens by
    prompt."""
    free = SamplingParams(temperature=0, max_tokens=max_tokens)
    held = SamplingParams(temperature=0, max_tokens=max_tokens, grammar=Grammar.json_schema(SCHEMA))
    batch = BatchEngine(engine, max_batch=rows, budget=engine.token_budget)
    kinds: dict[int, int | None] = {}  # row -> its prompt index if free, None if held
    started = time.perf_counter()
    for i in range(rows):
        is_held = kind != "free" and i % 2 == 1
        request = engine.prepare((ChatMessage("user", prompt(i)),), held if is_held else free)
        kinds[batch.add(request)] = None if is_held else i
    tokens: dict[int, list[int]] = {row: [] for row in kinds}
    free_done = started
    with masks_per_row(kind == "per-row"):
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


# free: no grammar; batched: half the rows held, masks computed together (lean_step.py);
# per-row: the same rows, each grammar masking its row in its own processor call.
KINDS = ("free", "batched", "per-row")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--model", default=None, help="a model spec (default: the embedded one)")
    args = parser.parse_args()
    engine = Engine.load(args.model)
    print(f"warming up ({args.rows} rows, the schema compiled once) ...", flush=True)
    run_batch(engine, args.rows, "batched", 4)
    run_batch(engine, args.rows, "per-row", 4)
    ratios: dict[str, list[float]] = {"batched": [], "per-row": [], "free-row": []}
    for r in range(args.rounds):
        order = KINDS[r % 3 :] + KINDS[: r % 3]  # each kind first in turn
        results = {kind: run_batch(engine, args.rows, kind, args.max_tokens) for kind in order}
        free_tps, free_row, free_tokens = results["free"]
        line = [f"round {r + 1}: {args.rows} free rows {free_tps:.1f} tok/s"]
        for kind in ("batched", "per-row"):
            tps, row_tps, tokens = results[kind]
            same = all(tokens[i] == free_tokens[i] for i in tokens)
            ratios[kind].append(tps / free_tps)
            if kind == "batched":
                ratios["free-row"].append(row_tps / free_row)
            line.append(
                f"half held, masks {kind} {tps:.1f} tok/s ({tps / free_tps:.2f}x), a free row "
                f"{row_tps / free_row:.2f}x, its greedy tokens the same: {same}"
            )
        print("; ".join(line), flush=True)
    median = {kind: statistics.median(values) for kind, values in ratios.items()}
    print(
        f"median of {args.rounds} rounds: half held with batched masks {median['batched']:.2f}x "
        f"the free batch's tok/s (goal >= 0.9x; masks per row {median['per-row']:.2f}x), its "
        f"free rows {median['free-row']:.2f}x (goal >= 0.95x)"
    )


if __name__ == "__main__":
    main()
