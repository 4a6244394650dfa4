"""A lone stream's cost, layer by layer (issue 39: one stream at >= 0.9x raw ``generate_step``).

One model, one process, greedy, interleaved rounds. Each layer's time to its first token and
decode time a token (from its first token to its last), median over the rounds; every run's
prompt is new past the chat template's first tokens, and of a length not seen before, as a
server's requests are (the engine's prompt cache then holds that prefix; a GPU builds kernels
for each new prefill shape):

- ``generate_step``: mlx-lm's own loop over mlx-lm's model (projections unfused): the bound;
- ``generate_step, ours``: the same loop over the model as mlx-trio loads it (fused);
- ``engine step``: mlx-trio's batch engine holding the one row (its solo row), a step a call,
  the tokens decoded as each call hands them out; ``unpadded``: its prompt prefilled as
  ``generate_step`` does, not in chunks padded so that shapes repeat (a GPU's default,
  ``engine/padded_prefill.py``); ``hit unaligned``: padded, but on the prompt cache's hit as
  it comes, not cut back to a multiple of the padding;
- ``engine call``: the same as the engine process answers a call: ``answer`` (the core's state
  after it included) and the reply pickled, a call every step (what a lone HTTP stream makes it
  do, design/030).

What is left between ``engine call`` and a client over HTTP is the process hop and the server's
loop: ``mlx-trio bench --scenarios chat:1 --systems stream_generate,mlx-trio-http`` measures
that on the same model. Usage::

    python -m bench.lone_stream [--model DIR|ID] [--rounds 5] [--max-tokens 128]
"""

from __future__ import annotations

import argparse
import pickle
import statistics
import time
from collections.abc import Callable, Iterator

from mlx_trio.engine import _blas  # noqa: F401  (loads OpenBLAS: before MLX below)

# isort: split
import mlx.core as mx
from mlx_lm.generate import generate_step

from mlx_trio.engine import padded_prefill
from mlx_trio.engine.calls import BatchStep, answer
from mlx_trio.engine.core import EngineCore
from mlx_trio.engine.generate import Engine
from mlx_trio.engine.outputs import RowOutput
from mlx_trio.engine.params import PreparedRequest, SamplingParams

PROMPT = "Write a long story about a lighthouse keeper who finds a map in a bottle."


Timing = tuple[float, float, int]  # ms to the first token, ms a token after it, tokens


def timing(started: float, stamps: list[tuple[float, int]]) -> Timing:
    """From the start and (time, tokens so far) stamps after each token's arrival."""
    stamps = [s for s in stamps if s[1] > 0]
    (first, n0), (last, n) = stamps[0], stamps[-1]
    assert n > n0, "too few tokens to time"
    return (first - started) * 1e3, (last - first) * 1e3 / (n - n0), n


def raw_steps(engine: Engine, request: PreparedRequest, max_tokens: int) -> Iterator[int]:
    prompt = mx.array(list(request.prompt_tokens))
    for token, _ in generate_step(prompt, engine.model, max_tokens=max_tokens):
        yield token


def time_raw(engine: Engine, request: PreparedRequest, max_tokens: int) -> Timing:
    started = time.perf_counter()
    stamps = []
    for n, _ in enumerate(raw_steps(engine, request, max_tokens), 1):
        stamps.append((time.perf_counter(), n))
    return timing(started, stamps)


def time_core(engine: Engine, request: PreparedRequest, *, replies: bool) -> Timing:
    """The engine core with one row, a ``BatchStep(1)`` a call; ``replies``: answered and
    pickled as the engine process does."""
    core = EngineCore(engine, max_batch=8)
    started = time.perf_counter()
    core.batch_add([request])
    stamps = []
    n, done = 0, False
    call = BatchStep(1)
    while not done:
        if replies:
            reply = answer(core, call)
            pickle.dumps(reply, protocol=pickle.HIGHEST_PROTOCOL)
            events = reply.unwrap()
        else:
            events = core.batch_step(1)
        for event in events:
            if isinstance(event, RowOutput):
                n += len(event.delta.token_ids) or 1
                done |= event.stats is not None
        stamps.append((time.perf_counter(), n))
    core.close()
    return timing(started, stamps)


def unpadded(engine: Engine, request: PreparedRequest) -> Timing:
    pads, engine.pads_prefill = engine.pads_prefill, False
    try:
        return time_core(engine, request, replies=False)
    finally:
        engine.pads_prefill = pads


def unaligned(engine: Engine, request: PreparedRequest) -> Timing:
    padded_prefill.ALIGN = False
    try:
        return time_core(engine, request, replies=False)
    finally:
        padded_prefill.ALIGN = True


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="a directory or hub id (default: ours)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--max-tokens", type=int, default=128)
    args = parser.parse_args()

    ours = Engine.load(args.model, prompt_cache_bytes=None)
    raw = Engine.load(args.model, fuse=False)
    print(f"model {ours.model_id} ({ours.loaded.dtype} on {ours.loaded.device})", flush=True)
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens)

    layers: dict[str, Callable[[PreparedRequest], Timing]] = {
        "generate_step": lambda request: time_raw(raw, request, args.max_tokens),
        "generate_step, ours": lambda request: time_raw(ours, request, args.max_tokens),
        "engine step, unpadded": lambda request: unpadded(ours, request),
        "engine step, hit unaligned": lambda request: unaligned(ours, request),
        "engine step": lambda request: time_core(ours, request, replies=False),
        "engine call": lambda request: time_core(ours, request, replies=True),
    }
    runs = 0

    def request() -> PreparedRequest:
        nonlocal runs
        runs += 1
        # A new length each run: a word more than the run before.
        content = f"{PROMPT} {' '.join(['Again.'] * runs)}"
        return ours.prepare([{"role": "user", "content": content}], params)

    for run in layers.values():  # warm-up: every kernel shape, the prompt cache filled
        run(request())
    times: dict[str, list[Timing]] = {name: [] for name in layers}
    for r in range(args.rounds):
        for name, run in layers.items():
            ttft, ms, n = run(request())
            times[name].append((ttft, ms, n))
            print(
                f"round {r + 1}/{args.rounds}  {name:20s} first token {ttft:7.2f} ms, then "
                f"{ms:6.3f} ms a token ({n})",
                flush=True,
            )

    bound = statistics.median(t[1] for t in times["generate_step"])
    print()
    print("| layer | first token ms | ms a token | tok/s | generate_step / layer |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for name, values in times.items():
        ttft = statistics.median(t[0] for t in values)
        ms = statistics.median(t[1] for t in values)
        print(f"| {name} | {ttft:.1f} | {ms:.3f} | {1e3 / ms:,.0f} | {bound / ms:.2f}x |")


if __name__ == "__main__":
    main()
