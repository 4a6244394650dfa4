"""One wave of each of the GPU run's systems: ``concurrency`` streams, start to last token.

Every system runs in this process on one model object (``models``), so that a wave of the
runtime and the raw wave it is paired with (``wave_runner``) differ only in the code around
mlx-lm's steps (``wave_plan.WAVE_SYSTEMS``):

- ``raw generate_step``: mlx-lm's single-stream loop (1 stream only);
- ``raw BatchGenerator``: mlx-lm's continuous batching, all streams inserted at once;
- ``mlx-trio in-process``: concurrent sessions through ``open_runtime`` (batch lane);
- ``in-process, 1 step a call``: the same with ``steps_per_call=1``, the runtime as it was
  before it took several steps a call for large fast batches (the ablation);
- ``mlx-trio serial``: one ``reproducible`` session, mlx-lm's ``generate_step`` under the
  runtime (1 stream only);
- ``mlx-trio HTTP``: ``api.server.serve`` in this process, streaming clients in a separate
  process (``http_load``, the harness's load generator), so that they do not share this
  process's GIL;
- ``in-process, engine process`` and ``HTTP, engine process``: the same two with the engine in
  a child process of its own (``ProcessEngine``) instead of on a thread beside the event loop.

Every system gets the same prompts (:func:`probes.prompt_ids`: fixed random ids per prompt
text), greedy decoding, ``max_tokens`` new tokens, stop on the tokenizer's end-of-turn id,
``max_batch`` rows and mlx-trio's prefill settings. Raw waves run on the engine thread.
"""

from __future__ import annotations

import gc
import json
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import trio

from ...actors.config import RuntimeConfig
from ...actors.messages import Completed, GenerationRequest
from ...engine.batch.batch import DEFAULT_PREFILL_CHUNK
from ...engine.generate import Engine
from ...engine.params import SamplingParams
from .models import MODEL_ID
from .probes import TokenIdPort, next_timer, prompt_ids, settle
from .scenarios import prompt as prompt_text
from .wave_plan import HTTP, INPROCESS, WavePlan

PREFILL_BATCH = 8  # BatchEngine's default, used by the raw BatchGenerator too


# -- the raw baselines (engine thread) --------------------------------------------------------


def raw_generate_step(engine: Engine, prompt: tuple[int, ...], max_tokens: int) -> int:
    import mlx.core as mx
    from mlx_lm.generate import generate_step

    stop = set(engine.tokenizer.eos_token_ids)
    tokens = 0
    for token, _ in generate_step(mx.array(prompt), engine.model, max_tokens=max_tokens):
        tokens += 1
        if token in stop:
            break
    return tokens


def raw_batch_generator(
    engine: Engine, prompts: list[tuple[int, ...]], max_tokens: int, max_batch: int
) -> tuple[int, int]:
    """Generated tokens and steps (``next()`` calls) of mlx-lm's BatchGenerator on its own."""
    from mlx_lm.generate import BatchGenerator

    generator = BatchGenerator(
        engine.model,
        stop_tokens=[[t] for t in engine.tokenizer.eos_token_ids],
        completion_batch_size=max_batch,
        prefill_batch_size=min(PREFILL_BATCH, max_batch),
        prefill_step_size=DEFAULT_PREFILL_CHUNK,
    )
    generator.insert([list(p) for p in prompts], max_tokens=[max_tokens] * len(prompts))
    tokens = finished = steps = 0
    while finished < len(prompts):
        steps += 1
        _, responses = generator.next()
        for response in responses:
            tokens += 1
            finished += response.finish_reason is not None
    generator.close()
    return tokens, steps


# -- one wave of each system ------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Wave:
    tokens: int
    seconds: float
    errors: int = 0
    extra: dict[str, Any] | None = None

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds


class Waves:
    """One model's systems, each run as a wave of ``concurrency`` streams."""

    def __init__(
        self,
        port: TokenIdPort,
        engine: Engine,
        plan: WavePlan,
        runtimes: dict[str, Any],
        urls: dict[str, str],
        ports: dict[str, TokenIdPort],
        engine_processes: Sequence[TokenIdPort] = (),
    ) -> None:
        """``runtimes``, ``urls``, ``ports``: the in-process runtime, the HTTP server's URL and
        the port of the runtime that each runtime system measures; ``engine_processes``: the
        ports over engine processes, settled before each wave as this process is."""
        self.port = port
        self.engine = engine
        self.plan = plan
        self.max_batch = plan.max_batch
        self.runtimes = runtimes
        self.urls = urls
        self.ports = ports
        self.engine_processes = engine_processes
        self.next_timer = next_timer()

    def texts(self, concurrency: int) -> list[str]:
        return [prompt_text(i) for i in range(concurrency)]

    async def run(self, system: str, concurrency: int) -> Wave:
        texts = self.texts(concurrency)
        thread = self.port.thread
        # The same starting state for every wave: GPU idle, MLX's buffer cache empty, no
        # garbage from the last wave waiting to be collected.
        await thread.run(settle)
        for process in self.engine_processes:  # each starts the wave settled too
            await process.run(settle)
        gc.collect()
        if system == "raw generate_step":
            ids = prompt_ids(texts[0], self.plan.prompt_tokens)
            return await self._timed(
                thread.run(raw_generate_step, self.engine, ids, self.plan.max_tokens)
            )
        if system == "raw BatchGenerator":
            prompts = [prompt_ids(t, self.plan.prompt_tokens) for t in texts]
            self.next_timer.take()
            start = time.perf_counter()
            tokens, steps = await thread.run(
                raw_batch_generator, self.engine, prompts, self.plan.max_tokens, self.max_batch
            )
            seconds = time.perf_counter() - start
            extra = {"steps": steps, "step_s": seconds / steps, **self.next_timer.take(seconds)}
            return Wave(tokens, seconds, extra=extra)
        if system in INPROCESS:
            port = self.ports[system]
            port.take_step_times()
            self.next_timer.take()
            rt = self.runtimes[system]
            wave = await self._inprocess(rt, texts, reproducible=system == "mlx-trio serial")
            if system == "mlx-trio serial":
                return wave
            # NextTimer sees only this process: nothing for an engine process.
            extra = {**port.take_step_times(), **self.next_timer.take(wave.seconds)}
            return Wave(wave.tokens, wave.seconds, wave.errors, extra)
        if system in HTTP:
            return await self._http(concurrency, self.urls[system])
        raise ValueError(system)

    async def _timed(self, call: Any) -> Wave:
        start = time.perf_counter()
        tokens = await call
        return Wave(tokens, time.perf_counter() - start)

    async def _inprocess(self, rt: Any, texts: list[str], *, reproducible: bool) -> Wave:
        params = SamplingParams(temperature=0.0, max_tokens=self.plan.max_tokens)
        counts: list[int] = []
        errors = 0

        async def one(text: str) -> None:
            nonlocal errors
            request = GenerationRequest(text, params, reproducible=reproducible)
            collected = await rt.collect(request)
            if isinstance(collected.outcome, Completed):
                counts.append(collected.outcome.usage.completion_tokens)
            else:
                errors += 1

        start = time.perf_counter()
        async with trio.open_nursery() as nursery:
            for text in texts:
                nursery.start_soon(one, text)
        return Wave(sum(counts), time.perf_counter() - start, errors)

    async def _http(self, concurrency: int, url: str) -> Wave:
        command = [
            sys.executable,
            "-m",
            f"{__package__}.http_load",
            "--url",
            url,
            "--clients",
            str(concurrency),
            "--max-tokens",
            str(self.plan.max_tokens),
            "--model",
            MODEL_ID,
            "--json",
        ]
        done = await trio.run_process(
            command, capture_stdout=True, capture_stderr=True, check=False
        )
        if done.returncode != 0:
            raise RuntimeError(f"http_load failed: {done.stderr.decode()[-2000:]}")
        summary = json.loads(done.stdout)
        keep = ("ttft_p50_s", "ttft_p99_s", "itl_p50_s", "itl_p99_s", "errors")
        return Wave(
            summary["completion_tokens"],
            summary["wall_s"],
            summary["num_errors"],
            {k: summary[k] for k in keep},
        )


def runtime_config(max_batch: int) -> RuntimeConfig:
    # A generous watchdog: a kernel compile the warm-up missed must not fail a step.
    return RuntimeConfig(
        max_batch=max_batch, max_live=max_batch, max_queued=max_batch, step_timeout_s=600.0
    )
