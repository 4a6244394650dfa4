"""Every system side by side, one command: raw mlx-lm, mlx-trio in-process and both servers.

On the embedded default model (SmolLM2-135M, float32 on CPU with OpenBLAS), with the same chat
prompts, greedy, ``max_tokens`` new tokens per stream and the same batch settings
(``bench.systems``), at each concurrency level:

- ``mlx-lm stream_generate``: mlx-lm's single-stream loop, in-process; it cannot batch, so it
  runs at 1 stream only;
- ``mlx-lm BatchGenerator``: mlx-lm's continuous batching on its own, in-process, all streams
  inserted at once (the in-process ceiling);
- ``mlx-trio in-process``: concurrent sessions through ``open_runtime``;
- ``mlx-trio HTTP``: ``mlx-trio serve``, loaded by ``bench.http_load`` over loopback;
- ``mlx_lm.server``: the same load against ``mlx_lm.server``, stock;
- ``mlx_lm.server, backlog 128``: the same, listening with a backlog of 128 instead of Python
  ``socketserver``'s 5, beyond which stock ``mlx_lm.server`` resets a burst of connections
  (from 16 streams on here), so that every stream is served and the ratios compare like with
  like.

Each system lives in its own process for the whole run (the in-process ones in
``bench.suite_inprocess`` workers), started and warmed up once; only one is ever busy. The
levels are interleaved: at each level every system runs once, in an order that rotates from
level to level, so a noisy stretch of time hits every system rather than one. Per run: generated
tok/s, TTFT and inter-token latency p50/p99, errors, the process's peak RSS during the run
(``VmHWM``, reset before it) and the CPU share other processes took meanwhile
(``bench.cpu_share``). Then, in-process, a cancelled stream's row: how many batch steps start
between the cancel and the row leaving the batch.

Usage: ``python -m bench.suite [--concurrency 1,4,8,16,32,64] [--max-tokens 48]``; writes
``bench/results/suite.json`` and ``suite.png`` and prints a markdown table and the goals.
``python -m bench.suite --report-only bench/results/suite.json`` redraws both from a JSON.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Sequence
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx
import trio

from bench import cpu_share, suite_report
from bench.http_load import LoadResult, RequestResult, run_load, summarize
from bench.server_process import free_loopback_port, open_server, stop_process
from bench.suite_inprocess import WARMUP_CLIENTS, WARMUP_MAX_TOKENS
from bench.systems import MAX_BATCH, PREFILL_BATCH, PREFILL_CHUNK, ensure_f32_model, server_spec

logger = logging.getLogger("bench.suite")

RESULTS_DIR = Path(__file__).resolve().parent / "results"


@dataclass(frozen=True, slots=True)
class SystemDef:
    """How the suite names a system and starts it: a worker's or a server's system name."""

    label: str
    kind: str  # "in-process" or "http"
    system: str
    listen_backlog: int | None = None


MLX_LM_BACKLOG = 128
SYSTEMS = {
    "stream_generate": SystemDef("mlx-lm stream_generate", "in-process", "stream_generate"),
    "batch_generator": SystemDef("mlx-lm BatchGenerator", "in-process", "batch_generator"),
    "mlx-trio-inprocess": SystemDef("mlx-trio in-process", "in-process", "mlx-trio"),
    "mlx-trio-http": SystemDef("mlx-trio HTTP", "http", "mlx-trio"),
    "mlx_lm-http": SystemDef("mlx_lm.server", "http", "mlx_lm"),
    # Stock mlx_lm.server listens with socketserver's backlog of 5 and resets connections
    # beyond it in a burst; this one gets a backlog of 128, so every stream is served.
    "mlx_lm-http-backlog": SystemDef(
        f"mlx_lm.server, backlog {MLX_LM_BACKLOG}", "http", "mlx_lm", MLX_LM_BACKLOG
    ),
}
SINGLE_STREAM_ONLY = {"stream_generate"}
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
    """A ``bench.suite_inprocess`` process: one JSON command line in, one answer line out."""

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
async def open_worker(system: str, log_path: Path) -> AsyncIterator[Worker]:
    """Start a worker for ``system`` and wait for its ready line (model loaded, warmed up).

    On any exit the worker's stdin is closed and the process stopped (``stop_process``).
    """
    argv = [sys.executable, "-m", "bench.suite_inprocess", system]
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

    async def run(self, clients: int, max_tokens: int, prompt_offset: int) -> LoadResult:
        if self.worker is None:
            assert self.url is not None
            return await run_load(
                self.url,
                clients=clients,
                max_tokens=max_tokens,
                model=self.model,
                prompt_offset=prompt_offset,
            )
        command = {"op": "run", "clients": clients, "max_tokens": max_tokens}
        answer = await self.worker.ask({**command, "prompt_offset": prompt_offset})
        requests = [
            RequestResult(**{**r, "inter_token_s": tuple(r["inter_token_s"])})
            for r in answer["requests"]
        ]
        return summarize(
            url=f"in-process:{self.worker.system}",
            model="default",
            clients=clients,
            requests_per_client=1,
            max_tokens=max_tokens,
            wall_s=answer["wall_s"],
            requests=requests,
        )


async def start_target(stack: AsyncExitStack, key: str, f32_dir: Path, log_dir: Path) -> Target:
    """Start ``key``'s process inside ``stack`` (stopped when it closes), warmed up."""
    d = SYSTEMS[key]
    started = time.perf_counter()
    log_path = log_dir / f"suite-{key}.log"
    if d.kind == "in-process":
        worker = await stack.enter_async_context(open_worker(d.system, log_path))
        startup_s = time.perf_counter() - started
        return Target(key, d.label, d.kind, worker.pid, worker=worker, startup_s=startup_s)
    port = free_loopback_port()
    spec = server_spec(d.system, port, f32_dir, listen_backlog=d.listen_backlog)
    server = await stack.enter_async_context(open_server(key, spec.argv, port, log_path))
    target = Target(key, d.label, d.kind, server.pid, url=server.url, model=spec.model)
    # The same warm-up as the workers': prompts 0..3, a few tokens each.
    await run_load(
        server.url, clients=WARMUP_CLIENTS, max_tokens=WARMUP_MAX_TOKENS, model=spec.model
    )
    target.startup_s = time.perf_counter() - started
    logger.info("%s ready and warmed up after %.1f s", key, target.startup_s)
    return target


# -- measuring ------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Measurement:
    """One system at one concurrency level."""

    key: str
    result: LoadResult
    other_cpu_share: float | None
    peak_rss_bytes: int | None


async def measure(target: Target, clients: int, max_tokens: int, prompt_offset: int) -> Measurement:
    """Load ``target`` once; its process's peak RSS and other processes' CPU share meanwhile."""
    reset_peak_rss(target.pid)
    watched = [os.getpid(), target.pid]
    before = cpu_share.sample(watched)
    result = await target.run(clients, max_tokens, prompt_offset)
    share = cpu_share.other_share(before, cpu_share.sample(watched))
    return Measurement(target.key, result, share, read_peak_rss(target.pid))


def plan(keys: Sequence[str], levels: Sequence[int]) -> list[tuple[int, str]]:
    """(level, system) in run order: levels ascending, systems rotating from level to level."""
    runs = []
    for i, clients in enumerate(levels):
        order = list(keys[i % len(keys) :]) + list(keys[: i % len(keys)])
        runs.extend((clients, k) for k in order if clients == 1 or k not in SINGLE_STREAM_ONLY)
    return runs


async def idle_other_share(seconds: float) -> float | None:
    """The CPU share other processes take over ``seconds`` while nothing is being measured."""
    before = cpu_share.sample([os.getpid()])
    await trio.sleep(seconds)
    return cpu_share.other_share(before, cpu_share.sample([os.getpid()]))


async def run_suite(args: argparse.Namespace, f32_dir: Path) -> dict:
    """Start every system, run the plan, probe cancellation; everything as a JSON-ready dict."""
    keys = [k for k in SYSTEMS if k in args.systems]
    levels = args.concurrency
    idle_share = await idle_other_share(IDLE_PROBE_S)
    logger.info("other processes' CPU share before starting: %s", suite_report.pct(idle_share))
    targets: dict[str, Target] = {}
    measurements: list[Measurement] = []
    probe: dict | None = None
    async with AsyncExitStack() as stack:
        for key in keys:
            logger.info("starting %s", key)
            try:
                targets[key] = await start_target(stack, key, f32_dir, args.out.parent)
            except (RuntimeError, OSError, httpx.HTTPError, trio.TooSlowError) as exc:
                logger.error("%s did not start: %r", key, exc)
                d = SYSTEMS[key]
                targets[key] = Target(key, d.label, d.kind, pid=0, error=f"did not start: {exc!r}")
        runs = plan(keys, levels)
        offsets = {c: WARMUP_CLIENTS + sum(levels[: levels.index(c)]) for c in levels}
        for n, (clients, key) in enumerate(runs, 1):
            target = targets[key]
            if target.error is not None:
                continue
            label = SYSTEMS[key].label
            logger.info("(%d/%d) %s: %d streams ...", n, len(runs), label, clients)
            try:
                m = await measure(target, clients, args.max_tokens, offsets[clients])
            except (RuntimeError, OSError, httpx.HTTPError, trio.TooSlowError) as exc:
                logger.error("%s failed at %d streams: %r", key, clients, exc)
                target.error = f"failed at {clients} streams: {exc!r}"
                continue
            measurements.append(m)
            logger.info("(%d/%d) %s", n, len(runs), suite_report.one_line(label, m))
            if m.other_cpu_share is not None and m.other_cpu_share > BUSY_OTHER_SHARE:
                logger.warning(
                    "other processes took %s of the CPU meanwhile",
                    suite_report.pct(m.other_cpu_share),
                )
        inprocess = targets.get("mlx-trio-inprocess")
        if inprocess is not None and inprocess.worker is not None and inprocess.error is None:
            logger.info("cancel probe: %d streams, %d trials ...", PROBE_STREAMS, PROBE_TRIALS)
            command = {"op": "cancel_probe", "streams": PROBE_STREAMS, "trials": PROBE_TRIALS}
            try:
                probe = await inprocess.worker.ask(
                    {**command, "prompt_offset": PROBE_PROMPT_OFFSET}
                )
                logger.info("cancel probe: %s", suite_report.probe_line(probe["trials"]))
            except (RuntimeError, OSError, trio.TooSlowError) as exc:
                logger.error("cancel probe failed: %r", exc)
                probe = {"error": repr(exc)}
        logger.info("stopping every system")
    return suite_report.to_json(
        targets=targets,
        measurements=measurements,
        probe=probe,
        idle_other_share=idle_share,
        settings={
            "max_tokens": args.max_tokens,
            "concurrency": levels,
            "max_batch": MAX_BATCH,
            "prefill_batch": PREFILL_BATCH,
            "prefill_chunk": PREFILL_CHUNK,
            "warmup": f"{WARMUP_CLIENTS} streams x {WARMUP_MAX_TOKENS} tokens per system",
        },
    )


def _levels(text: str) -> list[int]:
    try:
        levels = sorted({int(x) for x in text.split(",") if x.strip()})
    except ValueError:
        raise argparse.ArgumentTypeError(f"not comma-separated integers: {text!r}") from None
    if not levels or levels[0] < 1:
        raise argparse.ArgumentTypeError("at least one level, each at least 1")
    return levels


def _systems(text: str) -> list[str]:
    keys = [k.strip() for k in text.split(",") if k.strip()]
    if unknown := [k for k in keys if k not in SYSTEMS]:
        raise argparse.ArgumentTypeError(f"unknown {unknown}; choose from {', '.join(SYSTEMS)}")
    return keys


def process_age_s() -> float | None:
    """Seconds since this process started (imports included), from ``/proc``; else None."""
    try:
        ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])
        uptime = float(Path("/proc/uptime").read_text().split()[0])
        return uptime - ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


class _Elapsed(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        minutes, seconds = divmod(record.relativeCreated / 1000, 60)
        return f"[{int(minutes):02d}:{seconds:04.1f}] {super().format(record)}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--concurrency", type=_levels, default=_levels("1,4,8,16,32,64"))
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--systems", type=_systems, default=list(SYSTEMS), help=",".join(SYSTEMS))
    parser.add_argument("--out", type=Path, default=RESULTS_DIR / "suite.json")
    parser.add_argument("--report-only", type=Path, default=None, help="a suite.json to redraw")
    args = parser.parse_args()
    handler = logging.StreamHandler(sys.stdout)
    handler.setFormatter(_Elapsed("%(message)s"))
    logging.basicConfig(level=logging.INFO, handlers=[handler])
    logging.getLogger("httpx").setLevel(logging.WARNING)  # not a line per request
    if args.report_only is not None:
        data = json.loads(args.report_only.read_text())
        suite_report.finish(data, args.report_only.with_suffix(".png"))
        return
    args.out.parent.mkdir(parents=True, exist_ok=True)
    f32_dir = ensure_f32_model()
    try:
        data = trio.run(run_suite, args, f32_dir)
    except KeyboardInterrupt:
        sys.exit("interrupted; every system was stopped")
    data["total_s"] = process_age_s()
    args.out.write_text(json.dumps(data, indent=2) + "\n")
    suite_report.finish(data, args.out.with_suffix(".png"))
    logger.info("wrote %s and %s", args.out, args.out.with_suffix(".png"))


if __name__ == "__main__":
    main()
