"""An engine over a group of ranks, started by ``mlx.launch`` (``engine/ranks/distributed.py``).

The runtime stays in this process, as with an engine process; ``mlx.launch`` starts the ranks
(``python -m mlx_trio.engine.ranks.rank``), and rank 0 connects back to a Unix socket here and
answers the engine port's calls over it, framed as an engine process's are. The group is one
"engine process" to the transport and its supervisor: if any rank dies, ``mlx.launch`` ends the
others, rank 0's socket closes, the rows in flight end ``engine_fault``, ``/health`` turns 503,
and the supervisor starts a new group (or gives up, as for any engine). A wedged rank (stopped,
or stuck in a collective) wedges rank 0's call, which the step watchdog and the supervisor's
wedge check catch the same way; killing the group kills every local rank.
"""

from __future__ import annotations

import fcntl
import logging
import os
import pickle
import signal
import subprocess
import sys
import tempfile
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager, suppress
from pathlib import Path

import trio

from ...engine.errors import EngineProcessError
from ...engine.options import CoreRecipe
from ...engine.ranks.rank import RankArgs
from ...engine.ranks.rank_group import RankGroup

logger = logging.getLogger(__name__)

ACCEPT_POLL_S = 0.5
# mlx.launch copies its stdin to every rank's in loops of ``select`` that never wait while a
# rank's stdin pipe has room (our ranks never read it) or its own stdin is at end of file
# (``/dev/null`` under a service manager or a test runner): about a core busy for as long as the
# group runs, taken from the ranks' collectives (a 3-rank test group on 2 cores: 43 s, 22 s
# with this). Its stdin is a pipe of newlines instead, more than a rank's pipe holds, whose
# write end stays open: once the ranks' pipes are full and its own is empty, the loops wait.
LAUNCHER_STDIN_BYTES = 256 << 10


class LaunchedGroup:
    """``mlx.launch`` and its ranks, as an engine process: alive while the launcher runs;
    killed with its whole process group."""

    def __init__(self, process: subprocess.Popen[bytes]) -> None:
        self._process = process

    @property
    def pid(self) -> int | None:
        return self._process.pid

    @property
    def exitcode(self) -> int | None:
        return self._process.poll()

    def is_alive(self) -> bool:
        return self._process.poll() is None

    def kill(self) -> None:
        with suppress(ProcessLookupError):
            os.killpg(self._process.pid, signal.SIGKILL)

    def join(self, timeout: float | None = None) -> None:
        with suppress(subprocess.TimeoutExpired):
            self._process.wait(timeout)


@asynccontextmanager
async def open_rank_group(
    recipe: CoreRecipe, group: RankGroup
) -> AsyncIterator[tuple[trio.SocketStream, LaunchedGroup]]:
    """Launch the group and yield rank 0's connection and the group once rank 0 connected;
    raises ``EngineProcessError`` if the group ends first. On exit the group is killed if it
    still runs (the transport has asked rank 0 to end by then)."""
    with tempfile.TemporaryDirectory(prefix="mlx-trio-ranks-") as folder:
        path = str(Path(folder) / "engine.sock")
        listener = trio.socket.socket(trio.socket.AF_UNIX, trio.socket.SOCK_STREAM)
        await listener.bind(path)
        listener.listen(1)
        args_file = Path(folder) / "rank-args.pickle"
        args = RankArgs(recipe, group, path, logging.getLogger().level)
        args_file.write_bytes(pickle.dumps(args))
        command = group.launch_command(sys.executable, str(args_file))
        logger.info("launching the engine's ranks: %s", " ".join(command))
        stdin, held = _launcher_stdin()
        try:
            process = subprocess.Popen(command, stdin=stdin, start_new_session=True)
        except BaseException:
            os.close(held)
            raise
        finally:
            os.close(stdin)
        launched = LaunchedGroup(process)
        try:
            with listener:
                sock = await _accept(listener, launched)
            yield trio.SocketStream(sock), launched
        finally:
            if launched.is_alive():
                launched.kill()
                await trio.to_thread.run_sync(launched.join)
            os.close(held)


def _launcher_stdin() -> tuple[int, int]:
    """A pipe's read and write ends, ``LAUNCHER_STDIN_BYTES`` of newlines in it (as many as it
    holds where it cannot grow to that: 64 KiB on Linux, a rank's pipe's size)."""
    read, write = os.pipe()
    if (grow := getattr(fcntl, "F_SETPIPE_SZ", None)) is not None:
        with suppress(OSError):
            fcntl.fcntl(write, grow, LAUNCHER_STDIN_BYTES)
    os.set_blocking(write, False)
    with suppress(BlockingIOError):
        os.write(write, b"\n" * LAUNCHER_STDIN_BYTES)
    return read, write


async def _accept(listener: trio.socket.SocketType, group: LaunchedGroup) -> trio.socket.SocketType:
    """Rank 0's connection; raises if the group exits before it connects."""
    while True:
        with trio.move_on_after(ACCEPT_POLL_S):
            sock, _ = await listener.accept()
            return sock
        if not group.is_alive():
            raise EngineProcessError(
                f"the engine's ranks exited (code {group.exitcode}) before rank 0 connected"
            )
