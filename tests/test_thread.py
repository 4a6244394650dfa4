"""The engine thread runs every job on one thread, in order, without blocking Trio."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import pytest
import trio

from mlx_trio.actors.engine_port.thread import EngineThread
from mlx_trio.engine.errors import EngineUnavailableError


async def test_jobs_run_in_order_on_one_thread_and_errors_propagate():
    with EngineThread() as engine_thread:
        idents = [await engine_thread.run(threading.get_ident) for _ in range(5)]
        assert set(idents) == {engine_thread.ident}
        assert engine_thread.ident != threading.get_ident()
        with pytest.raises(ZeroDivisionError):
            await engine_thread.run(lambda: 1 / 0)
        assert await engine_thread.run(lambda a, b: a + b, 2, 3) == 5


async def test_event_loop_keeps_ticking_while_a_job_blocks():
    ticks = 0

    async def ticker():
        nonlocal ticks
        while True:
            await trio.sleep(0.005)
            ticks += 1

    with EngineThread() as engine_thread:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(ticker)
            await engine_thread.run(time.sleep, 0.3)
            nursery.cancel_scope.cancel()
    assert ticks >= 10


async def test_cancelled_caller_does_not_stop_the_job_and_the_thread_goes_on():
    ran = threading.Event()

    def slow():
        time.sleep(0.1)
        ran.set()
        return "done"

    with EngineThread() as engine_thread:
        with trio.move_on_after(0.01) as scope:
            await engine_thread.run(slow)
        assert scope.cancelled_caught
        assert await engine_thread.run(lambda: "next") == "next"
        assert ran.is_set()


def test_call_blocks_from_plain_threads_and_close_refuses_new_jobs():
    engine_thread = EngineThread()
    with engine_thread:
        assert engine_thread.call(threading.get_ident) == engine_thread.ident
    with pytest.raises(EngineUnavailableError, match=r"^the engine thread is closed$"):
        engine_thread.call(lambda: None)


async def test_idle_work_runs_between_jobs_and_gives_way_to_the_next_job():
    pieces = 0
    piece_done = threading.Event()

    def idle() -> bool:
        nonlocal pieces
        time.sleep(0.001)
        pieces += 1
        piece_done.set()
        return pieces < 5_000  # five seconds' worth, unless jobs cut in

    with EngineThread() as engine_thread:
        engine_thread.add_idle_work(idle)
        await engine_thread.run(lambda: None)  # the thread looks for idle work after a job
        await trio.to_thread.run_sync(piece_done.wait)
        pieces_then = await engine_thread.run(lambda: pieces)
        assert 1 <= pieces_then < 5_000


async def test_idle_work_that_raises_is_logged_and_the_thread_serves_jobs(caplog):
    tried = threading.Event()

    def idle() -> bool:
        tried.set()
        raise ValueError("idle broke")

    with EngineThread() as engine_thread:
        engine_thread.add_idle_work(idle)
        assert await engine_thread.run(lambda: "first") == "first"
        # The thread runs idle work once no job waits: after the first job, before the next.
        assert await trio.to_thread.run_sync(tried.wait, 10)
        assert await engine_thread.run(lambda: "second") == "second"
    assert "idle work failed" in caplog.text


async def test_idle_work_of_every_engine_on_the_thread_runs():
    # Two engines share one thread (the GPU benchmark's in-process runtime and HTTP server):
    # each steps its own batch ahead, the second's work does not replace the first's.
    pieces = {"first": 0, "second": 0}
    both_done = threading.Event()

    def work_of(name: str) -> Callable[[], bool]:
        def work() -> bool:
            if pieces[name] == 3:
                if all(n == 3 for n in pieces.values()):
                    both_done.set()
                return False
            pieces[name] += 1
            return True

        return work

    with EngineThread() as engine_thread:
        engine_thread.add_idle_work(work_of("first"))
        engine_thread.add_idle_work(work_of("second"))
        await engine_thread.run(lambda: None)  # the thread looks for idle work after a job
        await trio.to_thread.run_sync(both_done.wait, 5.0)
        assert await engine_thread.run(lambda: dict(pieces)) == {"first": 3, "second": 3}
