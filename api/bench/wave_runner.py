"""The GPU run: for each model, its warm-up, an untimed pass, then paired rounds of waves.

For each model (``bf16``, ``q4``: ``models``), after the runtime's own warm-up
(``engine/warmup.py``, timed) and one untimed pass of every measurement, interleaved rounds:
at each concurrency level every selected system runs one wave (``waves``), single streams
``single_repeats`` times a round since they are short and noisy. Every other wave runs the
systems in reverse order, so that no system always follows another, and each runtime wave is
paired with the raw wave of its round: the host's speed drifts from wave to wave, more than
the margins the goals ask for (``wave_report`` turns the pairs into ratios with intervals).
Rounds stop when the next would overrun the model's share of the time budget. Then the
single-stream ``anatomy`` of a step. The JSON is written after every wave, so a run cut short
keeps what it measured.
"""

from __future__ import annotations

import json
import logging
import statistics
import subprocess
import time
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import Any

import trio

from ...actors.engine_port.process import open_process_engine
from ...actors.engine_port.thread import EngineThread, ThreadedEngine
from ...engine.batch.batch import DEFAULT_PREFILL_CHUNK
from ...engine.generate import Engine
from ...engine.options import CoreRecipe
from ...engine.warmup import warm_up
from ..inprocess import open_runtime
from ..server import ServeOptions, serve
from . import results
from .models import build_engine, device_name, make_engine, make_model, make_tokenizer
from .probes import TokenIdPort, anatomy, prompt_ids, weight_bytes
from .scenarios import prompt as prompt_text
from .wave_plan import ENGINE_PROCESS, ONE_STEP, SINGLE_ONLY, WavePlan
from .wave_report import summarize
from .waves import PREFILL_BATCH, Waves, runtime_config

logger = logging.getLogger(__name__)

HBM_BYTES_PER_S = 4.8e12  # H200 datasheet


def machine() -> dict[str, Any]:
    """The suite's description of the machine, with MLX's device and the GPU's name."""
    info: dict[str, Any] = {**results.machine(), "device": device_name()}
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


def systems_for(concurrency: int, selected: Sequence[str]) -> list[str]:
    return [s for s in selected if concurrency == 1 or s not in SINGLE_ONLY]


async def record(waves: Waves, entry: dict, system: str, concurrency: int, timed: bool) -> None:
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
        wave = await waves.run(system, concurrency)
    except Exception as exc:
        failure = f"{type(exc).__name__}: {exc}"[:500]
        # One line a wave, its traceback only at DEBUG: a broken system fails every wave.
        logger.error("%s x%d failed: %s", system, concurrency, failure)
        logger.debug("%s x%d failed", system, concurrency, exc_info=True)
        cell["failures"].append(failure)
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
        cell["first_pass_errors"] = wave.errors
        cell["first_pass_error_kinds"] = (wave.extra or {}).get("errors") or {}
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
    plan: WavePlan,
    entry: dict,
    save: Callable[[], None],
    deadline: float,
) -> None:
    """Build model ``name`` (bf16 or q4), warm it up, measure every system, then its anatomy."""
    quantized = name == "q4"
    max_batch = plan.max_batch
    entry.update(quantized=quantized, results={})
    with EngineThread() as thread:
        start = time.perf_counter()
        model = await thread.run(make_model, plan.quick, quantized)
        engine = make_engine(model, tokenizer, dtype="bfloat16", quantized=quantized)
        entry["build_s"] = time.perf_counter() - start
        entry["weight_bytes"] = weight_bytes(model)
        entry["bandwidth_limit_steps_s"] = HBM_BYTES_PER_S / entry["weight_bytes"]
        # One port per runtime (in-process, HTTP): each owns its BatchEngine.
        ports = [
            TokenIdPort(
                ThreadedEngine.over(engine, thread, max_batch=max_batch), plan.prompt_tokens
            )
            for _ in range(2)
        ]
        for port in ports:
            await port.batch_reset()
        chunk = DEFAULT_PREFILL_CHUNK  # the ports' cores'
        report = await thread.run(lambda: warm_up(engine, max_batch=max_batch, prefill_chunk=chunk))
        logger.info("%s: %s", name, report.describe())
        entry["warmup"] = warmup_record(report)
        save()
        async with open_waves(name, plan, engine, ports) as waves:
            await measure(name, waves, plan, entry, save, deadline)
        prompt = prompt_ids(prompt_text(0), plan.prompt_tokens)
        # --quick checks the path on a CPU: a few steps and a small copy are enough.
        steps, copy_bytes = (4, 1 << 24) if plan.quick else (64, 1 << 30)
        entry["anatomy"] = await thread.run(anatomy, engine, prompt, steps, copy_bytes)
        save()


@asynccontextmanager
async def open_waves(
    name: str, plan: WavePlan, engine: Engine, ports: Sequence[TokenIdPort]
) -> AsyncIterator[Waves]:
    """Every system of ``plan`` ready to run waves: the in-process runtimes and the serial lane
    over ``ports[0]``, the HTTP server over ``ports[1]``, and where asked for, the same two over
    engine processes of their own. All of it is stopped on the way out."""
    max_batch = plan.max_batch
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
        if any(s in plan.systems for s in ENGINE_PROCESS):
            # One engine process for each runtime, as for the threads: its own BatchEngine.
            build = partial(build_engine, plan.quick, engine.loaded.is_quantized)
            procs = []
            for _ in range(2):
                # The tokenizer stays here: TokenIdPort makes the prompts' ids, but the HTTP
                # side asks the port for its reply syntax and token texts.
                opened = open_process_engine(CoreRecipe(build, max_batch), engine.preparer)
                inner = await stack.enter_async_context(opened)
                procs.append(TokenIdPort(inner, plan.prompt_tokens))  # type: ignore[arg-type]
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
        yield Waves(ports[0], engine, plan, runtimes, urls, by_system, processes)
        shutdown.set()


async def measure(
    name: str,
    waves: Waves,
    plan: WavePlan,
    entry: dict,
    save: Callable[[], None],
    deadline: float,
) -> None:
    """The untimed pass, then timed rounds until ``plan.rounds`` or ``deadline``."""
    # An untimed pass first: the raw systems meet every shape (the runtime runs the
    # same shapes), all systems at low concurrency (their own code paths).
    for concurrency in plan.concurrency:
        for system in systems_for(concurrency, plan.systems):
            if concurrency <= 8 or system.startswith("raw"):
                await record(waves, entry, system, concurrency, timed=False)
                save()
    durations: list[float] = []
    for r in range(plan.rounds):
        started = time.perf_counter()
        if durations and started + statistics.mean(durations) > deadline:
            logger.info("%s: stopping after %d rounds (time budget)", name, r)
            break
        for concurrency in plan.concurrency:
            # Single streams are short and noisy: measure them a few times a round.
            repeats = plan.single_repeats if concurrency == 1 else 1
            for i in range(repeats):
                systems = systems_for(concurrency, plan.systems)
                # Every other wave in reverse order, so that no system always runs
                # just after another (the paired ratio's raw wave is before or after).
                if (r * repeats + i) % 2:
                    systems = systems[::-1]
                for system in systems:
                    await record(waves, entry, system, concurrency, timed=True)
                    save()
        durations.append(time.perf_counter() - started)
    entry["rounds"] = len(durations)


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


async def warmup_only(plan: WavePlan, out: Path) -> dict[str, Any]:
    """Build each model and time ``warm_up`` alone (e.g. a restart with a warm PTX cache)."""
    tokenizer = make_tokenizer()
    result: dict[str, Any] = {"machine": machine(), "warmup_only": {}}
    max_batch = plan.max_batch
    for name in plan.models:
        with EngineThread() as thread:
            model = await thread.run(make_model, plan.quick, name == "q4")
            engine = make_engine(model, tokenizer, dtype="bfloat16", quantized=name == "q4")
            run = partial(warm_up, max_batch=max_batch, prefill_chunk=DEFAULT_PREFILL_CHUNK)
            report = await thread.run(run, engine)
        logger.info("%s: %s", name, report.describe())
        result["warmup_only"][name] = warmup_record(report)
    out.write_text(json.dumps(result, indent=1))
    return result


async def run_waves(plan: WavePlan, out: Path) -> dict:
    """The whole run, written to ``out`` after every wave; the JSON-ready document."""
    doc: dict[str, Any] = {
        "machine": machine(),
        "config": {
            "prompt_tokens": plan.prompt_tokens,
            "max_tokens": plan.max_tokens,
            "concurrency": list(plan.concurrency),
            "rounds": plan.rounds,
            "max_batch": plan.max_batch,
            "prefill_batch": PREFILL_BATCH,
            "prefill_chunk": DEFAULT_PREFILL_CHUNK,
            "quick": plan.quick,
        },
        "models": {},
    }
    out.parent.mkdir(parents=True, exist_ok=True)

    def save() -> None:
        doc["summary"] = summarize(doc)
        results.write_json(out, doc, indent=1)

    tokenizer = make_tokenizer()
    start = time.perf_counter()
    names = plan.models
    for i, name in enumerate(names):
        share = (plan.budget_s - (time.perf_counter() - start)) / (len(names) - i)
        doc["models"][name] = {}
        deadline = time.perf_counter() + share
        await bench_model(name, tokenizer, plan, doc["models"][name], save, deadline)
    doc["total_s"] = time.perf_counter() - start
    save()
    return doc
