"""Where a burst of short chat prompts spends its time in the batch engine (issue 39).

The load of ``http_load --clients N`` in-process, without HTTP: ``--rows`` chat prompts
(``api/bench/scenarios.prompt``, so they share the chat template's prefix) join at once, each
generating ``--max-tokens`` greedy tokens, one call a step; the burst runs ``--bursts`` times on
one engine with the prompt cache on, so the first meets unwarmed shapes and an empty cache and
the later ones hit it. For each burst: the wall time to the last token, tok/s, TTFT p50/p99,
the steps by kind (the rows joining, decode, the step where rows end), and the time spent
giving ended rows' KV to the prompt cache (as idle work once their tokens are out); with
``--phases``, the time of each part of mlx-lm's batch (its merge of the joining rows' caches,
prefill, the first step, the join, decode steps, extracting an ended row's KV); with ``--host``,
the time in MLX's ``async_eval`` and ``eval`` (every caller's), nothing waited for. The lean
step calls ``async_eval`` for the next step while the device runs the one before: it encodes
the step's kernels there, and it also waits there for the device once more than 10 command
buffers are in flight (``MAX_ACTIVE_TASKS`` in MLX's ``transforms.cpp``). ``eval`` is a wait for
the device. What a step spends outside both is Python's: building the graph, the rows' work.

    python -m bench.burst_steps --model-dir /tmp/m8 --rows 128 --max-tokens 128
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections import defaultdict
from typing import Any

from mlx_trio.engine import _blas  # noqa: F401  (loads OpenBLAS: before MLX below)

# isort: split
import mlx.core as mx
import mlx_lm.generate  # noqa: F401  (the module: mlx_lm's package exports a function of its name)

from mlx_trio.api.bench.scenarios import prompt
from mlx_trio.engine.batch import batch as engine_batch
from mlx_trio.engine.batch import batch_rows
from mlx_trio.engine.batch.batch import BatchEngine
from mlx_trio.engine.batch.batch_rows import GeneratorRows
from mlx_trio.engine.generate import Engine
from mlx_trio.engine.outputs import RowOutput
from mlx_trio.engine.params import SamplingParams


class Phases:
    """Time spent in named functions (``--phases``: each waits for the device before and after,
    so its own device work is in its time; that serializes what would overlap)."""

    def __init__(self, sync: bool) -> None:
        self.sync = sync
        self.times: dict[str, list[float]] = defaultdict(list)
        self._undo: list[tuple[Any, str, Any]] = []

    def wrap(self, owner: Any, name: str, label: str | None = None) -> None:
        original = getattr(owner, name)
        times = self.times[label or name]
        sync = self.sync

        def timed(*a: Any, **k: Any) -> Any:
            if sync:
                mx.synchronize()
            began = time.perf_counter()
            try:
                return original(*a, **k)
            finally:
                if sync:
                    mx.synchronize()
                times.append(time.perf_counter() - began)

        setattr(owner, name, timed)
        self._undo.append((owner, name, original))

    def restore(self) -> None:
        for owner, name, original in reversed(self._undo):
            setattr(owner, name, original)
        self._undo.clear()

    def report(self) -> None:
        for label, times in sorted(self.times.items(), key=lambda kv: -sum(kv[1])):
            if times:
                print(
                    f"    {label:24s} {len(times):6d} calls {1000 * sum(times):9.1f} ms, "
                    f"mean {1000 * statistics.fmean(times):8.3f} ms",
                    flush=True,
                )


def phases(sync: bool, host: bool = False) -> Phases:
    """The commits always; with ``sync``, mlx-lm's batch's parts too; with ``host`` (and not
    ``sync``), MLX's encoding and waiting."""
    mlx_generate = sys.modules["mlx_lm.generate"]
    timed = Phases(sync)
    timed.wrap(batch_rows, "commit")
    timed.wrap(batch_rows, "commit_many")
    if host and not sync:
        timed.wrap(mx, "async_eval", "mx.async_eval (encoding)")
        timed.wrap(mx, "eval", "mx.eval (waiting)")
    if sync:
        timed.wrap(mlx_generate, "_merge_caches", "merge (rows' caches)")
        timed.wrap(mlx_generate.PromptProcessingBatch, "prompt", "prefill forward")
        timed.wrap(mlx_generate.PromptProcessingBatch, "split", "split (to generate)")
        timed.wrap(mlx_generate.PromptProcessingBatch, "generate", "generate (first step)")
        timed.wrap(mlx_generate.GenerationBatch, "extend", "extend (join the batch)")
        timed.wrap(mlx_generate.GenerationBatch, "next", "decode step")
        timed.wrap(mlx_generate.GenerationBatch, "extract_cache", "extract (an ended row)")
        timed.wrap(engine_batch.BatchEngine, "_add_now", "add (prompt-cache take)")
        timed.wrap(mx, "clear_cache")
    return timed


def commit_in_step() -> None:
    """As before the ended rows' KV waited for idle work: each row's given to the prompt cache
    (and evaluated) inside the step where it ends, one at a time."""
    step = GeneratorRows.step

    def stepped(self: GeneratorRows, *a: Any, **k: Any) -> bool:
        first = step(self, *a, **k)
        ended, self._ended = self._ended, []
        for tokens, caches, salt in ended:
            batch_rows.commit(self._engine, tokens, caches, salt)
        return first

    GeneratorRows.step = stepped  # type: ignore[method-assign]


def burst(engine: Engine, batch: BatchEngine, offset: int, args: argparse.Namespace) -> None:
    timed = phases(args.phases, args.host)
    params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens)
    steps: dict[str, list[float]] = defaultdict(list)
    start = time.perf_counter()
    for i in range(args.rows):
        request = engine.prepare([{"role": "user", "content": prompt(offset + i)}], params)
        batch.add(request)
    added = time.perf_counter() - start
    ttft: dict[int, float] = {}
    tokens = 0
    last = start
    while batch.num_rows:
        kind = "join" if batch._batch.num_preparing else "decode"  # a benchmark's look inside
        before = time.perf_counter()
        events = batch.step(1)
        now = time.perf_counter()
        ended = 0
        for event in events:
            if isinstance(event, RowOutput):
                ttft.setdefault(event.row, now - start)
                tokens += len(event.delta.token_ids)
                ended += event.stats is not None
                last = now
        steps["end" if ended else kind].append(now - before)
        while batch.may_step_ahead() and batch.step_ahead():  # idle work, as the engine runs
            pass
    timed.restore()
    wall = last - start  # to the last token, as a client sees it (idle work after is not)
    firsts = sorted(ttft.values())
    print(
        f"  wall {wall:.2f} s, {tokens / wall:,.0f} tok/s; adds {1000 * added:.0f} ms; TTFT "
        f"p50 {statistics.median(firsts):.3f} s, p99 {firsts[int(0.99 * (len(firsts) - 1))]:.3f} "
        f"s; cache {engine.prompt_cache.statistics() if engine.prompt_cache else None}",
        flush=True,
    )
    for kind, times in sorted(steps.items(), key=lambda kv: -sum(kv[1])):
        print(
            f"    {kind:8s} {len(times):5d} steps {sum(times):7.3f} s, "
            f"mean {1000 * statistics.fmean(times):7.1f} ms, max {1000 * max(times):7.1f} ms",
            flush=True,
        )
    timed.report()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-dir", default=None, help="default: the embedded default model")
    parser.add_argument("--rows", type=int, default=128)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--bursts", type=int, default=3)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--no-cache", action="store_true", help="the prompt cache off")
    parser.add_argument(
        "--same-prompts", action="store_true", help="every burst the first's prompts (shapes)"
    )
    parser.add_argument(
        "--keep-buffers", action="store_true", help="mx.clear_cache a no-op (mlx-lm's prefill)"
    )
    parser.add_argument(
        "--commit-in-step", action="store_true", help="ended rows' KV to the cache as before"
    )
    parser.add_argument(
        "--phases", action="store_true", help="time mlx-lm's parts, each waited for (slower)"
    )
    parser.add_argument(
        "--host", action="store_true", help="time MLX's encoding against its waits (no --phases)"
    )
    args = parser.parse_args()
    if args.commit_in_step:
        commit_in_step()
    if args.keep_buffers:
        mx.clear_cache = lambda: None
    engine = Engine.load(args.model_dir, prompt_cache_bytes=0 if args.no_cache else None)
    batch = BatchEngine(engine, max_batch=max(args.rows, 1), budget=engine.token_budget)
    for n in range(args.bursts):
        print(f"burst {n + 1}: {args.rows} rows x {args.max_tokens} tokens", flush=True)
        burst(engine, batch, 0 if args.same_prompts else n * args.rows, args)
    batch.close()
    mx.clear_cache()


if __name__ == "__main__":
    main()
