"""The memory budget, measured: servers side by side on one device, each with its share.

Starts ``--servers`` ``mlx-trio serve`` processes on one model, each with ``--memory-limit``,
runs the same streaming load against all of them at once (greedy chat, ``--max-tokens`` new
tokens, at each of ``--clients``), and reports for each server: the requests that failed, its
budget, MLX's active/cache/peak memory (``/v1/stats``) and the GPU memory its processes hold
(``nvidia-smi``). It exits 1 if a request failed, a step ran out of memory, or a server's GPU
memory went past its limit.

    python -m bench.memory                                   # one server, the default limit
    python -m bench.memory --servers 3 --memory-limit 0.3    # three, a third of the GPU each
    python -m bench.memory --quick --device cpu              # a tiny model: checks the script

The model is ``bench/gpu.py``'s: random bf16 weights in the Llama-3.2-1B shape (1.24B
parameters with its 128,256-id vocabulary), written once to ``--model-dir`` by a child process
(so this one never holds the GPU). design/015-memory-budget.md has the figures.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import shutil
import subprocess
import sys
from dataclasses import asdict
from functools import partial
from pathlib import Path
from typing import Any

import httpx
import trio

from mlx_trio.api.bench.load import run_load
from mlx_trio.api.bench.server_process import free_loopback_port, open_server

logger = logging.getLogger("bench.memory")

GiB = 1 << 30
DEFAULT_DIR = Path.home() / ".cache" / "mlx-trio" / "bench-llama-1b-bf16"


def build_model_dir(path: Path, quick: bool, shape: str = "1b", quantized: bool = False) -> None:
    """Write the GPU bench's model (``shape``: 1b or 8b; ``quantized``: 4-bit, group 64) and
    tokenizer (``mlx_trio.api.bench.models``) as an mlx-lm model directory."""
    import mlx.core as mx
    from mlx_lm.utils import save_config, save_model

    from mlx_trio.api.bench.models import make_model, make_tokenizer, model_args

    path.mkdir(parents=True, exist_ok=True)
    model = make_model(quick, quantized=quantized, shape=shape)
    save_model(path, model)
    config = {k: v for k, v in vars(model_args(quick, shape)).items() if v is not None}
    if quantized:
        config["quantization"] = {"group_size": 64, "bits": 4}
    save_config({**config, "torch_dtype": "bfloat16"}, config_path=path / "config.json")
    make_tokenizer()._tokenizer.save_pretrained(path)
    del model
    mx.clear_cache()


def process_tree(pid: int) -> list[int]:
    """``pid`` and its descendants (the engine process is a child of ``serve``)."""
    found = [pid]
    for parent in found:
        children = Path(f"/proc/{parent}/task/{parent}/children")
        with contextlib.suppress(OSError):
            found += [int(c) for c in children.read_text().split()]
    return found


def gpu_memory_by_pid() -> dict[int, int]:
    """Bytes of GPU memory each process holds, as ``nvidia-smi`` reports (empty without it)."""
    if shutil.which("nvidia-smi") is None:
        return {}
    out = subprocess.run(
        ["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
        capture_output=True,
        text=True,
        check=False,
    ).stdout
    used: dict[int, int] = {}
    for line in out.splitlines():
        pid, _, mib = line.partition(",")
        if pid.strip().isdigit() and mib.strip().isdigit():
            used[int(pid)] = int(mib) << 20
    return used


def gpu_used_total() -> int | None:
    if shutil.which("nvidia-smi") is None:
        return None
    out = subprocess.run(
        ["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
        capture_output=True,
        text=True,
        check=False,
    ).stdout.split()
    return int(out[0]) << 20 if out and out[0].isdigit() else None


async def run(args: argparse.Namespace) -> dict[str, Any]:
    model_dir = Path(args.model_dir)
    if not (model_dir / "config.json").exists():
        logger.info("writing the model to %s", model_dir)
        build = [sys.executable, "-m", "bench.memory", "--build-only"]
        build += ["--model-dir", str(model_dir)] + (["--quick"] if args.quick else [])
        await trio.run_process(build)
    levels = [int(c) for c in args.clients.split(",")]
    report: dict[str, Any] = {"args": vars(args), "gpu_used_before": gpu_used_total()}
    ports = [free_loopback_port() for _ in range(args.servers)]
    async with trio.open_nursery() as nursery:
        servers: list[Any] = [None] * args.servers
        ready = trio.Event()
        stop = trio.Event()

        async def serve(i: int) -> None:
            argv = [
                *(sys.executable, "-m", "mlx_trio.api.cli", "serve", "--model", str(model_dir)),
                *("--port", str(ports[i]), "--device", args.device),
                *("--max-batch", str(args.max_batch), "--max-queued", "1024"),
                *(["--memory-limit", args.memory_limit] if args.memory_limit else []),
            ]
            log = Path(args.out).with_suffix(f".server{i}.log")
            async with open_server(f"server {i}", argv, ports[i], log, ready_timeout_s=900) as s:
                servers[i] = s
                if all(servers):
                    ready.set()
                await stop.wait()

        for i in range(args.servers):
            nursery.start_soon(serve, i)
            await trio.sleep(args.stagger_s)  # their warm-ups compile the same kernels
        await ready.wait()
        report["gpu_used_ready"] = gpu_used_total()
        report["levels"] = []
        for clients in levels:
            results: list[Any] = [None] * args.servers

            async def load(i: int, clients: int = clients, out: list[Any] = results) -> None:
                out[i] = await run_load(servers[i].url, clients=clients, max_tokens=args.max_tokens)

            async with trio.open_nursery() as loads:
                for i in range(args.servers):
                    loads.start_soon(load, i)
            row = {"clients": clients, "servers": []}
            for i, result in enumerate(results):
                summary = result.summary()
                row["servers"].append({k: summary[k] for k in ("num_ok", "errors", "tokens_per_s")})
                logger.info(
                    "server %d, %d clients: %d ok, %.0f tok/s, errors %s",
                    i,
                    clients,
                    result.num_ok,
                    result.tokens_per_s,
                    dict(result.errors),
                )
            report["levels"].append(row)
        by_pid = gpu_memory_by_pid()
        report["gpu_used_after"] = gpu_used_total()
        report["servers"] = []
        for s in servers:
            async with httpx.AsyncClient(base_url=s.url) as http:
                stats = (await http.get("/v1/stats")).json()
            pids = process_tree(s.pid)
            report["servers"].append(
                {
                    "pids": pids,
                    "gpu_bytes": sum(by_pid.get(p, 0) for p in pids) if by_pid else None,
                    "memory_budget": stats["memory_budget"],
                    "memory": stats["memory"],
                    "prompt_cache_bytes": (stats["prompt_cache"] or {}).get("bytes"),
                    "failed": stats["failed"],
                    "out_of_memory": stats["out_of_memory"],
                    "batch_limit": stats["batch_limit"],
                }
            )
        stop.set()
    return report


def verdict(report: dict[str, Any]) -> list[str]:
    """What missed the goals (empty: all met)."""
    misses = []
    for row in report["levels"]:
        for i, s in enumerate(row["servers"]):
            if s["errors"]:
                misses.append(f"server {i}, {row['clients']} clients: errors {s['errors']}")
    for i, s in enumerate(report["servers"]):
        limit = s["memory_budget"]["limit"]
        if s["failed"] or s["out_of_memory"]:
            misses.append(f"server {i}: failed {s['failed']}, out of memory {s['out_of_memory']}")
        if s["gpu_bytes"] is not None and s["gpu_bytes"] > limit:
            misses.append(
                f"server {i}: {s['gpu_bytes'] / GiB:.1f} GiB of GPU memory, "
                f"over its limit of {limit / GiB:.1f} GiB"
            )
    return misses


def table(report: dict[str, Any]) -> str:
    lines = [
        "| server (GiB) | limit | KV pool | MLX active | MLX cache | MLX peak | prompt cache "
        "| GPU (nvidia-smi) |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for i, s in enumerate(report["servers"]):
        b, m = s["memory_budget"], s["memory"]
        gpu = "-" if s["gpu_bytes"] is None else f"{s['gpu_bytes'] / GiB:.2f}"
        lines.append(
            f"| {i} | {b['limit'] / GiB:.2f} | {b['kv_pool'] / GiB:.2f} | {m['active'] / GiB:.2f} "
            f"| {m['cache'] / GiB:.2f} | {m['peak'] / GiB:.2f} "
            f"| {(s['prompt_cache_bytes'] or 0) / GiB:.2f} | {gpu} |"
        )
    used = [report.get(k) for k in ("gpu_used_before", "gpu_used_ready", "gpu_used_after")]
    if all(isinstance(u, int) for u in used):
        before, ready, after = (u / GiB for u in used)
        lines.append(
            f"GPU memory used in all (GiB): before {before:.2f}, servers ready {ready:.2f}, "
            f"after the load {after:.2f}"
        )
    for row in report["levels"]:
        rates = ", ".join(f"{s['tokens_per_s']:.0f}" for s in row["servers"])
        lines.append(f"{row['clients']} clients a server: tok/s {rates}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--servers", type=int, default=1)
    parser.add_argument("--memory-limit", default=None, help="each server's (default: serve's)")
    parser.add_argument("--clients", default="1,16,64,256", help="levels, one after another")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--max-batch", type=int, default=256)
    parser.add_argument("--device", choices=["auto", "cpu", "gpu"], default="auto")
    parser.add_argument("--model-dir", default=str(DEFAULT_DIR))
    parser.add_argument("--quick", action="store_true", help="a tiny model of the same shape")
    parser.add_argument("--stagger-s", type=float, default=5.0, help="between server starts")
    parser.add_argument("--out", default="bench/results/memory.json")
    parser.add_argument("--build-only", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--shape", choices=["1b", "8b"], default="1b", help=argparse.SUPPRESS)
    parser.add_argument("--quantized", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    if args.build_only:
        build_model_dir(Path(args.model_dir), args.quick, args.shape, args.quantized)
        return
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    report = trio.run(partial(run, args))
    report["misses"] = verdict(report)
    Path(args.out).write_text(json.dumps(report, indent=1, default=asdict))
    print(table(report))
    for miss in report["misses"]:
        print(f"MISSED: {miss}")
    sys.exit(1 if report["misses"] else 0)


if __name__ == "__main__":
    main()
