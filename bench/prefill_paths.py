"""Issue 38's first lever, measured bare: a burst of long prompts of unequal lengths prefilled
by mlx-lm's ``BatchGenerator`` (rows left-padded to one length under an array mask, which sends
attention to MLX's unfused path on CUDA) against each prompt prefilled alone into a cache of its
own (a causal mask: the fused attention kernel), then handed to the same ``BatchGenerator`` with
that cache, as the engine hands it a prompt-cache hit. Both end at every prompt's first token,
greedy; the first tokens must agree.

    python -m bench.prefill_paths --shape 1b --prompts 16 --tokens 2048 --rounds 3

Prints prompt tokens a second for each path (best of the rounds after a warm-up round, which
compiles the kernels of every shape) and their ratio. Random weights of a Llama shape. The
alone path runs unpadded and with its last chunks padded (the engine's way): with
``--fresh-lengths`` each round's prompts have new lengths, so a path whose shapes do not repeat
compiles kernels again every round.
"""

from __future__ import annotations

import argparse
import functools
import random
import time
from collections.abc import Callable
from types import SimpleNamespace

from mlx_trio.engine import _blas  # noqa: F401  (loads OpenBLAS: before MLX below)

# isort: split
import mlx.core as mx
from mlx_lm.generate import BatchGenerator
from mlx_lm.models import llama

from mlx_trio.engine.batch.alone import AlonePrefill
from mlx_trio.engine.model.random_model import random_llama
from mlx_trio.engine.padded_prefill import PAD_GRANULE

SHAPES = {
    "tiny": dict(hidden_size=64, num_hidden_layers=2, intermediate_size=128,
                 num_attention_heads=4, num_key_value_heads=2, vocab_size=512),
    "1b": dict(hidden_size=2048, num_hidden_layers=16, intermediate_size=8192,
               num_attention_heads=32, num_key_value_heads=8, vocab_size=128256),
    "8b": dict(hidden_size=4096, num_hidden_layers=32, intermediate_size=14336,
               num_attention_heads=32, num_key_value_heads=8, vocab_size=128256),
}  # fmt: skip


def llama_of(shape: str) -> llama.Model:
    args = llama.ModelArgs(model_type="llama", rms_norm_eps=1e-5, rope_theta=500000.0,
                           tie_word_embeddings=False, **SHAPES[shape])  # fmt: skip
    dtype = mx.bfloat16 if mx.default_device() == mx.gpu else mx.float32
    return random_llama(args, dtype=dtype)


def prompts_of(count: int, tokens: int, vocab: int, seed: int) -> list[list[int]]:
    """Unequal lengths, 75-100% of ``tokens``, as a burst of real prompts would be."""
    rng = random.Random(seed)
    return [
        [rng.randrange(1, vocab) for _ in range(rng.randint(tokens * 3 // 4, tokens))]
        for _ in range(count)
    ]


def first_tokens(generator: BatchGenerator, uids: list[int]) -> dict[int, int]:
    firsts: dict[int, int] = {}
    while len(firsts) < len(uids):
        for response in generator.next_generated():
            firsts.setdefault(response.uid, response.token)
    return firsts


def batched(model: llama.Model, prompts: list[list[int]], chunk: int) -> list[int]:
    """mlx-lm's way: the prompts inserted together, prefilled as one left-padded batch."""
    generator = BatchGenerator(
        model, max_tokens=1, prefill_batch_size=len(prompts), prefill_step_size=chunk,
        completion_batch_size=len(prompts),
    )  # fmt: skip
    uids = generator.insert(prompts, max_tokens=[1] * len(prompts))
    firsts = first_tokens(generator, uids)
    generator.close()
    return [firsts[u] for u in uids]


def alone_then_batched(
    model: llama.Model, prompts: list[list[int]], chunk: int, pad: bool = False
) -> list[int]:
    """Each prompt but its last token prefilled alone (causal mask) by the engine's
    ``AlonePrefill`` (``pad``: its last chunk padded to a multiple of ``PAD_GRANULE``), its cache
    then inserted with that last token, as a prompt-cache hit is."""
    alone = AlonePrefill(model, max_chunk=chunk, checkpoints=False, pad=pad)
    for i, prompt in enumerate(prompts):
        alone.add(SimpleNamespace(id=i, cache_salt=None), prompt, None, None)  # type: ignore[arg-type]
    ready: dict[int, list] = {}
    while len(alone):
        for entry in alone.step(4 * chunk, lambda *_: None)[1]:
            ready[entry.row.id] = entry.caches
    generator = BatchGenerator(
        model, max_tokens=1, prefill_batch_size=len(prompts), prefill_step_size=chunk,
        completion_batch_size=len(prompts),
    )  # fmt: skip
    uids = generator.insert(
        [p[-1:] for p in prompts],
        max_tokens=[1] * len(prompts),
        caches=[ready[i] for i in range(len(prompts))],
        all_tokens=[p[:-1] for p in prompts],
    )
    firsts = first_tokens(generator, uids)
    generator.close()
    return [firsts[u] for u in uids]


def timed(path: Callable[[], list[int]]) -> tuple[float, list[int]]:
    mx.synchronize()
    start = time.perf_counter()
    tokens = path()
    mx.synchronize()
    return time.perf_counter() - start, tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="tiny")
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--chunk", type=int, default=2048, help="prefill chunk (both paths)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--fresh-lengths",
        action="store_true",
        help="new prompts (new lengths) each round, so each round meets shapes not compiled yet",
    )
    args = parser.parse_args()
    model = llama_of(args.shape)
    paths = {
        "batched (left-padded)": batched,
        "alone, then batched": alone_then_batched,
        f"alone, last chunk padded to {PAD_GRANULE}": functools.partial(
            alone_then_batched, pad=True
        ),
    }
    best: dict[str, float] = {}
    answers: dict[str, list[int]] = {}
    for round_ in range(args.rounds + 1):  # round 0 compiles every shape: not counted
        seed = round_ if args.fresh_lengths else 0
        prompts = prompts_of(args.prompts, args.tokens, SHAPES[args.shape]["vocab_size"], seed)
        total = sum(len(p) for p in prompts)
        for name, path in paths.items():
            seconds, tokens = timed(functools.partial(path, model, prompts, args.chunk))  # type: ignore[operator]
            answers[name] = tokens
            if round_:
                best[name] = min(best.get(name, float("inf")), seconds)
            print(f"round {round_} {name}: {seconds:.3f} s, {total / seconds:,.0f} prompt tok/s")
        base = answers["batched (left-padded)"]
        for name, tokens in answers.items():
            same = sum(a == b for a, b in zip(base, tokens, strict=True))
            print(f"round {round_}: {name}: first tokens agree with batched for {same} of "
                  f"{len(prompts)} prompts")  # fmt: skip
    base = best["batched (left-padded)"]
    for name, seconds in best.items():
        print(f"{args.shape}, {args.prompts} prompts of {args.tokens * 3 // 4}-{args.tokens} "
              f"tokens, chunk {args.chunk}: {name} takes {seconds / base:.2f}x the batched "
              f"time ({base / seconds:.2f}x its speed)")  # fmt: skip


if __name__ == "__main__":
    main()
