"""A server under test as a subprocess on a loopback port: start, wait until healthy, stop.

``open_server`` owns the process: whatever happens inside it (an error, a cancellation, a
timeout around the whole benchmark), the process is terminated, and killed after a grace period,
before it returns.
"""

from __future__ import annotations

import logging
import socket
import subprocess
import time
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx
import trio

logger = logging.getLogger(__name__)

READY_TIMEOUT_S = 120.0
STOP_GRACE_S = 15.0
HEALTH_POLL_S = 0.5


@dataclass(frozen=True, slots=True)
class RunningServer:
    """A started, healthy server: its base URL and process id."""

    url: str
    pid: int


def free_loopback_port() -> int:
    """A TCP port free on 127.0.0.1 right now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


async def wait_ready(url: str, process: trio.Process, timeout_s: float) -> None:
    """Poll ``GET {url}/health`` until it answers 200.

    Raises RuntimeError if the process exits or ``timeout_s`` passes first. Cancelled: nothing
    is left behind (the process is the caller's).
    """
    deadline = trio.current_time() + timeout_s
    async with httpx.AsyncClient(base_url=url, timeout=5.0, trust_env=False) as client:
        while trio.current_time() < deadline:
            if process.returncode is not None:
                raise RuntimeError(f"server exited with status {process.returncode}")
            try:
                if (await client.get("/health")).status_code == 200:
                    return
            except httpx.HTTPError:
                pass  # not listening yet
            await trio.sleep(HEALTH_POLL_S)
    raise RuntimeError(f"server not ready within {timeout_s:g} s")


async def stop_process(process: trio.Process, grace_s: float) -> None:
    """Terminate ``process``; kill it if it has not exited after ``grace_s``.

    Shielded and bounded (``grace_s`` plus 5 s), so it runs to the end even when cancelled.
    """
    with trio.move_on_after(grace_s + 5, shield=True):
        if process.returncode is None:
            process.terminate()
            with trio.move_on_after(grace_s):
                await process.wait()
        if process.returncode is None:
            logger.warning("server did not stop within %g s; killing it", grace_s)
            process.kill()
            await process.wait()


@asynccontextmanager
async def open_server(
    name: str,
    argv: Sequence[str],
    port: int,
    log_path: Path,
    *,
    ready_timeout_s: float = READY_TIMEOUT_S,
    stop_grace_s: float = STOP_GRACE_S,
) -> AsyncIterator[RunningServer]:
    """Start ``argv`` (a server that will listen on 127.0.0.1:``port``), wait until healthy.

    Yields the running server; its stdout and stderr go to ``log_path``. On any exit,
    cancellation included, the process is stopped (see :func:`stop_process`) before this returns.
    Raises RuntimeError if the server exits or is not healthy within ``ready_timeout_s``.
    """
    url = f"http://127.0.0.1:{port}"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with log_path.open("wb") as log:
        started = time.perf_counter()
        process = await trio.lowlevel.open_process(list(argv), stdout=log, stderr=subprocess.STDOUT)
        try:
            await wait_ready(url, process, ready_timeout_s)
            logger.info("%s ready at %s after %.1f s", name, url, time.perf_counter() - started)
            yield RunningServer(url, process.pid)
        finally:
            await stop_process(process, stop_grace_s)
            logger.info("%s stopped (status %s)", name, process.returncode)
