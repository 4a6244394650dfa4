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

The raw mlx-lm systems run OpenBLAS at its own thread count (one a core), as mlx-lm does with
OpenBLAS loaded and as ``mlx_lm.server`` runs in the harness; mlx-trio chooses its own
(``engine/threads.py``).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import asdict
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
from ...engine.params import SamplingParams
from ...engine.prompt import ChatMessage
from ..inprocess import RuntimeHandle, SessionHandle, open_runtime
from .load import FirstTokens
from .scenarios import DEFAULT_SCENARIO, SCENARIOS, Stream, prompt
from .stream import RequestResult, StreamProgress
from .systems import MAX_BATCH, PREFILL_BATCH, PREFILL_CHUNK, WARMUP_CLIENTS, WARMUP_MAX_TOKENS

SYSTEMS = ("stream_generate", "batch_generator", "mlx-trio")
PROBE_MAX_TOKENS = 256
PROBE_TOKENS_BEFORE_CANCEL = 3
PROBE_WAIT_S = 60.0

Handler = Callable[[dict], Awaitable[dict]]


def _params(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens)


def _streams(command: dict) -> list[Stream]:
    return [Stream(**s) for s in command["streams"]]


def _tokens(engine: Engine, text: str, max_tokens: int) -> list[int]:
    """The prompt tokens every system gets: the chat template over one user message."""
    request = engine.prepare([ChatMessage("user", text)], _params(max_tokens))
    return list(request.prompt_tokens)


def _result(
    index: int,
    progress: StreamProgress,
    end: float,
    error: str | None,
    late: bool,
    run_started: float,
) -> dict:
    result = RequestResult(
        client=index,
        index=0,
        ttft_s=progress.ttft_s,
        inter_token_s=tuple(progress.gaps),
        completion_tokens=progress.completion_tokens,
        elapsed_s=end - progress.started,
        error=error,
        detail=None,
        late=late,
        sent_s=progress.started - run_started,
    )
    return asdict(result)


# -- raw mlx-lm -----------------------------------------------------------------------------------


Prompts = list[tuple[list[int], Stream]]  # each stream's prompt tokens, and the stream


def run_stream_generate(engine: Engine, prompts: Prompts) -> list[dict]:
    """Each prompt through ``stream_generate``, one after another (it serves one stream)."""
    from mlx_lm.generate import stream_generate

    results = []
    run_started = time.perf_counter()
    for index, (tokens, stream) in enumerate(prompts):
        progress = StreamProgress(started=time.perf_counter())
        steps = stream_generate(engine.model, engine.tokenizer, tokens, stream.max_tokens)
        for response in steps:
            if response.finish_reason != "stop":  # the end-of-turn token is not text
                progress.content_arrived()
            progress.usage_tokens = progress.num_chunks
        end = time.perf_counter()
        results.append(_result(index, progress, end, None, stream.late, run_started))
    return results


def run_batch_generator(engine: Engine, prompts: Prompts) -> list[dict]:
    """The first streams inserted at once into a fresh ``BatchGenerator`` with mlx-trio's
    settings, the late ones once every first stream has its first token."""
    from mlx_lm.generate import BatchGenerator

    generator = BatchGenerator(
        engine.model,
        stop_tokens=[[t] for t in engine.tokenizer.eos_token_ids],
        completion_batch_size=MAX_BATCH,
        prefill_batch_size=PREFILL_BATCH,
        prefill_step_size=PREFILL_CHUNK,
    )
    started = time.perf_counter()
    progress = [StreamProgress(started=started) for _ in prompts]
    ends = [started] * len(prompts)
    index_of: dict[int, int] = {}

    def insert(indices: list[int]) -> None:
        now = time.perf_counter()
        for i in indices:
            progress[i].started = now
        uids = generator.insert(
            [prompts[i][0] for i in indices],
            max_tokens=[prompts[i][1].max_tokens for i in indices],
        )
        index_of.update(zip(uids, indices, strict=True))

    late = [i for i, (_, stream) in enumerate(prompts) if stream.late]
    first = [i for i, (_, stream) in enumerate(prompts) if not stream.late]
    insert(first)
    remaining = len(first)
    finished: set[int] = set()
    while remaining or late:
        if late and all(progress[i].ttft_s is not None or i in finished for i in first):
            insert(late)
            remaining += len(late)
            late = []
        for response in generator.next_generated():
            i = index_of[response.uid]
            if response.finish_reason != "stop":
                progress[i].content_arrived()
            if response.finish_reason is not None:
                ends[i] = time.perf_counter()
                progress[i].usage_tokens = progress[i].num_chunks
                finished.add(i)
                remaining -= 1
    generator.close()
    return [
        _result(i, p, ends[i], None, prompts[i][1].late, started) for i, p in enumerate(progress)
    ]


def raw_handler(system: str, engine: Engine) -> Handler:
    run = run_stream_generate if system == "stream_generate" else run_batch_generator

    async def handle(command: dict) -> dict:
        if command["op"] != "run":
            raise ValueError(f"{system} does not do {command['op']!r}")
        streams = _streams(command)
        prompts = [(_tokens(engine, s.prompt, s.max_tokens), s) for s in streams]
        started = time.perf_counter()
        requests = run(engine, prompts)
        return {"wall_s": time.perf_counter() - started, "requests": requests}

    return handle


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

    async def batch_step(self, steps: int = 1):  # type: ignore[override]
        started = time.perf_counter()
        events = await super().batch_step(steps)
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
            GenerationRequest((ChatMessage("user", stream.prompt),), _params(stream.max_tokens))
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
    return _result(index, progress, time.perf_counter(), error, stream.late, run_started)


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
                params = _params(PROBE_MAX_TOKENS)
                request = GenerationRequest((ChatMessage("user", prompt(first + i)),), params)
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
                return await run_runtime(rt, _streams(command))
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


async def main_async(system: str, answers: TextIO) -> None:
    started = time.perf_counter()

    def ready(engine: Engine) -> None:
        load_s = time.perf_counter() - started
        answers.write(
            json.dumps({"ready": True, "model": engine.model_id, "load_s": load_s}) + "\n"
        )
        answers.flush()

    streams = SCENARIOS[DEFAULT_SCENARIO].with_max_tokens(WARMUP_MAX_TOKENS).streams
    warmup = {"op": "run", "streams": [s.to_json() for s in streams(WARMUP_CLIENTS, 0)]}
    if system != "mlx-trio":
        engine = Engine.load(None)
        own = _blas.own_threads()
        if own is not None and "OPENBLAS_NUM_THREADS" not in os.environ:
            _blas.set_threads(own)  # mlx-lm's count with OpenBLAS loaded, as mlx_lm.server's
        handle = raw_handler(system, engine)
        await handle(warmup)
        ready(engine)
        await serve_commands(handle, answers)
        return
    with EngineThread() as thread:
        port = await WatchedEngine.load(
            thread, None, device="auto", max_batch=MAX_BATCH, prompt_cache_bytes=0
        )
        config = RuntimeConfig(max_batch=MAX_BATCH, max_live=2 * MAX_BATCH)
        async with open_runtime(engine=port, config=config) as rt:
            handle = runtime_handler(rt, port)
            await handle(warmup)
            ready(port.engine)
            await serve_commands(handle, answers)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("system", choices=SYSTEMS)
    args = parser.parse_args()
    answers = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # stray prints go to stderr; stdout carries only answers
    trio.run(main_async, args.system, answers)


if __name__ == "__main__":
    main()
