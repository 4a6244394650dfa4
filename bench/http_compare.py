"""mlx-trio's HTTP server against ``mlx_lm.server``: same model, prompts and ``max_tokens``.

Each system is started here as a subprocess on a free loopback port, one after the other (only
one server alive at a time), waited for through ``GET /health``, warmed up with one short
request, then loaded by ``bench.http_load`` at each concurrency level. It measures generated
tok/s, TTFT and inter-token latency percentiles and errors per system and level, and the ratios
mlx-trio / mlx_lm.server of tok/s (higher is better) and TTFT p99 (lower is better).

Both serve the default model in float32 on CPU with the same batch settings (``bench.systems``).
Usage: ``python -m bench.http_compare [--systems mlx-trio,mlx_lm] [--clients 1,8,32]
[--max-tokens 64]``; writes ``bench/results/http_compare.json``.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import httpx
import trio

from bench import cpu_share
from bench.http_load import LoadResult, run_load
from bench.server_process import free_loopback_port, open_server
from bench.systems import (
    MAX_BATCH,
    PREFILL_BATCH,
    PREFILL_CHUNK,
    SYSTEMS,
    ensure_f32_model,
    server_spec,
)

logger = logging.getLogger(__name__)

RESULTS_DIR = Path(__file__).resolve().parent / "results"
WARMUP_MAX_TOKENS = 8
IDLE_PROBE_S = 1.0
BUSY_OTHER_SHARE = 0.1


@dataclass(frozen=True, slots=True)
class LevelRun:
    """One concurrency level against one system.

    ``other_cpu_share``: the fraction of the machine's CPU time during the level used by
    processes other than the server and this benchmark (None where it cannot be measured).
    More than a few percent means something else competed for the cores.
    """

    result: LoadResult
    other_cpu_share: float | None


@dataclass(frozen=True, slots=True)
class SystemRun:
    """One system's levels, or as many as ran and why it stopped early.

    ``idle_other_cpu_share``: the same measure over a second before the server started.
    """

    system: str
    levels: tuple[LevelRun, ...]
    idle_other_cpu_share: float | None
    error: str | None = None


async def _idle_other_share() -> float | None:
    """The CPU share other processes take over ``IDLE_PROBE_S`` while no server runs."""
    before = cpu_share.sample([os.getpid()])
    await trio.sleep(IDLE_PROBE_S)
    return cpu_share.other_share(before, cpu_share.sample([os.getpid()]))


def _warn_if_busy(share: float | None, what: str) -> None:
    if share is not None and share > BUSY_OTHER_SHARE:
        logger.warning("other processes used %.0f%% of the CPU %s", share * 100, what)


async def _measure_level(
    url: str, pid: int, *, clients: int, max_tokens: int, model: str | None, prompt_offset: int
) -> LevelRun:
    """One level's load, and how much CPU other processes took meanwhile."""
    watched = [os.getpid(), pid]
    before = cpu_share.sample(watched)
    result = await run_load(
        url, clients=clients, max_tokens=max_tokens, model=model, prompt_offset=prompt_offset
    )
    return LevelRun(result, cpu_share.other_share(before, cpu_share.sample(watched)))


async def run_system(
    system: str,
    *,
    f32_dir: Path,
    client_levels: Sequence[int],
    max_tokens: int,
    log_dir: Path,
) -> SystemRun:
    """Start ``system``'s server, warm it up and load it at each level; stop it after.

    A failure (the server does not start, a level raises) ends this system's run with its
    levels so far and the error; the server is stopped either way, cancellation included.
    """
    port = free_loopback_port()
    spec = server_spec(system, port, f32_dir)
    log_path = log_dir / f"{system}-server.log"
    idle_share = await _idle_other_share()
    _warn_if_busy(idle_share, f"before {system} started")
    levels: list[LevelRun] = []
    try:
        async with open_server(system, spec.argv, port, log_path) as server:
            warmup = await run_load(
                server.url, clients=1, max_tokens=WARMUP_MAX_TOKENS, model=spec.model
            )
            logger.info("%s warm-up: %s", system, warmup.errors or "ok")
            offset = 1
            for clients in client_levels:
                logger.info("%s: %d clients, max_tokens %d", system, clients, max_tokens)
                level = await _measure_level(
                    server.url,
                    server.pid,
                    clients=clients,
                    max_tokens=max_tokens,
                    model=spec.model,
                    prompt_offset=offset,
                )
                offset += clients
                r = level.result
                logger.info(
                    "%s: %d clients: %.1f tok/s, %d errors %s",
                    system,
                    clients,
                    r.tokens_per_s,
                    r.num_errors,
                    r.errors or "",
                )
                _warn_if_busy(level.other_cpu_share, f"during {system} at {clients} clients")
                levels.append(level)
    except (RuntimeError, OSError, httpx.HTTPError, ValueError) as exc:
        logger.error("%s failed: %s (server log: %s)", system, exc, log_path)
        return SystemRun(system, tuple(levels), idle_share, error=str(exc))
    return SystemRun(system, tuple(levels), idle_share)


async def run_compare(
    systems: Sequence[str],
    *,
    client_levels: Sequence[int],
    max_tokens: int,
    f32_dir: Path,
    log_dir: Path,
) -> tuple[SystemRun, ...]:
    """Run each system in turn (one server alive at a time) at each concurrency level.

    Prompts are numbered on from the warm-up across the levels, so no level repeats a prompt
    a server has seen (a prompt cache cannot answer from an earlier level), and both systems
    get the same prompts. Cancelled: the running server is stopped; no results are returned.
    """
    runs = []
    for system in systems:
        runs.append(
            await run_system(
                system,
                f32_dir=f32_dir,
                client_levels=client_levels,
                max_tokens=max_tokens,
                log_dir=log_dir,
            )
        )
    return tuple(runs)


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1000:.0f}"


def _pct(share: float | None) -> str:
    return "-" if share is None else f"{share * 100:.0f}"


def markdown_table(runs: Sequence[SystemRun]) -> str:
    """One row per system and concurrency level; "other CPU %" is LevelRun.other_cpu_share."""
    lines = [
        "| system | clients | tok/s | TTFT p50 ms | TTFT p99 ms | ITL p50 ms | ITL p99 ms "
        "| errors | other CPU % |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | --- | ---: |",
    ]
    for run in runs:
        for level in run.levels:
            r = level.result
            errors = f"{r.num_errors} {r.errors}" if r.errors else "0"
            lines.append(
                f"| {run.system} | {r.clients} | {r.tokens_per_s:.1f} | {_ms(r.ttft_p50_s)} "
                f"| {_ms(r.ttft_p99_s)} | {_ms(r.itl_p50_s)} | {_ms(r.itl_p99_s)} | {errors} "
                f"| {_pct(level.other_cpu_share)} |"
            )
        if run.error:
            lines.append(f"| {run.system} | - | - | - | - | - | - | failed: {run.error} | - |")
    return "\n".join(lines)


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def ratios(runs: Sequence[SystemRun]) -> list[dict[str, float | int | None]]:
    """mlx-trio / mlx_lm.server of tok/s and TTFT p99 at each level both systems reached.

    Each row also carries both systems' error counts: a failed request adds no tokens and,
    if it failed before its first token, no TTFT, so a ratio compares like with like only
    when both counts are 0.
    """
    by_system = {run.system: {lv.result.clients: lv.result for lv in run.levels} for run in runs}
    ours, theirs = by_system.get("mlx-trio", {}), by_system.get("mlx_lm", {})
    return [
        {
            "clients": clients,
            "tok_s_ratio": _ratio(ours[clients].tokens_per_s, theirs[clients].tokens_per_s),
            "ttft_p99_ratio": _ratio(ours[clients].ttft_p99_s, theirs[clients].ttft_p99_s),
            "mlx_trio_errors": ours[clients].num_errors,
            "mlx_lm_errors": theirs[clients].num_errors,
        }
        for clients in sorted(ours.keys() & theirs.keys())
    ]


def format_ratio(row: dict[str, float | int | None]) -> str:
    """One line per level: the two ratios, and the error counts when there were any."""

    def fmt(x: float | int | None) -> str:
        return "-" if x is None else f"{x:.2f}"

    line = (
        f"{row['clients']} clients: mlx-trio / mlx_lm.server tok/s {fmt(row['tok_s_ratio'])} "
        f"(higher is better), TTFT p99 {fmt(row['ttft_p99_ratio'])} (lower is better)"
    )
    if row["mlx_trio_errors"] or row["mlx_lm_errors"]:
        line += (
            f"; not like for like: errors mlx-trio {row['mlx_trio_errors']}, "
            f"mlx_lm.server {row['mlx_lm_errors']}"
        )
    return line


def to_json(runs: Sequence[SystemRun], *, max_tokens: int, client_levels: Sequence[int]) -> dict:
    """All results: per system and level, the summary and each request's outcome."""

    return {
        "max_tokens": max_tokens,
        "clients": list(client_levels),
        "settings": {
            "max_batch": MAX_BATCH,
            "prefill_batch": PREFILL_BATCH,
            "prefill_chunk": PREFILL_CHUNK,
        },
        "runs": [
            {
                "system": run.system,
                "error": run.error,
                "idle_other_cpu_share": run.idle_other_cpu_share,
                "levels": [
                    {
                        **lv.result.summary(),
                        "other_cpu_share": lv.other_cpu_share,
                        "requests": [q.to_json() for q in lv.result.requests],
                    }
                    for lv in run.levels
                ],
            }
            for run in runs
        ],
        "ratios_mlx_trio_over_mlx_lm": ratios(runs),
    }


def _parse_list(text: str) -> list[str]:
    return [item.strip() for item in text.split(",") if item.strip()]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--systems", default=",".join(SYSTEMS), help="mlx-trio,mlx_lm")
    parser.add_argument("--clients", default="1,8,32", help="concurrency levels, e.g. 1,8,32")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--out", type=Path, default=RESULTS_DIR / "http_compare.json")
    parser.add_argument(
        "--timeout", type=float, default=3600.0, help="bound on the whole run, seconds"
    )
    args = parser.parse_args()
    systems = _parse_list(args.systems)
    if unknown := [s for s in systems if s not in SYSTEMS]:
        parser.error(f"unknown systems {unknown}; choose from {', '.join(SYSTEMS)}")
    try:
        client_levels = [int(c) for c in _parse_list(args.clients)]
    except ValueError:
        parser.error(f"--clients must be comma-separated integers, got {args.clients!r}")
    if not client_levels or min(client_levels) < 1:
        parser.error("--clients needs at least one level, each at least 1")
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S", stream=sys.stdout
    )
    logging.getLogger("httpx").setLevel(logging.WARNING)  # not a line per request
    f32_dir = ensure_f32_model()

    async def bounded() -> tuple[SystemRun, ...]:
        with trio.fail_after(args.timeout):
            return await run_compare(
                systems,
                client_levels=client_levels,
                max_tokens=args.max_tokens,
                f32_dir=f32_dir,
                log_dir=args.out.parent,
            )

    try:
        runs = trio.run(bounded)
    except* KeyboardInterrupt:
        sys.exit("interrupted; the server was stopped")
    print()
    print(markdown_table(runs))
    print()
    for row in ratios(runs):
        print(format_ratio(row))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    data = to_json(runs, max_tokens=args.max_tokens, client_levels=client_levels)
    args.out.write_text(json.dumps(data, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
