"""The in-process systems of the harness, one per subprocess, driven over a pipe.

``python -m mlx_trio.api.bench.worker SYSTEM`` loads the default model (float32 on CPU, prompt
cache off), prints one ready line, then answers one JSON line on stdout per JSON line on stdin:

- ``{"op": "run", "streams": [{"prompt": P, "max_tokens": M, "late": L}, ...]}``: a
  scenario's streams (``scenarios.Stream``), greedy, the late ones started once every other
  stream has its first token or has ended; the answer is the wall time and one
  ``RequestResult`` per stream, measured as ``stream`` measures an HTTP one.
- ``{"op": "cancel_probe", "streams": 8, "trials": 5, "prompt_offset": K}`` (``mlx-trio``
  only): with ``streams`` running, cancel one and count the batch steps started between the
  cancel and the row leaving the batch; one answer row per trial.

SYSTEM is ``stream_generate`` (mlx-lm's single-stream loop: N streams run one after another),
``batch_generator`` (mlx-lm's ``BatchGenerator`` on its own, all N inserted at once, the late
ones when the others have their first tokens) or ``mlx-trio`` (the in-process API over
``open_runtime``). Each runs in its own process so that its peak RSS is its own. Anything else
the process prints goes to stderr.

The raw mlx-lm systems are ``raw_systems``; they run OpenBLAS at its own thread count (one a
core), as mlx-lm does with OpenBLAS loaded and as ``mlx_lm.server`` runs in the harness;
mlx-trio chooses its own (``engine/threads.py``).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from collections.abc import Callable
from functools import partial
from typing import TextIO

import trio

from ...actors.config import RuntimeConfig
from ...actors.engine_port.thread import EngineThread, ThreadedEngine
from ...actors.messages import (
    Cancelled,
    Completed,
    Failed,
    GenerationRequest,
    TextDelta,
)
from ...engine import _blas
from ...engine.errors import MlxTrioError
from ...engine.generate import Engine
from ...engine.options import CoreRecipe, EngineOptions
from ...engine.vocabulary.prompt import ChatMessage
from ..inprocess import RuntimeHandle, SessionHandle, open_runtime
from .load import FirstTokens
from .raw_systems import Handler, params, raw_handler, stream_result, streams_of
from .scenarios import DEFAULT_SCENARIO, SCENARIOS, Stream, prompt
from .stream import StreamProgress
from .systems import MAX_BATCH, WARMUP_BURSTS, WARMUP_CLIENTS, WARMUP_MAX_TOKENS

SYSTEMS = ("stream_generate", "batch_generator", "mlx-trio")
PROBE_MAX_TOKENS = 256
PROBE_TOKENS_BEFORE_CANCEL = 3
PROBE_WAIT_S = 60.0


# -- mlx-trio in-process --------------------------------------------------------------------------


class WatchedEngine(ThreadedEngine):
    """The real engine port, plus a hook on ``batch_remove`` and the duration of each step.

    ``removals``: (rows in the batch before, after) for each ``batch_remove``.
    """

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.on_remove: Callable[[list[int]], None] | None = None
        self.removals: list[tuple[int, int]] = []
        self.step_s: list[float] = []

    async def batch_step(self, steps: int = 1, ahead: int = 0):  # type: ignore[override]
        started = time.perf_counter()
        events = await super().batch_step(steps, ahead)
        self.step_s.append(time.perf_counter() - started)
        return events

    async def batch_remove(self, rows: list[int]) -> None:
        if self.on_remove is not None:
            self.on_remove(rows)
        before = self.num_rows
        await super().batch_remove(rows)
        self.removals.append((before, self.num_rows))


async def _stream(
    rt: RuntimeHandle,
    index: int,
    stream: Stream,
    run_started: float,
    on_first: Callable[[], None] | None = None,
) -> dict:
    """One session read to its outcome, measured like an HTTP stream."""
    progress = StreamProgress(started=time.perf_counter(), on_first=on_first)
    error: str | None = None
    try:
        handle = await rt.submit(
            GenerationRequest((ChatMessage("user", stream.prompt),), params(stream.max_tokens))
        )
        async with handle:
            async for event in handle:
                match event:
                    case TextDelta(text=delta) if delta:
                        progress.content_arrived()
                    case Completed(usage=usage):
                        progress.usage_tokens = usage.completion_tokens
                    case Cancelled(reason=reason):
                        error = f"cancelled_{reason}"
                    case Failed(code=code):
                        error = f"failed_{code}"
    except MlxTrioError as exc:
        error = type(exc).__name__
    return stream_result(index, progress, time.perf_counter(), error, stream.late, run_started)


async def run_runtime(rt: RuntimeHandle, streams: list[Stream]) -> dict:
    """Every stream a session at once, the late ones once the others have first tokens."""
    results: list[dict] = [{}] * len(streams)
    first_tokens = FirstTokens(i for i, s in enumerate(streams) if not s.late)
    started = time.perf_counter()

    async def one(i: int) -> None:
        stream = streams[i]
        if stream.late:
            await first_tokens.all_started.wait()
            results[i] = await _stream(rt, i, stream, started)
            return
        try:
            results[i] = await _stream(rt, i, stream, started, partial(first_tokens.started, i))
        finally:
            first_tokens.started(i)

    async with trio.open_nursery() as nursery:
        for i in range(len(streams)):
            nursery.start_soon(one, i)
    return {"wall_s": time.perf_counter() - started, "requests": results}


async def _probe_once(rt: RuntimeHandle, port: WatchedEngine, first: int, streams: int) -> dict:
    """Start ``streams`` sessions; once all decode, cancel one at a random point of a step."""
    decoding = [0] * streams
    all_decoding = trio.Event()
    handles: list[SessionHandle] = []

    async def read(i: int, handle: SessionHandle) -> None:
        async with handle:
            async for event in handle:
                if isinstance(event, TextDelta):
                    decoding[i] += 1
                    if min(decoding) >= PROBE_TOKENS_BEFORE_CANCEL:
                        all_decoding.set()

    removed: dict[str, float | int] = {}

    def on_remove(rows: list[int]) -> None:
        if not removed:
            removed.update(steps=rt.statistics().batch_steps, at=time.perf_counter())

    with trio.fail_after(PROBE_WAIT_S):
        async with trio.open_nursery() as nursery:
            for i in range(streams):
                sampling = params(PROBE_MAX_TOKENS)
                request = GenerationRequest((ChatMessage("user", prompt(first + i)),), sampling)
                handles.append(await rt.submit(request))
                nursery.start_soon(read, i, handles[-1])
            await all_decoding.wait()
            port.step_s.clear()
            port.removals.clear()
            await trio.sleep(random.uniform(0, 0.2))  # land anywhere in a step
            port.on_remove = on_remove
            active_before = rt.statistics().active_rows
            steps_at_cancel = rt.statistics().batch_steps
            cancelled_at = time.perf_counter()
            outcome = await handles[0].cancel()
            while not port.removals:
                await trio.sleep(0.001)
            port.on_remove = None
            num_rows_before, num_rows_after = port.removals[0]
            step_s = list(port.step_s)
            for handle in handles[1:]:
                handle.cancel_nowait()
    return {
        "streams": streams,
        "active_rows_at_cancel": active_before,
        "outcome": type(outcome).__name__,
        "steps_between": removed["steps"] - steps_at_cancel,
        "freed_after_s": removed["at"] - cancelled_at,
        "num_rows_before_remove": num_rows_before,
        "num_rows_after_remove": num_rows_after,
        "median_step_s": statistics.median(step_s) if step_s else None,
    }


def runtime_handler(rt: RuntimeHandle, port: WatchedEngine) -> Handler:
    async def handle(command: dict) -> dict:
        match command["op"]:
            case "run":
                return await run_runtime(rt, streams_of(command))
            case "cancel_probe":
                trials = []
                first = command["prompt_offset"]
                for t in range(command["trials"]):
                    streams = command["streams"]
                    trials.append(await _probe_once(rt, port, first + t * streams, streams))
                    while rt.statistics().active_rows or rt.statistics().live_sessions:
                        await trio.sleep(0.01)
                return {"trials": trials}
            case op:
                raise ValueError(f"mlx-trio does not do {op!r}")

    return handle


# -- the command loop -----------------------------------------------------------------------------


async def serve_commands(handle: Handler, answers: TextIO) -> None:
    """Answer each command line on stdin until it closes."""
    while line := await trio.to_thread.run_sync(sys.stdin.readline):
        answer = await handle(json.loads(line))
        answers.write(json.dumps(answer) + "\n")
        answers.flush()


async def main_async(system: str, answers: TextIO, model: str | None = None) -> None:
    started = time.perf_counter()

    def ready(engine: Engine) -> None:
        load_s = time.perf_counter() - started
        answers.write(
            json.dumps({"ready": True, "model": engine.model_id, "load_s": load_s}) + "\n"
        )
        answers.flush()

    streams = SCENARIOS[DEFAULT_SCENARIO].with_max_tokens(WARMUP_MAX_TOKENS).streams
    bursts = [streams(WARMUP_CLIENTS, b * WARMUP_CLIENTS) for b in range(WARMUP_BURSTS)]
    warmups = [{"op": "run", "streams": [s.to_json() for s in burst]} for burst in bursts]
    if system != "mlx-trio":
        engine = Engine.load(model, fuse=False)  # mlx-lm's own model, as its users run it
        own = _blas.own_threads()
        if own is not None and "OPENBLAS_NUM_THREADS" not in os.environ:
            _blas.set_threads(own)  # mlx-lm's count with OpenBLAS loaded, as mlx_lm.server's
        handle = raw_handler(system, engine)
        for warmup in warmups:
            await handle(warmup)
        ready(engine)
        await serve_commands(handle, answers)
        return
    with EngineThread() as thread:
        options = EngineOptions(model=model, prompt_cache_bytes=0)
        port = await WatchedEngine.load(thread, CoreRecipe(options.loader(), MAX_BATCH))
        config = RuntimeConfig(max_batch=MAX_BATCH, max_live=2 * MAX_BATCH)
        async with open_runtime(engine=port, config=config) as rt:
            handle = runtime_handler(rt, port)
            for warmup in warmups:
                await handle(warmup)
            ready(port.engine)
            await serve_commands(handle, answers)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("system", choices=SYSTEMS)
    parser.add_argument(
        "--model", default=None, help="a model directory (default: the embedded one)"
    )
    args = parser.parse_args()
    answers = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # stray prints go to stderr; stdout carries only answers
    trio.run(main_async, args.system, answers, args.model)


if __name__ == "__main__":
    main()
