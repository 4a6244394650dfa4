"""LoRA adapter streams beside base streams, against base streams alone, in one run (issue 40).

Each round runs two waves of ``--streams`` concurrent greedy chat streams on one runtime, in an
order that alternates: all of them on the base model, then half of them on a random adapter
(rank ``--rank`` over the attention and MLP projections) and half on the base. Reports each
wave's generated tok/s and the paired ratio mixed / base (the goal: >= 0.8x).
Usage: ``python -m bench.adapters [--model M] [--streams 16] [--rounds 3] [--max-tokens 64]``.
"""

from __future__ import annotations

import argparse
import logging
import statistics
import tempfile
import time
from pathlib import Path

import trio

from mlx_trio.actors.messages import GenerationRequest
from mlx_trio.api.inprocess import RuntimeHandle, open_runtime
from mlx_trio.engine.model.loader import load_model
from mlx_trio.engine.model.random_model import random_adapter
from mlx_trio.engine.params import SamplingParams
from mlx_trio.engine.vocabulary.prompt import ChatMessage

logger = logging.getLogger("bench.adapters")

KEYS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
        "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")  # fmt: skip
TOPICS = ("rivers", "bread", "clocks", "owls", "glass", "tides", "maps", "bees")


async def wave(rt: RuntimeHandle, streams: int, tuned: int, max_tokens: int, offset: int) -> float:
    """``streams`` concurrent streams, the first ``tuned`` on the adapter; generated tok/s."""
    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    tokens = 0

    async def one(i: int) -> None:
        nonlocal tokens
        topic = TOPICS[i % len(TOPICS)]
        text = f"Request {offset + i}: write a long paragraph about {topic}."
        request = GenerationRequest(
            (ChatMessage("user", text),), params, adapter="tuned" if i < tuned else None
        )
        collected = await rt.collect(request)  # awaited first: ``+=`` would read tokens early
        tokens += len(collected.token_ids)

    started = time.perf_counter()
    async with trio.open_nursery() as nursery:
        for i in range(streams):
            nursery.start_soon(one, i)
    seconds = time.perf_counter() - started
    logger.info("%d streams (%d tuned): %d tokens in %.1f s", streams, tuned, tokens, seconds)
    return tokens / seconds


async def run(args: argparse.Namespace, adapter: Path) -> None:
    async with open_runtime(args.model, max_batch=args.streams, adapters={"tuned": adapter}) as rt:
        await wave(rt, args.streams, args.streams // 2, 8, 0)  # warm-up
        ratios, offset = [], 1000
        for r in range(args.rounds):
            order = ("base", "mixed") if r % 2 == 0 else ("mixed", "base")
            rates = {}
            for kind in order:
                tuned = args.streams // 2 if kind == "mixed" else 0
                rates[kind] = await wave(rt, args.streams, tuned, args.max_tokens, offset)
                offset += args.streams
            ratios.append(rates["mixed"] / rates["base"])
            print(
                f"round {r + 1}: {args.streams} base streams {rates['base']:.1f} tok/s, "
                f"{args.streams // 2} adapter + {args.streams - args.streams // 2} base "
                f"{rates['mixed']:.1f} tok/s: {ratios[-1]:.2f}x",
                flush=True,
            )
        print(f"median mixed / base: {statistics.median(ratios):.2f}x (goal >= 0.8x)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None, help="default: the embedded default model")
    parser.add_argument("--streams", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--rank", type=int, default=16)
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    logger.setLevel(logging.INFO)
    with tempfile.TemporaryDirectory() as tmp:
        model = load_model(args.model).model
        adapter = random_adapter(
            model, Path(tmp) / "tuned", seed=0, rank=args.rank, keys=KEYS, layers=len(model.layers)
        )
        del model
        trio.run(run, args, adapter)


if __name__ == "__main__":
    main()
