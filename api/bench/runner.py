"""The harness's runner: systems x scenarios x concurrency levels, measured in turn.

Each system (``systems.SYSTEMS``) lives in its own process for the whole run (the in-process
ones in ``worker`` subprocesses, the servers on loopback ports), started and warmed up once;
only one is ever busy. For each scenario the levels ascend, and at each level every system runs
once, in an order that rotates from level to level, so a noisy stretch of time hits every system
rather than one. Per run: generated tok/s, TTFT and inter-token latency p50/p99, errors, the
process's peak RSS during the run (``VmHWM``, reset before it) and the CPU share other processes
took meanwhile (``cpu_share``). Then, in-process, a cancelled stream's row: how many batch steps
start between the cancel and the row leaving the batch. The HTTP systems are loaded by ``load``,
the harness's one load generator; the workers measure each stream the same way. What has
finished is handed to a ``save`` after every run, so a run cut short keeps it.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import trio

from . import cpu_share, report
from .goals import probe_line
from .load import run_load, run_streams
from .load_result import LoadResult, summarize
from .plan import Run, plan, scenario_settings
from .results import Measurement, SystemRecord, to_json
from .scenarios import Scenario
from .server_process import free_loopback_port, open_server, stop_process
from .stream import RequestResult
from .summary import ms, pct
from .systems import (
    BASELINE,
    MAX_BATCH,
    PREFILL_BATCH,
    PREFILL_CHUNK,
    SYSTEMS,
    WARMUP_BURSTS,
    WARMUP_CLIENTS,
    WARMUP_MAX_TOKENS,
    server_spec,
)

logger = logging.getLogger(__name__)

WORKER_READY_TIMEOUT_S = 180.0
RUN_TIMEOUT_S = 600.0
IDLE_PROBE_S = 2.0
BUSY_OTHER_SHARE = 0.1
PROBE_STREAMS = 8
PROBE_TRIALS = 5
PROBE_PROMPT_OFFSET = 10_000


# -- the systems under test -----------------------------------------------------------------------


def read_peak_rss(pid: int) -> int | None:
    """``VmHWM`` of ``pid`` in bytes (its peak RSS since start or the last reset), or None."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def reset_peak_rss(pid: int) -> bool:
    """Reset ``pid``'s ``VmHWM`` to its current RSS (Linux ``clear_refs``); False if refused."""
    try:
        Path(f"/proc/{pid}/clear_refs").write_text("5")
    except OSError:
        return False
    return True


class Worker:
    """A ``worker`` process: one JSON command line in, one answer line out."""

    def __init__(self, system: str, process: trio.Process) -> None:
        self.system = system
        self.process = process
        self._buffer = bytearray()

    @property
    def pid(self) -> int:
        return self.process.pid

    async def receive(self) -> dict:
        """The next answer; RuntimeError if the worker exits first."""
        assert self.process.stdout is not None
        while b"\n" not in self._buffer:
            chunk = await self.process.stdout.receive_some()
            if not chunk:
                raise RuntimeError(f"{self.system} worker exited (status {self.process.poll()})")
            self._buffer += chunk
        line, _, rest = bytes(self._buffer).partition(b"\n")
        self._buffer = bytearray(rest)
        return json.loads(line)

    async def ask(self, command: dict, timeout_s: float = RUN_TIMEOUT_S) -> dict:
        assert self.process.stdin is not None
        with trio.fail_after(timeout_s):
            await self.process.stdin.send_all(json.dumps(command).encode() + b"\n")
            return await self.receive()


@asynccontextmanager
async def open_worker(
    system: str, log_path: Path, model_dir: Path | None = None
) -> AsyncIterator[Worker]:
    """Start a worker for ``system`` and wait for its ready line (model loaded, warmed up).

    On any exit the worker's stdin is closed and the process stopped (``stop_process``).
    """
    argv = [sys.executable, "-m", f"{__package__}.worker", system]
    if model_dir is not None:
        argv += ["--model", str(model_dir.resolve())]
    with log_path.open("wb") as log:
        process = await trio.lowlevel.open_process(
            argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log
        )
        try:
            worker = Worker(system, process)
            with trio.fail_after(WORKER_READY_TIMEOUT_S):
                ready = await worker.receive()
            logger.info("%s worker ready (model loaded in %.1f s)", system, ready["load_s"])
            yield worker
        finally:
            with trio.move_on_after(1, shield=True):
                assert process.stdin is not None
                await process.stdin.aclose()
            await stop_process(process, grace_s=10)


@dataclass(slots=True)
class Target:
    """A started system: what to call to load it once, and the process to watch."""

    key: str
    label: str
    kind: str
    pid: int
    worker: Worker | None = None
    url: str | None = None
    model: str | None = None
    startup_s: float | None = None
    error: str | None = None
    # A server's warm-up bursts in order, the first sent once /health turned 200.
    bursts_ttft_p99_s: list[float | None] = field(default_factory=list)

    def record(self) -> SystemRecord:
        return SystemRecord(
            self.key,
            self.label,
            self.kind,
            self.startup_s,
            self.error,
            tuple(self.bursts_ttft_p99_s),
        )

    async def run(self, scenario: Scenario, clients: int, prompt_offset: int) -> LoadResult:
        streams = scenario.streams(clients, prompt_offset)
        if self.worker is None:
            assert self.url is not None
            return await run_streams(self.url, streams, model=self.model)
        command = {"op": "run", "streams": [s.to_json() for s in streams]}
        answer = await self.worker.ask(command)
        requests = [
            RequestResult(**{**r, "inter_token_s": tuple(r["inter_token_s"])})
            for r in answer["requests"]
        ]
        return summarize(
            url=f"in-process:{self.worker.system}",
            model="default",
            clients=clients,
            requests_per_client=1,
            max_tokens=scenario.max_tokens,
            wall_s=answer["wall_s"],
            requests=requests,
        )


async def start_target(
    stack: AsyncExitStack,
    key: str,
    f32_dir: Path | None,
    log_dir: Path,
    baseline: Path | None = None,
    model_dir: Path | None = None,
) -> Target:
    """Start ``key``'s process inside ``stack`` (stopped when it closes), warmed up; the
    baseline's server with the interpreter ``baseline``; every system with ``model_dir``'s
    model if given. A server's warm-up bursts' TTFT p99 are kept (``Target.bursts_ttft_p99_s``)."""
    d = SYSTEMS[key]
    started = time.perf_counter()
    log_path = log_dir / f"bench-{key}.log"
    if d.kind == "in-process":
        worker = await stack.enter_async_context(open_worker(d.system, log_path, model_dir))
        startup_s = time.perf_counter() - started
        return Target(key, d.label, d.kind, worker.pid, worker=worker, startup_s=startup_s)
    port = free_loopback_port()
    python = sys.executable
    if key == BASELINE:
        if baseline is None:
            raise RuntimeError("no interpreter given for the baseline (--baseline PYTHON)")
        python = str(baseline)
    spec = server_spec(
        d.system,
        port,
        f32_dir,
        model_dir=model_dir,
        listen_backlog=d.listen_backlog,
        python=python,
    )
    server = await stack.enter_async_context(open_server(key, spec.argv, port, log_path))
    target = Target(key, d.label, d.kind, server.pid, url=server.url, model=spec.model)
    # The same warm-up as the workers', the first burst as soon as /health turned 200.
    for burst in range(WARMUP_BURSTS):
        result = await run_load(
            server.url,
            clients=WARMUP_CLIENTS,
            max_tokens=WARMUP_MAX_TOKENS,
            model=spec.model,
            prompt_offset=burst * WARMUP_CLIENTS,
        )
        target.bursts_ttft_p99_s.append(result.ttft_p99_s)
    target.startup_s = time.perf_counter() - started
    logger.info(
        "%s ready and warmed up after %.1f s (warm-up bursts' TTFT p99: %s ms)",
        key,
        target.startup_s,
        " then ".join(ms(s) for s in target.bursts_ttft_p99_s),
    )
    return target


# -- measuring ------------------------------------------------------------------------------------


async def measure(target: Target, run: Run) -> Measurement:
    """Load ``target`` once; its process's peak RSS and other processes' CPU share meanwhile."""
    reset_peak_rss(target.pid)
    watched = [os.getpid(), target.pid]
    before = cpu_share.sample(watched)
    result = await target.run(run.scenario, run.clients, run.prompt_offset)
    share = cpu_share.other_share(before, cpu_share.sample(watched))
    rss = read_peak_rss(target.pid)
    return Measurement(target.key, run.scenario.name, result, share, rss, run.round)


async def idle_other_share(seconds: float) -> float | None:
    """The CPU share other processes take over ``seconds`` while nothing is being measured."""
    before = cpu_share.sample([os.getpid()])
    await trio.sleep(seconds)
    return cpu_share.other_share(before, cpu_share.sample([os.getpid()]))


async def run_suite(
    *,
    keys: Sequence[str],
    scenarios: Sequence[Scenario],
    levels: Sequence[int],
    f32_dir: Path | None,
    log_dir: Path,
    cancel_probe: bool = True,
    rounds: int = 1,
    baseline: Path | None = None,
    model_dir: Path | None = None,
    save: Callable[[dict], None] | None = None,
    one_at_a_time: bool = False,
) -> dict:
    """Start every system in ``keys``, run the plan (``rounds`` of each level), probe
    cancellation; a JSON-ready dict. ``one_at_a_time``: each system is started only for its
    own runs and stopped before the next starts (a model too large for two servers at once;
    the rounds are then not interleaved between systems).

    A system that does not start, or fails at some level, is recorded with its error and left
    out of the rest of the run; the others go on. ``save`` gets the JSON-ready dict of what has
    finished (``"partial": true``) after each system starts and each run ends, so that a run cut
    short keeps them. Cancelled: every system is stopped first.
    """
    keys = [k for k in SYSTEMS if k in keys]  # the table's order, whatever the flag's
    idle_share = await idle_other_share(IDLE_PROBE_S)
    logger.info("other processes' CPU share before starting: %s", pct(idle_share))
    targets: dict[str, Target] = {}
    measurements: list[Measurement] = []
    cancel_result: dict | None = None
    settings = {
        "max_tokens": scenarios[0].max_tokens,
        "scenarios": [scenario_settings(s) for s in scenarios],
        "concurrency": list(levels),
        "rounds": rounds,
        "baseline": None if baseline is None else str(baseline),
        "max_batch": MAX_BATCH,
        "prefill_batch": PREFILL_BATCH,
        "prefill_chunk": PREFILL_CHUNK,
        "warmup": f"{WARMUP_BURSTS} bursts of {WARMUP_CLIENTS} streams x "
        f"{WARMUP_MAX_TOKENS} tokens per system",
        **({} if model_dir is None else {"model": f"{model_dir.name} ({model_dir})"}),
    }

    def document() -> dict:
        return to_json(
            systems=[t.record() for t in targets.values()],
            measurements=measurements,
            probe=cancel_result,
            idle_other_share=idle_share,
            settings=settings,
        )

    def checkpoint() -> None:
        if save is not None:
            save({**document(), "partial": True})

    async def start(stack: AsyncExitStack, key: str) -> None:
        logger.info("starting %s", key)
        try:
            targets[key] = await start_target(stack, key, f32_dir, log_dir, baseline, model_dir)
        except (RuntimeError, OSError, httpx.HTTPError, trio.TooSlowError) as exc:
            d = SYSTEMS[key]
            log = log_dir / f"bench-{key}.log"
            logger.error("%s did not start: %r (it needs %s; see %s)", key, exc, d.needs, log)
            error = f"did not start: {exc!r} (needs {d.needs})"
            targets[key] = Target(key, d.label, d.kind, pid=0, error=error)
        checkpoint()

    async def measure_runs(runs: Sequence[tuple[int, Run]], total: int) -> None:
        for n, run in runs:
            target = targets[run.key]
            if target.error is not None:
                continue
            label = f"{SYSTEMS[run.key].label} [{run.scenario.name}]"
            if rounds > 1:
                label += f" round {run.round + 1}/{rounds}"
            logger.info("(%d/%d) %s: %d streams ...", n, total, label, run.clients)
            try:
                m = await measure(target, run)
            except (RuntimeError, OSError, httpx.HTTPError, trio.TooSlowError) as exc:
                logger.error("%s failed at %d streams: %r", run.key, run.clients, exc)
                target.error = f"failed at {run.clients} streams ({run.scenario.name}): {exc!r}"
                checkpoint()
                continue
            measurements.append(m)
            checkpoint()
            logger.info("(%d/%d) %s", n, total, report.one_line(label, m))
            if m.other_cpu_share is not None and m.other_cpu_share > BUSY_OTHER_SHARE:
                logger.warning(
                    "other processes took %s of the CPU meanwhile", pct(m.other_cpu_share)
                )

    async def probe(key: str) -> None:
        nonlocal cancel_result
        target = targets.get(key)
        if key == "mlx-trio-inprocess" and cancel_probe and target and target.error is None:
            assert target.worker is not None
            cancel_result = await probe_cancel(target.worker)

    runs = list(enumerate(plan(scenarios, keys, levels, rounds), 1))
    if one_at_a_time:
        # Each system alone on the machine: started, measured at every level, stopped.
        for key in keys:
            async with AsyncExitStack() as stack:
                await start(stack, key)
                await measure_runs([(n, r) for n, r in runs if r.key == key], len(runs))
                await probe(key)
                logger.info("stopping %s", key)
        return document()
    async with AsyncExitStack() as stack:
        for key in keys:
            await start(stack, key)
        await measure_runs(runs, len(runs))
        await probe("mlx-trio-inprocess")
        logger.info("stopping every system")
    return document()


async def probe_cancel(worker: Worker) -> dict:
    """In the mlx-trio worker: how soon a cancelled stream's row leaves the batch."""
    logger.info("cancel probe: %d streams, %d trials ...", PROBE_STREAMS, PROBE_TRIALS)
    command = {"op": "cancel_probe", "streams": PROBE_STREAMS, "trials": PROBE_TRIALS}
    try:
        probe = await worker.ask({**command, "prompt_offset": PROBE_PROMPT_OFFSET})
    except (RuntimeError, OSError, trio.TooSlowError) as exc:
        logger.error("cancel probe failed: %r", exc)
        return {"error": repr(exc)}
    logger.info("cancel probe: %s", probe_line(probe["trials"]))
    return probe
