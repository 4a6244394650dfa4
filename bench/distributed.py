"""The engine over several ranks against one process: a batch of greedy rows on the batch
engine's calls (``EngineCore``), the same calls in both; per step, the time rank 0 spends
sending each call to the other ranks (``engine/ranks/distributed.py``'s ``Lockstep``).

    python -m bench.distributed [--ranks 2] [--parallel pipeline] [--rows 32] [--max-tokens 16]

Runs one process first, then ``mlx.launch`` with this module as each rank (``--as-rank``);
rank 0 prints its figures as JSON, and the table puts them side by side: tok/s, a step's
time, the broadcast's own time (sends with every rank idle) and its share of a step, and what a
step's send took in the run, timed once rank 0's previous step ended (it waits for that on the
stream they share), so that it counts the broadcast and the wait for the slowest rank.
Issue 25 asks the broadcast to cost < 10% of a step at 32 rows.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from functools import partial
from pathlib import Path

from mlx_trio.engine import _blas  # noqa: F401  (loads OpenBLAS: before MLX below)

# isort: split
import mlx.core as mx
from mlx_lm.generate import generation_stream

from mlx_trio.api.bench.scenarios import prompt
from mlx_trio.engine.calls import BatchAdd, BatchStep, answer
from mlx_trio.engine.core import EngineCore
from mlx_trio.engine.generate import Engine
from mlx_trio.engine.outputs import RowOutput
from mlx_trio.engine.params import SamplingParams
from mlx_trio.engine.ranks.distributed import NOOP
from mlx_trio.engine.ranks.rank_group import RankGroup
from mlx_trio.engine.vocabulary.prompt import ChatMessage

IDLE_SENDS = 50


def run(engine: Engine, rows: int, max_tokens: int) -> dict[str, float]:
    """One batch through the core's calls (as the runtime makes them): tok/s, a decode
    step's mean time, and the time spent sending calls to other ranks (0 on one process)."""
    core = EngineCore(engine, max_batch=rows)
    core.batch_reset()
    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    requests = tuple(engine.prepare((ChatMessage("user", prompt(i)),), params) for i in range(rows))
    lockstep = engine.lockstep
    sent_s = idle_ms = 0.0
    if lockstep is not None:
        # The broadcast alone: sends with every rank idle and waiting for them.
        mx.synchronize(generation_stream)
        lockstep.send(NOOP)
        start = time.perf_counter()
        for _ in range(IDLE_SENDS):
            lockstep.send(NOOP)
        idle_ms = (time.perf_counter() - start) / IDLE_SENDS * 1e3
        send = lockstep.send

        def timed(message: object) -> None:
            # A send waits for the step still running on its stream: let that end first.
            # What is left is the broadcast and the wait for the slowest rank to be ready.
            nonlocal sent_s
            mx.synchronize(generation_stream)
            start = time.perf_counter()
            send(message)
            sent_s += time.perf_counter() - start

        lockstep.send = timed  # type: ignore[method-assign]
    answer(core, BatchAdd(requests))
    tokens = 0
    answer(core, BatchStep(1, 0))  # the prefill, untimed
    sent_s = 0.0
    steps, start = 0, time.perf_counter()
    while core.num_rows:
        reply = answer(core, BatchStep(1, 0))
        steps += 1
        outputs = [e for e in reply.value or () if isinstance(e, RowOutput)]
        tokens += sum(len(e.delta.token_ids) for e in outputs)
    wall = time.perf_counter() - start
    if lockstep is not None:
        del lockstep.send  # the class's own again
    core.close()
    return {
        "tok_s": tokens / wall,
        "step_ms": wall / steps * 1e3,
        "send_ms": sent_s / steps * 1e3,
        "idle_send_ms": idle_ms,
        "steps": steps,
    }


def as_rank(args: argparse.Namespace) -> None:
    from mlx_trio.engine.ranks.distributed import build_rank, follow

    group = RankGroup(args.ranks, args.parallel)
    engine = build_rank(partial(Engine.load, None, prompt_cache_bytes=0), group)
    assert engine.lockstep is not None
    lockstep = engine.lockstep
    if lockstep.is_leader:
        run(engine, args.rows, 4)  # warm
        lockstep.send("again")
        result = run(engine, args.rows, args.max_tokens)
        lockstep.send("exit")
        print("RESULT " + json.dumps(result), flush=True)
        return
    while True:  # each run's core closes with a stop; then rank 0 says whether one follows
        core = EngineCore(engine, max_batch=args.rows)
        core.batch_reset()
        follow(core, lockstep)
        if lockstep.receive() == "exit":
            return


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--parallel", choices=["tensor", "pipeline"], default="pipeline")
    parser.add_argument("--rows", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--as-rank", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.as_rank:
        as_rank(args)
        return
    print(f"one process: {args.rows} rows x {args.max_tokens} tokens ...", flush=True)
    engine = Engine.load(None, prompt_cache_bytes=0)
    run(engine, args.rows, 4)
    one = run(engine, args.rows, args.max_tokens)
    del engine
    print(f"{args.ranks} ranks, {args.parallel} parallel (mlx.launch, ring) ...", flush=True)
    launch = Path(sys.executable).parent / "mlx.launch"
    command = [str(launch), "--backend", "ring", "-n", str(args.ranks), "--", sys.executable]
    command += ["-m", "bench.distributed", "--as-rank", *sys.argv[1:]]
    done = subprocess.run(command, capture_output=True, text=True, timeout=1800)
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    if not lines:
        sys.exit(f"the ranks gave no result:\n{done.stderr[-3000:]}")
    ranks = json.loads(lines[0].removeprefix("RESULT "))
    print(
        f"\n| {args.rows} rows, greedy | tok/s | step ms | broadcast ms (its share) | "
        "send in a step ms, waiting for the other ranks included (its share) |"
    )
    print("| --- | --- | --- | --- | --- |")
    print(f"| one process | {one['tok_s']:.1f} | {one['step_ms']:.1f} | - | - |")
    idle, sent, step = ranks["idle_send_ms"], ranks["send_ms"], ranks["step_ms"]
    print(
        f"| {args.ranks} ranks ({args.parallel}) | {ranks['tok_s']:.1f} | {step:.1f} | "
        f"{idle:.2f} ({idle / step:.1%}) | {sent:.2f} ({sent / step:.1%}) |"
    )
    ratio = ranks["tok_s"] / one["tok_s"]
    print(f"ranks / one process: {ratio:.2f}x tok/s; the broadcast's share: goal < 10%")


if __name__ == "__main__":
    main()
