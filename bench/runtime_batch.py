"""32 concurrent sessions through mlx-trio's in-process API against raw mlx-lm BatchGenerator.

Same model object, same prompts, same batch size and prefill settings, same process, interleaved
rounds; also the Trio event loop's lag (a 5 ms ticker) while the runtime's batch runs.
``--engine-process`` adds the runtime over an engine process (``ProcessEngine``, its own copy of
the model in a child) to each round.
Usage: ``python -m bench.runtime_batch [--model M] [--sessions 32] [--max-tokens 64]``.

A micro-benchmark beside the harness (design/014-bench.md): ``mlx-trio bench --gpu --systems
batch,inprocess,proc`` makes the same comparison on one model object, but on the random-weight
benchmark model with token-id prompts; this one runs a real model with its chat template, and
measures what the harness does not: the event loop's lag while the runtime batches.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from functools import partial

import trio

from mlx_trio.actors.config import RuntimeConfig
from mlx_trio.actors.engine_port.process import open_process_engine
from mlx_trio.actors.engine_port.thread import EngineThread, ThreadedEngine
from mlx_trio.actors.messages import Completed, GenerationRequest
from mlx_trio.actors.port import EnginePort
from mlx_trio.api.bench.scenarios import prompt
from mlx_trio.api.inprocess import open_runtime
from mlx_trio.engine.batch.batch import DEFAULT_PREFILL_CHUNK
from mlx_trio.engine.generate import Engine
from mlx_trio.engine.options import CoreRecipe
from mlx_trio.engine.params import SamplingParams
from mlx_trio.engine.vocabulary.prompt import ChatMessage

PREFILL_BATCH = 8
TICK_S = 0.005


def prompts(n: int) -> list[str]:
    return [prompt(i) for i in range(n)]


def raw_batch_generator(
    engine: Engine, tokenized: list[list[int]], max_tokens: int
) -> tuple[int, float]:
    """Generated tokens and seconds for mlx-lm's BatchGenerator on its own (engine thread)."""
    from mlx_lm.generate import BatchGenerator

    generator = BatchGenerator(
        engine.model,
        stop_tokens=[[t] for t in engine.tokenizer.eos_token_ids],
        completion_batch_size=len(tokenized),
        prefill_batch_size=PREFILL_BATCH,
        prefill_step_size=DEFAULT_PREFILL_CHUNK,
    )
    start = time.perf_counter()
    generator.insert(tokenized, max_tokens=[max_tokens] * len(tokenized))
    tokens = 0
    finished = 0
    while finished < len(tokenized):
        for response in generator.next_generated():
            tokens += 1
            finished += response.finish_reason is not None
    elapsed = time.perf_counter() - start
    generator.close()
    return tokens, elapsed


@asynccontextmanager
async def ticking(lags: list[float]) -> AsyncIterator[None]:
    """Run a 5 ms ticker on the event loop and record how late each tick is."""

    async def ticker() -> None:
        while True:
            before = trio.current_time()
            await trio.sleep(TICK_S)
            lags.append(trio.current_time() - before - TICK_S)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(ticker)
        yield
        nursery.cancel_scope.cancel()


async def through_runtime(port: EnginePort, questions: list[str], max_tokens: int) -> int:
    """Generated tokens for the work through mlx-trio's in-process API."""
    config = RuntimeConfig(max_batch=len(questions), max_live=len(questions))
    totals: list[int] = []
    async with open_runtime(engine=port, config=config) as rt:

        async def session(question: str) -> None:
            params = SamplingParams(temperature=0, max_tokens=max_tokens)
            handle = await rt.submit(GenerationRequest((ChatMessage("user", question),), params))
            async for event in handle:
                if isinstance(event, Completed):
                    totals.append(event.usage.completion_tokens)

        async with trio.open_nursery() as sessions:
            for question in questions:
                sessions.start_soon(session, question)
    assert len(totals) == len(questions), "every session must complete"
    return sum(totals)


def report(round_index: int, name: str, tokens: int, seconds: float) -> None:
    rate = tokens / seconds
    print(
        f"round {round_index + 1}: {name:26} {tokens} tokens in {seconds:6.2f} s = "
        f"{rate:6.1f} tok/s",
        flush=True,
    )


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def main_async(args: argparse.Namespace) -> None:
    async with AsyncExitStack() as stack:
        thread = stack.enter_context(EngineThread())
        engine = await thread.run(lambda: Engine.load(args.model))
        threaded = ThreadedEngine.over(engine, thread, max_batch=args.sessions)
        await threaded.batch_reset()
        ports: dict[str, EnginePort] = {"mlx-trio in-process": threaded}
        if args.engine_process:
            build = partial(Engine.load, args.model)
            opened = open_process_engine(CoreRecipe(build, args.sessions), engine.preparer)
            ports["in-process, engine process"] = await stack.enter_async_context(opened)
        questions = prompts(args.sessions)
        params = SamplingParams(temperature=0, max_tokens=args.max_tokens)
        tokenized = [
            list(engine.prepare([ChatMessage("user", q)], params).prompt_tokens) for q in questions
        ]
        print(
            f"model {engine.model_id}, {args.sessions} sessions x {args.max_tokens} tokens",
            flush=True,
        )
        await thread.run(raw_batch_generator, engine, tokenized[:4], 8)  # warm-up
        raw_rates: list[float] = []
        rates: dict[str, list[float]] = {name: [] for name in ports}
        lags: dict[str, list[float]] = {name: [] for name in ports}
        for r in range(args.rounds):
            # The ticker runs in both, so both pay for the event loop's wake-ups.
            async with ticking([]):
                start = time.perf_counter()
                tokens, _ = await thread.run(
                    raw_batch_generator, engine, tokenized, args.max_tokens
                )
                seconds = time.perf_counter() - start
            raw_rates.append(tokens / seconds)
            report(r, "raw BatchGenerator", tokens, seconds)
            for name, port in ports.items():
                async with ticking(lags[name]):
                    start = time.perf_counter()
                    tokens = await through_runtime(port, questions, args.max_tokens)
                    seconds = time.perf_counter() - start
                rates[name].append(tokens / seconds)
                report(r, name, tokens, seconds)

    raw = statistics.median(raw_rates)
    print()
    what = f"{args.sessions} concurrent, {args.max_tokens} tokens"
    print(
        f"| system ({what}) | aggregate tok/s (median of {args.rounds}) "
        "| event loop lag p50 / p99 |"
    )
    print("| --- | --- | --- |")
    print(f"| mlx-lm BatchGenerator (raw) | {raw:.1f} | |")
    for name, values in rates.items():
        ours = statistics.median(values)
        lag = lags[name]
        print(
            f"| {name} | {ours:.1f} ({ours / raw:.3f}x, goal >= 0.95) | "
            f"{percentile(lag, 0.5) * 1e3:.1f} / {percentile(lag, 0.99) * 1e3:.1f} ms |"
        )
    print("(event loop lag: a 5 ms ticker's lateness while batching; goal p99 < 25 ms)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default=None)
    parser.add_argument("--sessions", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--engine-process", action="store_true", help="also the runtime over an engine process"
    )
    trio.run(main_async, parser.parse_args())


if __name__ == "__main__":
    main()
