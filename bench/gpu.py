"""mlx-trio on a GPU: raw mlx-lm against mlx-trio's in-process API and HTTP server, one run.

A Llama-3.2-1B-shaped model with random weights, built in memory (nothing to download), in
bfloat16 and 4-bit (``mlx.nn.quantize``, group 64). For each, after the runtime's own warm-up
(``engine/warmup.py``, timed) and one untimed pass of every measurement, interleaved rounds of:

- ``raw generate_step``: mlx-lm's single-stream loop (1 stream only);
- ``raw BatchGenerator``: mlx-lm's continuous batching, all streams inserted at once;
- ``mlx-trio in-process``: concurrent sessions through ``open_runtime`` (batch lane);
- ``in-process, 1 step a call``: the same with ``steps_per_call=1``, the runtime as it was
  before it took several steps a call for large fast batches (the ablation);
- ``mlx-trio serial``: one ``reproducible`` session, mlx-lm's ``generate_step`` under the
  runtime (1 stream only);
- ``mlx-trio HTTP``: ``api.server.serve`` in this process, streaming clients in a separate
  process (``mlx_trio.api.bench.http_load``), so that it does not share this process's GIL;
- ``in-process, engine process`` and ``HTTP, engine process``: the same two with the engine in
  a child process of its own (``ProcessEngine``) instead of on a thread beside the event loop.

Every system gets the same prompts (``prompt_tokens`` fixed random ids per prompt text; the
runtime's ``prepare`` is replaced by that lookup, so no tokenizer work is timed), greedy
decoding, ``max_tokens`` new tokens, stop on the tokenizer's end-of-turn id, ``max_batch`` rows
and mlx-trio's prefill settings. Throughput is generated tokens over wall time per wave (first
request to last token). Every other wave runs the systems in reverse order; each runtime wave
is also paired with the raw wave of its round, and the median of those ratios gets a 95%
interval (the plot's lower panels), since the host's speed drifts from wave to wave. Also
measured: the time inside and around mlx-lm's ``BatchGenerator.next()`` on the engine thread
(``NextTimer``), and where single-stream decode time goes ("anatomy").

Usage: ``python -m bench.gpu`` (writes ``bench/results/gpu.json`` and ``gpu.png``);
``python -m bench.gpu --quick`` (a small model, for a CPU check of the whole path);
``python -m bench.gpu --plot-only bench/results/gpu.json`` (plot and table from a JSON).
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import math
import os
import platform
import random
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from contextlib import AsyncExitStack
from dataclasses import dataclass, replace
from functools import cache, partial
from pathlib import Path
from typing import Any

import trio

from mlx_trio.actors.config import RuntimeConfig
from mlx_trio.actors.engine_port.process import open_process_engine
from mlx_trio.actors.engine_port.thread import EngineThread, ThreadedEngine
from mlx_trio.actors.messages import Completed, GenerationRequest
from mlx_trio.api.inprocess import open_runtime
from mlx_trio.api.server import ServeOptions, serve
from mlx_trio.engine.batch import DEFAULT_PREFILL_CHUNK
from mlx_trio.engine.generate import Engine
from mlx_trio.engine.params import PreparedRequest, SamplingParams
from mlx_trio.engine.prompt import Prompt
from mlx_trio.engine.warmup import warm_up

logger = logging.getLogger("bench.gpu")

RESULTS = Path(__file__).parent / "results"
MODEL_ID = "llama-3.2-1b-shaped-random"
VOCAB = 128256
HBM_BYTES_PER_S = 4.8e12  # H200 datasheet
PREFILL_BATCH = 8  # BatchEngine's default, used by the raw BatchGenerator too
SYSTEMS = (
    "raw generate_step",
    "raw BatchGenerator",
    "mlx-trio in-process",
    "in-process, 1 step a call",
    "mlx-trio serial",
    "mlx-trio HTTP",
    "in-process, engine process",
    "HTTP, engine process",
)
SINGLE_ONLY = {"raw generate_step", "mlx-trio serial"}
ONE_STEP = "in-process, 1 step a call"
INPROCESS = ("mlx-trio in-process", ONE_STEP, "mlx-trio serial", "in-process, engine process")
HTTP = ("mlx-trio HTTP", "HTTP, engine process")
ENGINE_PROCESS = ("in-process, engine process", "HTTP, engine process")
# The runtime's systems whose waves are paired with raw's.
PAIRED = ("mlx-trio in-process", "mlx-trio HTTP", *ENGINE_PROCESS)
# Short names for --systems, in the order of SYSTEMS.
SYSTEM_KEYS = dict(
    zip(
        ("generate_step", "batch", "inprocess", "one-step", "serial", "http", "proc", "http-proc"),
        SYSTEMS,
        strict=True,
    )
)


# -- the model, the tokenizer, the prompts ----------------------------------------------------


def model_args(quick: bool) -> Any:
    from mlx_lm.models.llama import ModelArgs

    shape = dict(
        hidden_size=2048,
        num_hidden_layers=16,
        intermediate_size=8192,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=64,
    )
    if quick:
        shape = dict(
            hidden_size=128,
            num_hidden_layers=2,
            intermediate_size=256,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=32,
        )
    return ModelArgs(
        model_type="llama",
        vocab_size=VOCAB,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
        rope_theta=500000.0,
        rope_scaling={
            "factor": 32.0,
            "high_freq_factor": 4.0,
            "low_freq_factor": 1.0,
            "original_max_position_embeddings": 8192,
            "rope_type": "llama3",
        },
        max_position_embeddings=131072,
        **shape,
    )


def make_model(quick: bool, quantized: bool) -> Any:
    """Random weights in bfloat16; ``quantized``: then 4-bit, group 64 (mlx-lm's default)."""
    import mlx.core as mx
    import mlx.nn as nn
    from mlx_lm.models.llama import Model

    mx.random.seed(0)
    model = Model(model_args(quick))
    model.set_dtype(mx.bfloat16)
    if quantized:
        nn.quantize(model, group_size=64, bits=4)
    mx.eval(model.parameters())
    return model


def make_tokenizer() -> Any:
    """A byte-level BPE tokenizer with exactly VOCAB ids; ids past the bytes decode to words."""
    from mlx_lm.tokenizer_utils import BPEStreamingDetokenizer, TokenizerWrapper
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>"]
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {ch: i for i, ch in enumerate(alphabet)}
    letters = "abcdefghijklmnopqrstuvwxyz"
    while len(vocab) < VOCAB - len(specials):
        n, word = len(vocab), ""
        while True:
            n, r = divmod(n, 26)
            word += letters[r]
            if n == 0:
                break
        vocab["Ġ" + word] = len(vocab)
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens(specials)
    hf = PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token=specials[0], eos_token=specials[2]
    )
    assert len(hf) == VOCAB, len(hf)
    return TokenizerWrapper(hf, detokenizer_class=BPEStreamingDetokenizer)


def make_engine(model: Any, tokenizer: Any, *, dtype: str, quantized: bool) -> Engine:
    from mlx_trio.engine.loader import LoadedModel

    loaded = LoadedModel(
        model=model,
        tokenizer=tokenizer,
        model_id=MODEL_ID,
        path=Path("."),
        dtype=dtype,
        is_quantized=quantized,
        context_length=131072,
        device=device_name(),
    )
    return Engine(loaded)


def build_engine(quick: bool, quantized: bool) -> Engine:
    """The whole engine, built where it will run: in an engine process, this is its ``build``."""
    model = make_model(quick, quantized)
    return make_engine(model, make_tokenizer(), dtype="bfloat16", quantized=quantized)


def prompt_text(index: int) -> str:
    from mlx_trio.api.bench.scenarios import prompt

    return prompt(index)


def prompt_ids(text: str, length: int) -> tuple[int, ...]:
    """Fixed random ids for a prompt text: the same for every system and every run."""
    rng = random.Random(text)
    return tuple(rng.randrange(256, 128000) for _ in range(length))


class NextTimer:
    """Wall and CPU time inside mlx-lm's ``BatchGenerator.next()``, one decode step of a batch as
    raw batching and the runtime's batch lane both run it, on the engine thread. It tells a cost
    inside the steps (the same step run slower, say beside the event loop) from one around them
    (thread hops, gaps between calls, bookkeeping). Wraps the method for the whole process, once:
    use :func:`next_timer`."""

    def __init__(self) -> None:
        from mlx_lm.generate import BatchGenerator

        self.calls, self.wall_s, self.cpu_s = 0, 0.0, 0.0
        untimed = BatchGenerator.next

        def timed(generator: Any, *args: Any, **kwargs: Any) -> Any:
            wall, cpu = time.perf_counter(), time.thread_time()
            try:
                return untimed(generator, *args, **kwargs)
            finally:
                self.wall_s += time.perf_counter() - wall
                self.cpu_s += time.thread_time() - cpu
                self.calls += 1

        BatchGenerator.next = timed

    def take(self, wave_s: float | None = None) -> dict[str, float]:
        """Since the last take (call it between waves, while no step runs): ``next()`` calls, the
        wall and CPU seconds of one, and the wave's seconds outside ``next()`` per call."""
        calls, wall, cpu = self.calls, self.wall_s, self.cpu_s
        self.calls, self.wall_s, self.cpu_s = 0, 0.0, 0.0
        if not calls or wave_s is None:
            return {}
        return {
            "next_calls": calls,
            "next_s": wall / calls,
            "next_cpu_s": cpu / calls,
            "outside_next_s": (wave_s - wall) / calls,
        }


@cache
def next_timer() -> NextTimer:
    return NextTimer()


class TokenIdPort:
    """The runtime's engine port, with ``prepare`` replaced by :func:`prompt_ids`.

    Everything else is the real ``ThreadedEngine``: the runtime cannot tell the difference. It
    also times each ``batch_step`` call (engine thread hop and steps) and the gaps between
    calls (the event loop's share), for :meth:`take_step_times`.
    """

    def __init__(self, inner: ThreadedEngine, prompt_tokens: int) -> None:
        self._inner = inner
        self._prompt_tokens = prompt_tokens
        self._calls: list[tuple[int, float]] = []  # (steps run, seconds) of each batch_step
        self._gaps: list[float] = []
        self._last_end: float | None = None

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    @property
    def model_id(self) -> str:
        return self._inner.model_id

    @property
    def kv_bytes(self) -> int:
        return self._inner.kv_bytes

    async def prepare(self, prompt: Prompt, params: SamplingParams) -> PreparedRequest:
        text = prompt if isinstance(prompt, str) else prompt[-1].content
        return PreparedRequest(prompt_ids(text, self._prompt_tokens), params)

    async def batch_step(self, steps: int = 1) -> Any:
        start = time.perf_counter()
        if self._last_end is not None:
            self._gaps.append(start - self._last_end)
        before = self._inner.batch_steps_run
        events = await self._inner.batch_step(steps)
        self._last_end = time.perf_counter()
        self._calls.append((self._inner.batch_steps_run - before, self._last_end - start))
        return events

    def take_step_times(self) -> dict[str, float]:
        """Calls since the last take: engine calls, steps, mean time a step (engine thread hop
        included) and mean gap between calls (the event loop's share), in seconds."""
        calls, gaps = self._calls, self._gaps
        self._calls, self._gaps, self._last_end = [], [], None
        steps = sum(n for n, _ in calls)
        return {
            "calls": len(calls),
            "steps": steps,
            "step_s": sum(t for _, t in calls) / steps if steps else 0.0,
            "between_calls_s": statistics.mean(gaps) if gaps else 0.0,
        }


def device_name() -> str:
    import mlx.core as mx

    return "cpu" if mx.default_device().type == mx.DeviceType.cpu else "gpu"


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


class Bench:
    """One model's systems, each run as a wave of ``concurrency`` streams."""

    def __init__(
        self,
        port: TokenIdPort,
        engine: Engine,
        args: argparse.Namespace,
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
        self.args = args
        self.max_batch = max_batch_of(args)
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
            ids = prompt_ids(texts[0], self.args.prompt_tokens)
            return await self._timed(
                thread.run(raw_generate_step, self.engine, ids, self.args.max_tokens)
            )
        if system == "raw BatchGenerator":
            prompts = [prompt_ids(t, self.args.prompt_tokens) for t in texts]
            self.next_timer.take()
            start = time.perf_counter()
            tokens, steps = await thread.run(
                raw_batch_generator, self.engine, prompts, self.args.max_tokens, self.max_batch
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
        params = SamplingParams(temperature=0.0, max_tokens=self.args.max_tokens)
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
            "mlx_trio.api.bench.http_load",
            "--url",
            url,
            "--clients",
            str(concurrency),
            "--max-tokens",
            str(self.args.max_tokens),
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


def settle() -> None:
    import mlx.core as mx

    mx.synchronize()
    mx.clear_cache()


def max_batch_of(args: argparse.Namespace) -> int:
    """Rows in a batch: the most streams measured, and at least 2, since a runtime with
    ``max_batch`` 1 runs every request on the serial lane (``--concurrency 1`` would measure
    that instead of the batch lane's solo row)."""
    return max(2, *args.concurrency)


def runtime_config(max_batch: int) -> RuntimeConfig:
    # A generous watchdog: a kernel compile the warm-up missed must not fail a step.
    return RuntimeConfig(
        max_batch=max_batch, max_live=max_batch, max_queued=max_batch, step_timeout_s=600.0
    )


# -- single-stream anatomy (engine thread) ----------------------------------------------------


def weight_bytes(model: Any) -> int:
    """Bytes one decode step reads from weights: every parameter once (with tied embeddings
    the embedding table is the LM head, read in full; the embedding lookup reads one row)."""
    from mlx.utils import tree_flatten

    return sum(v.nbytes for _, v in tree_flatten(model.parameters()))


def anatomy(engine: Engine, prompt: tuple[int, ...], steps: int) -> dict[str, float]:
    """Where a single-stream decode step's time goes, on the calling (engine) thread.

    ``build_s``: Python building the step's lazy graph; ``dispatch_s``: ``mx.async_eval``
    encoding and launching it; ``wait_s``: then waiting for the GPU; ``step_s``: a plain
    unpipelined step (build + eval + sync). ``weights_pass_s``: every weight matrix
    multiplied by one vector with MLX's own kernels, one eval (the kernels' streaming floor).
    ``copy_bytes_per_s``: a 1 GiB bf16 ``x + 1`` (bytes read plus written over time).
    """
    import mlx.core as mx
    import mlx.nn as nn
    from mlx_lm.generate import generation_stream
    from mlx_lm.models.cache import make_prompt_cache

    model = engine.model
    out: dict[str, list[float]] = {"build_s": [], "dispatch_s": [], "wait_s": [], "step_s": []}
    with mx.stream(generation_stream):
        cache = make_prompt_cache(model)
        logits = model(mx.array(prompt)[None], cache=cache)
        mx.eval(logits, [c.state for c in cache])
        token = mx.argmax(logits[:, -1, :], axis=-1)
        for i in range(steps):
            t0 = time.perf_counter()
            logits = model(token[:, None], cache=cache)
            token = mx.argmax(logits[:, -1, :], axis=-1)
            t1 = time.perf_counter()
            if i % 2:
                mx.async_eval(token)
                t2 = time.perf_counter()
                token.item()
                t3 = time.perf_counter()
                out["build_s"].append(t1 - t0)
                out["dispatch_s"].append(t2 - t1)
                out["wait_s"].append(t3 - t2)
            else:
                token.item()
                out["step_s"].append(time.perf_counter() - t0)
        layers = [
            m for _, m in model.named_modules() if isinstance(m, nn.Linear | nn.QuantizedLinear)
        ]
        passes = []
        for _ in range(10):
            outputs = [
                layer(mx.ones((1, layer_input(layer)), dtype=mx.bfloat16)) for layer in layers
            ]
            outputs.append(
                model.model.embed_tokens.as_linear(
                    mx.ones((1, model.args.hidden_size), dtype=mx.bfloat16)
                )
            )
            t0 = time.perf_counter()
            mx.eval(outputs)
            passes.append(time.perf_counter() - t0)
        x = mx.zeros((1 << 29,), dtype=mx.bfloat16)
        mx.eval(x)
        copies = []
        for _ in range(5):
            t0 = time.perf_counter()
            mx.eval(x + 1)
            copies.append(time.perf_counter() - t0)
    result = {k: statistics.median(v) for k, v in out.items()}
    result["weights_pass_s"] = statistics.median(passes[2:])
    result["copy_bytes_per_s"] = 2 * x.nbytes / statistics.median(copies[1:])
    return result


def layer_input(layer: Any) -> int:
    import mlx.nn as nn

    if isinstance(layer, nn.QuantizedLinear):
        return layer.weight.shape[1] * 32 // layer.bits
    return layer.weight.shape[1]


# -- the run ----------------------------------------------------------------------------------


def machine() -> dict[str, Any]:
    import mlx.core as mx
    import mlx_lm

    info: dict[str, Any] = {
        "device": device_name(),
        "mlx": mx.__version__,
        "mlx_lm": mlx_lm.__version__,
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
    }
    try:
        query = [
            "nvidia-smi",
            "--query-gpu=name,driver_version,memory.total",
            "--format=csv,noheader",
        ]
        info["gpu"] = subprocess.run(
            query, capture_output=True, text=True, timeout=20
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        info["gpu"] = None
    return info


def systems_for(concurrency: int, selected: list[str]) -> list[str]:
    return [s for s in selected if concurrency == 1 or s not in SINGLE_ONLY]


async def record(bench: Bench, entry: dict, system: str, concurrency: int, timed: bool) -> None:
    """Run one wave and store it in ``entry``; a failure is stored, not raised."""
    cell = (
        entry["results"]
        .setdefault(system, {})
        .setdefault(
            str(concurrency),
            {"tok_s": [], "tokens": [], "seconds": [], "errors": [], "extra": [], "failures": []},
        )
    )
    try:
        wave = await bench.run(system, concurrency)
    except Exception as exc:
        logger.exception("%s x%d failed", system, concurrency)
        cell["failures"].append(f"{type(exc).__name__}: {exc}"[:500])
        return
    if timed:
        cell["tok_s"].append(wave.tokens_per_s)
        cell["tokens"].append(wave.tokens)
        cell["seconds"].append(wave.seconds)
        cell["errors"].append(wave.errors)
        if wave.extra:
            cell["extra"].append(wave.extra)
    else:
        cell["first_pass_s"] = wave.seconds
    logger.info(
        "%-20s x%-3d %-10s %6d tokens in %6.2f s = %8.1f tok/s%s",
        system,
        concurrency,
        "timed" if timed else "first pass",
        wave.tokens,
        wave.seconds,
        wave.tokens_per_s,
        f" ({wave.errors} errors)" if wave.errors else "",
    )


async def bench_model(
    name: str,
    tokenizer: Any,
    args: argparse.Namespace,
    entry: dict,
    save: Callable[[], None],
    deadline: float,
) -> None:
    """Build model ``name`` (bf16 or q4), warm it up, measure every system, then its anatomy."""
    quantized = name == "q4"
    max_batch = max_batch_of(args)
    entry.update(quantized=quantized, results={})
    with EngineThread() as thread:
        start = time.perf_counter()
        model = await thread.run(make_model, args.quick, quantized)
        engine = make_engine(model, tokenizer, dtype="bfloat16", quantized=quantized)
        entry["build_s"] = time.perf_counter() - start
        entry["weight_bytes"] = weight_bytes(model)
        entry["bandwidth_limit_steps_s"] = HBM_BYTES_PER_S / entry["weight_bytes"]
        # One port per runtime (in-process, HTTP): each owns its BatchEngine.
        ports = [
            TokenIdPort(ThreadedEngine(engine, thread, max_batch=max_batch), args.prompt_tokens)
            for _ in range(2)
        ]
        for port in ports:
            await port.batch_reset()
        chunk = ports[0].prefill_chunk
        report = await thread.run(lambda: warm_up(engine, max_batch=max_batch, prefill_chunk=chunk))
        logger.info("%s: %s", name, report.describe())
        entry["warmup"] = warmup_record(report)
        save()
        config = runtime_config(max_batch)
        options = ServeOptions(port=0, handle_signals=False, runtime=config)
        shutdown = trio.Event()
        # Both in-process runtimes drive ports[0]; the waves run one at a time.
        one_step = replace(config, steps_per_call=1)
        async with AsyncExitStack() as stack:
            rt = await stack.enter_async_context(open_runtime(engine=ports[0], config=config))
            runtimes = {
                "mlx-trio in-process": rt,
                ONE_STEP: await stack.enter_async_context(
                    open_runtime(engine=ports[0], config=one_step)
                ),
                "mlx-trio serial": rt,
            }
            by_system = {s: ports[0] for s in runtimes}
            serving = {"mlx-trio HTTP": ports[1]}
            if any(s in args.systems for s in ENGINE_PROCESS):
                # One engine process for each runtime, as for the threads: its own BatchEngine.
                build = partial(build_engine, args.quick, quantized)
                procs = []
                for _ in range(2):
                    opened = open_process_engine(build, None, max_batch=max_batch)
                    inner = await stack.enter_async_context(opened)
                    procs.append(TokenIdPort(inner, args.prompt_tokens))  # type: ignore[arg-type]
                logger.info("%s: engine processes %s started", name, [p.pid for p in procs])
                proc_rt = open_runtime(engine=procs[0], config=config)
                runtimes["in-process, engine process"] = await stack.enter_async_context(proc_rt)
                by_system["in-process, engine process"] = procs[0]
                serving["HTTP, engine process"] = procs[1]
            nursery = await stack.enter_async_context(trio.open_nursery())
            urls = {}
            for system, port in serving.items():
                serving_it = partial(serve, options, engine=port, shutdown=shutdown)
                urls[system] = await nursery.start(serving_it)
                await wait_healthy(urls[system])
            processes = [p for s, p in {**by_system, **serving}.items() if s in ENGINE_PROCESS]
            bench = Bench(ports[0], engine, args, runtimes, urls, by_system, processes)
            # An untimed pass first: the raw systems meet every shape (the runtime runs the
            # same shapes), all systems at low concurrency (their own code paths).
            for concurrency in args.concurrency:
                for system in systems_for(concurrency, args.systems):
                    if concurrency <= 8 or system.startswith("raw"):
                        await record(bench, entry, system, concurrency, timed=False)
                        save()
            durations: list[float] = []
            for r in range(args.rounds):
                started = time.perf_counter()
                if durations and started + statistics.mean(durations) > deadline:
                    logger.info("%s: stopping after %d rounds (time budget)", name, r)
                    break
                for concurrency in args.concurrency:
                    # Single streams are short and noisy: measure them a few times a round.
                    repeats = args.single_repeats if concurrency == 1 else 1
                    for i in range(repeats):
                        systems = systems_for(concurrency, args.systems)
                        # Every other wave in reverse order, so that no system always runs
                        # just after another (the paired ratio's raw wave is before or after).
                        if (r * repeats + i) % 2:
                            systems = systems[::-1]
                        for system in systems:
                            await record(bench, entry, system, concurrency, timed=True)
                            save()
                durations.append(time.perf_counter() - started)
            entry["rounds"] = len(durations)
            shutdown.set()
        prompt = prompt_ids(prompt_text(0), args.prompt_tokens)
        entry["anatomy"] = await thread.run(anatomy, engine, prompt, 64)
        save()


async def wait_healthy(url: str) -> None:
    import httpx

    async with httpx.AsyncClient(base_url=url, trust_env=False) as client:
        with trio.fail_after(60):
            while (await client.get("/health")).status_code != 200:
                await trio.sleep(0.05)


def warmup_record(report: Any) -> dict[str, Any]:
    shapes = [
        dict(lane=s.lane, rows=s.rows, prompt=s.prompt_tokens, new=s.new_tokens, s=s.seconds)
        for s in report.shapes
    ]
    return {"seconds": report.seconds, "device": report.device, "shapes": shapes}


async def warmup_only(args: argparse.Namespace) -> dict[str, Any]:
    """Build each model and time ``warm_up`` alone (e.g. a restart with a warm PTX cache)."""
    tokenizer = make_tokenizer()
    result: dict[str, Any] = {"machine": machine(), "warmup_only": {}}
    max_batch = max_batch_of(args)
    for name in args.models:
        with EngineThread() as thread:
            model = await thread.run(make_model, args.quick, name == "q4")
            engine = make_engine(model, tokenizer, dtype="bfloat16", quantized=name == "q4")
            run = partial(warm_up, max_batch=max_batch, prefill_chunk=DEFAULT_PREFILL_CHUNK)
            report = await thread.run(run, engine)
        logger.info("%s: %s", name, report.describe())
        result["warmup_only"][name] = warmup_record(report)
    Path(args.out).write_text(json.dumps(result, indent=1))
    return result


async def main_async(args: argparse.Namespace) -> dict:
    doc: dict[str, Any] = {
        "machine": machine(),
        "config": {
            "prompt_tokens": args.prompt_tokens,
            "max_tokens": args.max_tokens,
            "concurrency": args.concurrency,
            "rounds": args.rounds,
            "max_batch": max_batch_of(args),
            "prefill_batch": PREFILL_BATCH,
            "prefill_chunk": DEFAULT_PREFILL_CHUNK,
            "quick": args.quick,
        },
        "models": {},
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)

    def save() -> None:
        doc["summary"] = summarize(doc)
        out.write_text(json.dumps(doc, indent=1))

    tokenizer = make_tokenizer()
    start = time.perf_counter()
    names = args.models
    for i, name in enumerate(names):
        share = (args.budget_s - (time.perf_counter() - start)) / (len(names) - i)
        doc["models"][name] = {}
        deadline = time.perf_counter() + share
        await bench_model(name, tokenizer, args, doc["models"][name], save, deadline)
    doc["total_s"] = time.perf_counter() - start
    save()
    return doc


# -- summary, table, plot ---------------------------------------------------------------------


def median_rate(entry: dict, system: str, concurrency: int) -> float | None:
    cell = entry.get("results", {}).get(system, {}).get(str(concurrency))
    return statistics.median(cell["tok_s"]) if cell and cell["tok_s"] else None


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def paired_ratios(entry: dict, system: str, base: str, concurrency: int) -> list[float]:
    """Each wave of ``system`` over the ``base`` wave of the same round (and repeat)."""
    cells = entry.get("results", {})
    a = cells.get(system, {}).get(str(concurrency))
    b = cells.get(base, {}).get(str(concurrency))
    if not a or not b or len(a["tok_s"]) != len(b["tok_s"]):
        return []
    return [x / y for x, y in zip(a["tok_s"], b["tok_s"], strict=True)]


def paired_ratio(entry: dict, system: str, base: str, concurrency: int) -> float | None:
    """The median of :func:`paired_ratios`: steadier than a ratio of medians when the host
    drifts."""
    ratios = paired_ratios(entry, system, base, concurrency)
    return statistics.median(ratios) if ratios else None


def paired_spread(
    entry: dict, system: str, base: str, concurrency: int
) -> dict[str, float | int] | None:
    """How far to trust :func:`paired_ratio`: the waves, their quartiles, and a 95% interval
    for the median (distribution-free: the order statistics ``k`` in from either end, for the
    largest ``k`` with P(Binomial(n, 1/2) < k) <= 2.5%; none below 6 waves)."""
    ratios = sorted(paired_ratios(entry, system, base, concurrency))
    n = len(ratios)
    k, tail = 0, math.comb(n, 0) / 2**n
    while tail <= 0.025:
        k += 1
        tail += math.comb(n, k) / 2**n
    if k == 0:
        return None
    q1, _, q3 = statistics.quantiles(ratios, n=4)
    return {
        "waves": n,
        "q1": q1,
        "q3": q3,
        "median_low": ratios[k - 1],
        "median_high": ratios[n - k],
    }


def next_times(entry: dict, system: str, concurrency: int) -> dict[str, float] | None:
    """Medians over waves of the :class:`NextTimer` figures, in ms a step."""
    cell = entry.get("results", {}).get(system, {}).get(str(concurrency)) or {}
    extras = [x for x in cell.get("extra", []) if "next_s" in x]
    if not extras:
        return None
    keys = ("next_s", "next_cpu_s", "outside_next_s")
    return {key[:-2] + "_ms": 1e3 * statistics.median(x[key] for x in extras) for key in keys}


def summarize(doc: dict) -> dict:
    """Per model: median tok/s per system and streams, ratios to raw, the bandwidth gap."""
    summary = {}
    for name, entry in doc["models"].items():
        rows = []
        for concurrency in doc["config"]["concurrency"]:
            row: dict[str, Any] = {"streams": concurrency}
            for system in SYSTEMS:
                row[system] = median_rate(entry, system, concurrency)
            raw = row["raw BatchGenerator"]
            row["in-process / raw BatchGenerator"] = ratio(row["mlx-trio in-process"], raw)
            row["HTTP / raw BatchGenerator"] = ratio(row["mlx-trio HTTP"], raw)
            row["1 step a call / raw BatchGenerator"] = ratio(row[ONE_STEP], raw)
            if concurrency == 1:
                single = row["raw generate_step"]
                row["in-process / raw generate_step"] = ratio(row["mlx-trio in-process"], single)
                row["serial / raw generate_step"] = ratio(row["mlx-trio serial"], single)
            base = "raw generate_step" if concurrency == 1 else "raw BatchGenerator"
            row["paired"] = {s: paired_ratio(entry, s, base, concurrency) for s in PAIRED}
            row["paired_spread"] = {s: paired_spread(entry, s, base, concurrency) for s in PAIRED}
            stepped = ("raw BatchGenerator", "mlx-trio in-process")
            row["next"] = {s: t for s in stepped if (t := next_times(entry, s, concurrency))}
            rows.append(row)
        limit = entry.get("bandwidth_limit_steps_s")
        singles = [median_rate(entry, s, 1) for s in SYSTEMS if s not in HTTP]
        best = max((v for v in singles if v is not None), default=None)
        summary[name] = {
            "rows": rows,
            "bandwidth_limit_steps_s": limit,
            "best_single_stream_tok_s": best,
            "fraction_of_limit": ratio(best, limit),
            "half_gap_target_tok_s": (best + limit) / 2 if best and limit else None,
        }
    return summary


def _cell(value: float | None, base: float | None) -> str:
    if value is None:
        return "-"
    text = f"{value:,.0f}"
    r = ratio(value, base)
    return text if r is None else f"{text} ({r:.2f}x)"


def _paired_cell(system: str, median: float, spread: dict | None) -> str:
    if spread is None:
        return f"{system} {median:.2f}x"
    low, high, waves = spread["median_low"], spread["median_high"], spread["waves"]
    return f"{system} {median:.2f}x [{low:.2f}-{high:.2f}], {waves}"


def table(doc: dict) -> str:
    """Markdown: per model, streams x systems, ratios to raw BatchGenerator (raw generate_step
    for the single-stream-only systems)."""
    lines = []
    for name, model in summarize(doc).items():
        lines.append(f"\n{name} (tok/s, median of rounds; ratio to raw)\n")
        lines.append("| streams | " + " | ".join(SYSTEMS) + " |")
        lines.append("| --- |" + " --- |" * len(SYSTEMS))
        for row in model["rows"]:
            cells = []
            for system in SYSTEMS:
                if system.startswith("raw"):
                    base = None
                elif system in SINGLE_ONLY:
                    base = row["raw generate_step"]
                else:
                    base = row["raw BatchGenerator"]
                cells.append(_cell(row[system], base))
            lines.append(f"| {row['streams']} | " + " | ".join(cells) + " |")
        paired = [
            f"{row['streams']}: "
            + ", ".join(
                _paired_cell(system, r, row["paired_spread"].get(system))
                for system, r in row["paired"].items()
                if r
            )
            for row in model["rows"]
            if any(row["paired"].values())
        ]
        if paired:
            lines.append(
                "\npaired (median over waves of the ratio to the raw wave of the same round; raw "
                "generate_step at 1 stream; [95% interval of the median], waves):\n"
                + "\n".join(paired)
            )
        inside = [
            f"{row['streams']}: "
            + "; ".join(
                f"{system} {t['next_ms']:.2f} / {t['next_cpu_ms']:.2f}, {t['outside_next_ms']:.2f}"
                for system, t in row.get("next", {}).items()
            )
            for row in model["rows"]
            if row.get("next")
        ]
        if inside:
            lines.append(
                "\ninside mlx-lm's BatchGenerator.next(), ms a step, medians of waves (wall / "
                "engine thread's CPU, then the wave's time outside next() a step):\n"
                + "\n".join(inside)
            )
        on_gpu = doc["machine"]["device"] == "gpu"
        if on_gpu and model["bandwidth_limit_steps_s"] and model["best_single_stream_tok_s"]:
            lines.append(
                f"\nsingle stream: best {model['best_single_stream_tok_s']:,.0f} tok/s of a "
                f"{model['bandwidth_limit_steps_s']:,.0f} steps/s bandwidth limit "
                f"({model['fraction_of_limit']:.0%}); half the gap is "
                f"{model['half_gap_target_tok_s']:,.0f} tok/s"
            )
    return "\n".join(lines)


def plot(doc: dict, png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    summary = summarize(doc)
    fig, axes = plt.subplots(
        2,
        len(summary),
        figsize=(max(6.5 * len(summary), 9.0), 8.4),
        squeeze=False,
        gridspec_kw={"height_ratios": [3, 2]},
    )
    for ax, model in zip(axes[1], summary.values(), strict=True):
        plot_paired(ax, model["rows"])
    for ax, (name, model) in zip(axes[0], summary.items(), strict=True):
        for system, marker in zip(SYSTEMS, "osDx^v<>", strict=True):
            points = [(r["streams"], r[system]) for r in model["rows"] if r[system] is not None]
            if points:
                xs, ys = zip(*points, strict=True)
                style = "none" if system in SINGLE_ONLY else "-"
                ax.plot(xs, ys, marker=marker, linestyle=style, label=system, color=color(system))
        single = any(r["streams"] == 1 for r in model["rows"])
        if single and model["bandwidth_limit_steps_s"] and doc["machine"]["device"] == "gpu":
            ax.plot(
                [1],
                [model["bandwidth_limit_steps_s"]],
                "k*",
                markersize=11,
                label="1-stream bandwidth limit",
            )
        streams_axis(ax, model["rows"])
        ax.set_yscale("log")
        ax.set_ylabel("generated tok/s")
        ax.set_title(f"Llama-3.2-1B shape, random weights, {name}")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    gpu = doc["machine"].get("gpu") or doc["machine"]["device"]
    fig.suptitle(
        f"mlx-trio vs raw mlx-lm on {gpu} (prompt {doc['config']['prompt_tokens']}, "
        f"{doc['config']['max_tokens']} new tokens)",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(png, dpi=120)
    plt.close(fig)


def color(system: str) -> str:
    """One color a system, in both panels."""
    return f"C{SYSTEMS.index(system)}"


def streams_axis(ax: Any, rows: list[dict]) -> None:
    """A log2 x axis ticked at the measured stream counts."""
    import matplotlib.ticker

    ax.set_xscale("log", base=2)
    ax.set_xticks([r["streams"] for r in rows])
    ax.xaxis.set_major_formatter(matplotlib.ticker.ScalarFormatter())
    ax.xaxis.set_minor_locator(matplotlib.ticker.NullLocator())
    ax.set_xlabel("concurrent streams")


def plot_paired(ax: Any, rows: list[dict]) -> None:
    """The runtime's paired ratios to raw by streams, with the 95% interval of each median
    where there are waves enough, against the goal."""
    offsets = (0.94, 1.02, 0.98, 1.06)  # side by side, not on top of each other
    for offset, system in zip(offsets, PAIRED, strict=True):
        points = [
            (r["streams"], r["paired"].get(system), r["paired_spread"].get(system)) for r in rows
        ]
        points = [p for p in points if p[1] is not None]
        if not points:
            continue
        xs = [x * offset for x, _, _ in points]
        ys = [y for _, y, _ in points]
        low = [y - (sp["median_low"] if sp else y) for _, y, sp in points]
        high = [(sp["median_high"] if sp else y) - y for _, y, sp in points]
        ax.errorbar(
            xs,
            ys,
            yerr=[low, high],
            marker="o",
            linestyle="none",
            capsize=3,
            label=system,
            color=color(system),
        )
    ax.axhline(0.95, color="k", linestyle="--", linewidth=0.8, label="goal (0.95x)")
    ax.axhline(1.0, color="grey", linewidth=0.5)
    streams_axis(ax, rows)
    ax.set_ylabel("paired ratio to raw (generate_step at 1)")
    ax.set_title("each wave over raw's of its round: median, 95% interval", fontsize=10)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a small model (CPU check)")
    parser.add_argument("--models", default="bf16,q4")
    parser.add_argument("--concurrency", default=None, help="default 1,8,32,128,256")
    parser.add_argument("--max-tokens", type=int, default=None, help="default 128")
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--systems", default=",".join(SYSTEM_KEYS), help=f"of {', '.join(SYSTEM_KEYS)}"
    )
    parser.add_argument("--single-repeats", type=int, default=3, help="1-stream waves a round")
    parser.add_argument("--budget-s", type=float, default=420.0, help="stop adding rounds after")
    parser.add_argument("--out", default=str(RESULTS / "gpu.json"))
    parser.add_argument("--png", default=None, help="default: the JSON's path with .png")
    parser.add_argument("--plot-only", metavar="JSON", default=None)
    parser.add_argument("--warmup-only", action="store_true", help="time warm_up alone")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    quiet = ("httpx", "hypercorn.error", "mlx_trio.server", "mlx_trio.http", "mlx_trio.actors")
    for noisy in quiet:
        logging.getLogger(noisy).setLevel(logging.WARNING)
    if args.plot_only:
        doc = json.loads(Path(args.plot_only).read_text())
        png = Path(args.png or Path(args.plot_only).with_suffix(".png"))
    else:
        default_concurrency = "1,4,8" if args.quick else "1,8,32,128,256"
        args.concurrency = [int(c) for c in (args.concurrency or default_concurrency).split(",")]
        args.max_tokens = args.max_tokens or (16 if args.quick else 128)
        args.models = args.models.split(",")
        args.systems = [SYSTEM_KEYS[key] for key in args.systems.split(",")]
        if args.warmup_only:
            print(json.dumps(trio.run(warmup_only, args)["warmup_only"], indent=1))
            return
        doc = trio.run(main_async, args)
        png = Path(args.png or Path(args.out).with_suffix(".png"))
    print(table(doc))
    try:
        plot(doc, png)
        print(f"\nplot: {png}")
    except ImportError:
        print("\nmatplotlib is not installed: no plot (use --plot-only JSON where it is)")


if __name__ == "__main__":
    main()
