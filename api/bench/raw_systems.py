"""The harness's raw mlx-lm systems, and what every system of the worker (``worker``) shares.

``stream_generate`` serves one stream at a time, the streams one after another;
``batch_generator`` inserts the first streams at once into a fresh ``BatchGenerator`` and the
late ones when the first have their first tokens. Each stream is measured as ``stream``
measures an HTTP one, into the same ``RequestResult``. They run OpenBLAS at its own thread
count (one a core): mlx-lm's with OpenBLAS preloaded, as ``mlx_lm.server`` runs in the harness.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from dataclasses import asdict

from ...engine.generate import Engine
from ...engine.params import SamplingParams
from ...engine.vocabulary.prompt import ChatMessage
from .scenarios import Stream
from .stream import RequestResult, StreamProgress
from .systems import MAX_BATCH, PREFILL_BATCH, PREFILL_CHUNK

Handler = Callable[[dict], Awaitable[dict]]


def params(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens)


def streams_of(command: dict) -> list[Stream]:
    return [Stream(**s) for s in command["streams"]]


def prompt_tokens(engine: Engine, text: str, max_tokens: int) -> list[int]:
    """The prompt tokens every system gets: the chat template over one user message."""
    request = engine.prepare([ChatMessage("user", text)], params(max_tokens))
    return list(request.prompt_tokens)


def stream_result(
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
        results.append(stream_result(index, progress, end, None, stream.late, run_started))
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
        stream_result(i, p, ends[i], None, prompts[i][1].late, started)
        for i, p in enumerate(progress)
    ]


def raw_handler(system: str, engine: Engine) -> Handler:
    run = run_stream_generate if system == "stream_generate" else run_batch_generator

    async def handle(command: dict) -> dict:
        if command["op"] != "run":
            raise ValueError(f"{system} does not do {command['op']!r}")
        streams = streams_of(command)
        prompts = [(prompt_tokens(engine, s.prompt, s.max_tokens), s) for s in streams]
        started = time.perf_counter()
        requests = run(engine, prompts)
        return {"wall_s": time.perf_counter() - started, "requests": requests}

    return handle
