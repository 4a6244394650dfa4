"""Multi-turn chat with a long system prompt, with the prompt cache on and off, in one run.

8 conversations of 6 turns each, run concurrently (turns in order within a conversation), with a
~1,000-token system prompt; each turn resends the whole conversation, as chat clients do. Reports
TTFT p50/p99 for the first turn and for turns 2-6, and the total time, with the ratios.
Usage: ``python -m bench.prompt_cache [--model M] [--conversations 8] [--turns 6]``.

A micro-benchmark beside the harness (design/014-bench.md): the harness's streams each send one
prompt, so a cache could only help with the chat template's prefix; this one is about the turns
after the first, and about the same runtime with the cache on and off.
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import dataclass

import trio

from mlx_trio.actors.config import RuntimeConfig
from mlx_trio.actors.engine_port.thread import EngineThread, ThreadedEngine
from mlx_trio.actors.messages import Completed, GenerationRequest, TextDelta
from mlx_trio.api.inprocess import open_runtime
from mlx_trio.engine.generate import Engine
from mlx_trio.engine.params import SamplingParams
from mlx_trio.engine.vocabulary.prompt import ChatMessage

RULES = [
    "Answer in one or two sentences.",
    "Never invent facts; say when you do not know.",
    "Prefer plain words over jargon.",
    "Use metric units unless asked otherwise.",
    "When asked for a list, give at most three items.",
    "Do not repeat the question back.",
]
QUESTIONS = [
    "What is a river delta?",
    "Why is the sky blue?",
    "How do bees make honey?",
    "What causes tides?",
    "Why do leaves change color?",
    "How does a compass work?",
]


def system_prompt(engine: Engine, target_tokens: int) -> str:
    """A system prompt of about ``target_tokens`` tokens."""
    lines = []
    i = 0
    while True:
        lines.append(f"Rule {i + 1}: {RULES[i % len(RULES)]} (section {i // len(RULES) + 1})")
        text = "\n".join(lines)
        if len(engine.tokenizer.encode(text)) >= target_tokens:
            return text
        i += 1


@dataclass
class Turn:
    conversation: int
    turn: int
    ttft_s: float
    cached_tokens: int
    prompt_tokens: int


async def run_mode(
    port: ThreadedEngine, system: str, conversations: int, turns: int, max_tokens: int
) -> tuple[list[Turn], float]:
    config = RuntimeConfig(max_batch=conversations, max_live=conversations)
    results: list[Turn] = []
    async with open_runtime(engine=port, config=config) as rt:

        async def converse(c: int) -> None:
            messages = [ChatMessage("system", system)]
            for t in range(turns):
                messages.append(ChatMessage("user", f"[{c}] {QUESTIONS[(c + t) % len(QUESTIONS)]}"))
                request = GenerationRequest(
                    tuple(messages), SamplingParams(temperature=0, max_tokens=max_tokens)
                )
                start = trio.current_time()
                first = None
                text = ""
                async for event in await rt.submit(request):
                    if isinstance(event, TextDelta):
                        first = first or trio.current_time()
                        text += event.text
                    elif isinstance(event, Completed):
                        usage = event.usage
                assert first is not None
                results.append(Turn(c, t, first - start, usage.cached_tokens, usage.prompt_tokens))
                messages.append(ChatMessage("assistant", text))

        start = time.perf_counter()
        async with trio.open_nursery() as nursery:
            for c in range(conversations):
                nursery.start_soon(converse, c)
        elapsed = time.perf_counter() - start
    return results, elapsed


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def main_async(args: argparse.Namespace) -> None:
    with EngineThread() as thread:
        on = await thread.run(
            lambda: Engine.load(args.model, prompt_cache_bytes=args.prompt_cache_bytes)
        )
        off = Engine(on.loaded, prompt_cache_bytes=0)
        system = system_prompt(on, args.system_tokens)
        print(
            f"{on.model_id}: {args.conversations} conversations x {args.turns} turns, "
            f"system prompt {len(on.tokenizer.encode(system))} tokens",
            flush=True,
        )
        rows = {}
        for name, engine in (("cache off", off), ("cache on", on)):
            port = ThreadedEngine.over(engine, thread, max_batch=args.conversations)
            await port.batch_reset()
            turns, elapsed = await run_mode(
                port, system, args.conversations, args.turns, args.max_tokens
            )
            later = [t.ttft_s for t in turns if t.turn > 0]
            first = [t.ttft_s for t in turns if t.turn == 0]
            cached = sum(t.cached_tokens for t in turns) / sum(t.prompt_tokens for t in turns)
            rows[name] = (
                statistics.median(first),
                percentile(first, 0.99),
                statistics.median(later),
                percentile(later, 0.99),
                elapsed,
                cached,
            )
            print(f"{name}: done in {elapsed:.1f} s", flush=True)
        if on.prompt_cache is not None:
            print(f"prompt cache: {on.prompt_cache.statistics()}")

    print()
    print(
        "| mode | TTFT p50 turn 1 | TTFT p99 turn 1 | TTFT p50 turns 2+ | TTFT p99 turns 2+ "
        "| total | prompt tokens reused |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for name, (f50, f99, l50, l99, total, cached) in rows.items():
        print(
            f"| {name} | {f50 * 1e3:.0f} ms | {f99 * 1e3:.0f} ms | {l50 * 1e3:.0f} ms "
            f"| {l99 * 1e3:.0f} ms | {total:.1f} s | {cached:.0%} |"
        )
    off_row, on_row = rows["cache off"], rows["cache on"]
    print(
        f"cache on vs off: TTFT p50 turns 2+ {off_row[2] / on_row[2]:.1f}x lower (goal >= 5x), "
        f"p99 {off_row[3] / on_row[3]:.1f}x lower, total time {off_row[4] / on_row[4]:.2f}x faster"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default=None)
    parser.add_argument("--conversations", type=int, default=8)
    parser.add_argument("--turns", type=int, default=6)
    parser.add_argument("--system-tokens", type=int, default=1000)
    parser.add_argument("--max-tokens", type=int, default=24)
    parser.add_argument("--prompt-cache-bytes", type=int, default=None)
    trio.run(main_async, parser.parse_args())


if __name__ == "__main__":
    main()
