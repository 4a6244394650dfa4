"""OpenBLAS threads on the engine's real step: one thread, two, and the engine's choice.

Usage: ``python -m bench.blas_threads [--rounds N] [--steps K] [--cases decode-1,prefill-2]
[--prompt-tokens P] [--json FILE]``.

On the default model (float32 on CPU, prompt cache off) it times ``BatchEngine.step`` the way
the runtime calls it, with OpenBLAS on 1 and on 2 threads (``engine/_blas.set_threads``) and
at the count the engine's ``ThreadChooser`` picks call by call (``engine/threads.py``, probes
included), in rounds whose order rotates, so a noisy stretch of the machine hits every mode;
per case it prints each mode's median step and the median of the paired ratios to one thread
(below 1: faster than one thread), and per round the share of the CPU other processes took
(two threads lose badly when they share the cores). The cases:

- ``decode-N``: N rows decoding (N = 1: the lone row the batch engine steps with mlx-lm's
  ``generate_step``, the single stream's path); ``--steps`` steps a count and round, the first
  two after a switch left out (mlx-lm evaluates one step ahead);
- ``prefill-R``: R new prompts of ``--prompt-tokens`` tokens prefilled together in chunks of
  256 tokens a row (the CPU budget's chunk), from the first step to the rows' first tokens;
  per step, so a chunk against a longer context weighs as it does in a real prefill.

It also times the switch itself (``openblas_set_num_threads``, to the same and to the other
count). A micro-benchmark beside the harness (design/014-bench.md): the harness measures whole
systems under HTTP load; this measures the one engine step the thread count changes, which is
what ``engine/threads.py`` chooses from. Figures: design/017-cpu-threads-and-budget.md.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path

from mlx_trio.api.bench import cpu_share
from mlx_trio.api.bench.report import pct
from mlx_trio.engine import _blas
from mlx_trio.engine.batch.batch import BatchEngine
from mlx_trio.engine.batch.schedule import TokenBudget
from mlx_trio.engine.generate import Engine
from mlx_trio.engine.params import PreparedRequest, SamplingParams
from mlx_trio.engine.threads import ThreadChooser

Mode = int | str  # a thread count, or "auto": the engine's ThreadChooser
MODES: tuple[Mode, ...] = (1, 2, "auto")
CHUNK = 256
SETTLE_STEPS = 2  # steps after a switch left out: the step ahead ran at the other count
DEFAULT_CASES = "decode-1,decode-8,decode-32,prefill-1,prefill-2,prefill-3,prefill-4"
TEXT = (
    "The lighthouse keeper kept a log of every ship, every storm and every lamp he trimmed, "
    "and on the longest night of the year he found a map folded inside a green bottle. "
)


def prompt_tokens(engine: Engine, index: int, length: int) -> tuple[int, ...]:
    """``length`` token ids of a text that differs from ``index`` to ``index``."""
    ids = engine.tokenizer.encode(f"[{index}] " + TEXT * (length // 20 + 1))
    return tuple(ids[:length])


def request(tokens: tuple[int, ...], max_tokens: int) -> PreparedRequest:
    return PreparedRequest(tokens, SamplingParams(temperature=0, max_tokens=max_tokens))


def timed(call: Callable[[], object]) -> float:
    started = time.perf_counter()
    call()
    return time.perf_counter() - started


def decoding_batch(engine: Engine, rows: int) -> BatchEngine:
    """A batch with ``rows`` rows past their first token, with room for many more."""
    batch = BatchEngine(engine, max_batch=max(rows, 1))
    for i in range(rows):
        batch.add(request(prompt_tokens(engine, i, 24), 4096))
    started: set[int] = set()
    while len(started) < rows:
        started |= {e.row for e in batch.step(1) if hasattr(e, "delta")}
    return batch


def stepper(batch: BatchEngine, mode: Mode, chooser: ThreadChooser) -> Callable[[], float]:
    """A timed step of ``batch``: at a fixed count, or at the count ``chooser`` picks."""
    if mode != "auto":

        def fixed() -> float:
            return timed(lambda: batch.step(1))

        return fixed

    def chosen() -> float:
        chooser.begin(batch.shape())
        seconds = timed(lambda: batch.step(1))
        chooser.end(1)
        return seconds

    return chosen


def decode_steps(batch: BatchEngine, step: Callable[[], float], steps: int) -> list[float]:
    """``steps`` timed steps after ``SETTLE_STEPS`` untimed ones."""
    for _ in range(SETTLE_STEPS):
        step()
    return [step() for _ in range(steps)]


def prefill_batch(engine: Engine, rows: int, length: int, first: int) -> BatchEngine:
    """A batch of ``rows`` fresh prompts to prefill together, one new token each."""
    budget = TokenBudget(rows * length, rows * CHUNK, CHUNK)
    batch = BatchEngine(engine, max_batch=rows, budget=budget, solo=False)
    for i in range(rows):
        batch.add(request(prompt_tokens(engine, first + i, length), 1))
    return batch


def prefill_steps(batch: BatchEngine, step: Callable[[], float]) -> list[float]:
    """Each step of the batch's prefill, to its rows' first (and last) tokens."""
    times = []
    while batch.num_rows:
        times.append(step())
    batch.close()
    return times


def switch_cost(calls: int = 100_000) -> dict[str, float]:
    """Seconds a call of ``set_threads``: to the count it has, and to the other one."""
    _blas.set_threads(1)
    same = timed(lambda: [_blas.set_threads(1) for _ in range(calls)]) / calls
    flip = timed(lambda: [_blas.set_threads(1 + i % 2) for i in range(calls)]) / calls
    _blas.set_threads(1)
    return {"same_s": same, "other_s": flip}


def set_mode(mode: Mode) -> None:
    if mode != "auto":
        _blas.set_threads(int(mode))


def run_case(engine: Engine, case: str, rounds: int, steps: int, length: int) -> dict:
    kind, _, size = case.partition("-")
    rows = int(size)
    chooser = ThreadChooser((1, 2))
    per_mode: dict[Mode, list[float]] = {m: [] for m in MODES}
    ratios: dict[Mode, list[float]] = {m: [] for m in MODES[1:]}
    others: list[float | None] = []
    batch = decoding_batch(engine, rows) if kind == "decode" else None
    for r in range(rounds):
        seconds: dict[Mode, float] = {}
        before = cpu_share.sample([os.getpid()])
        for mode in MODES[r % len(MODES) :] + MODES[: r % len(MODES)]:
            set_mode(mode)
            if batch is not None:
                seconds[mode] = statistics.median(
                    decode_steps(batch, stepper(batch, mode, chooser), steps)
                )
            else:
                first = 1000 * (len(MODES) * r + MODES.index(mode))
                fresh = prefill_batch(engine, rows, length, first)
                seconds[mode] = statistics.mean(prefill_steps(fresh, stepper(fresh, mode, chooser)))
            per_mode[mode].append(seconds[mode])
        for mode in MODES[1:]:
            ratios[mode].append(seconds[mode] / seconds[1])
        others.append(cpu_share.other_share(before, cpu_share.sample([os.getpid()])))
        print(
            f"{case:10s} round {r + 1}/{rounds}: "
            + ", ".join(f"{m}: {seconds[m] * 1000:7.1f} ms" for m in MODES)
            + f"; other processes' CPU {pct(others[-1])}",
            flush=True,
        )
    if batch is not None:
        batch.close()
    _blas.set_threads(1)
    chosen = chooser.statistics()
    return {
        "case": case,
        "step_ms": {str(m): statistics.median(per_mode[m]) * 1000 for m in MODES},
        "ratio_to_1": {str(m): statistics.median(ratios[m]) for m in MODES[1:]},
        "rounds": [
            {"step_ms": {str(m): per_mode[m][r] * 1000 for m in MODES}, "other_cpu_share": o}
            for r, o in enumerate(others)
        ],
        "chooser": {"probes": chosen.probes, "switches": chosen.switches},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--prompt-tokens", type=int, default=512)
    parser.add_argument("--cases", default=DEFAULT_CASES)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()

    if _blas.openblas_path() is None:
        raise SystemExit("OpenBLAS is not loaded here: nothing to compare")
    engine = Engine.load(None, device="cpu")
    print(f"model {engine.model_id}, OpenBLAS {_blas.openblas_path()}", flush=True)
    cost = switch_cost()
    print(
        f"set_threads: {cost['same_s'] * 1e6:.2f} us to the same count, "
        f"{cost['other_s'] * 1e6:.2f} us to the other",
        flush=True,
    )
    results = [
        run_case(engine, case.strip(), args.rounds, args.steps, args.prompt_tokens)
        for case in args.cases.split(",")
    ]
    print()
    print("| case | 1 thread ms/step | 2 threads ms/step | chosen ms/step | 2 / 1 | chosen / 1 |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    for r in results:
        ms, x = r["step_ms"], r["ratio_to_1"]
        print(
            f"| {r['case']} | {ms['1']:.1f} | {ms['2']:.1f} | {ms['auto']:.1f} "
            f"| {x['2']:.2f}x | {x['auto']:.2f}x |"
        )
    if args.json is not None:
        args.json.write_text(json.dumps({"switch": cost, "cases": results}, indent=1) + "\n")


if __name__ == "__main__":
    main()
