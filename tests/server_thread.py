"""Run ``mlx-trio serve`` (the real Hypercorn server) on an ephemeral loopback port in a thread."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable
from dataclasses import replace

import httpx
import openai
import pytest
import trio

from mlx_trio.actors.config import RuntimeConfig
from mlx_trio.actors.port import EnginePort
from mlx_trio.actors.testing.scripted import Script, ScriptedEngine
from mlx_trio.api.http_state import HttpSettings
from mlx_trio.api.server import ServeOptions, serve


class ServerThread:
    """``with ServerThread(options, engine=...) as server:`` then use ``server.url``."""

    def __init__(self, options: ServeOptions | None = None, *, engine: EnginePort | None = None):
        base = options or ServeOptions()
        self.options = replace(base, host="127.0.0.1", port=0, handle_signals=False)
        self.engine = engine
        self.url = ""
        self._ready = threading.Event()
        self._token: trio.lowlevel.TrioToken | None = None
        self._shutdown: trio.Event | None = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._main, name="mlx-trio-test-server", daemon=True)

    def _main(self) -> None:
        try:
            trio.run(self._serve)
        except BaseException as exc:  # surfaced in __enter__ / __exit__
            self._error = exc
            self._ready.set()

    async def _serve(self) -> None:
        self._token = trio.lowlevel.current_trio_token()
        self._shutdown = trio.Event()
        async with trio.open_nursery() as nursery:
            self.url = await nursery.start(
                lambda task_status: serve(
                    self.options,
                    engine=self.engine,
                    shutdown=self._shutdown,
                    task_status=task_status,
                )
            )
            self._ready.set()

    def __enter__(self) -> ServerThread:
        self._thread.start()
        self._ready.wait(timeout=120)
        if self._error is not None:
            raise RuntimeError("the test server failed to start") from self._error
        return self

    def wait_healthy(self, timeout_s: float = 120.0) -> None:
        """Wait until ``/health`` says 200 (the model loaded)."""
        deadline = time.monotonic() + timeout_s
        while httpx.get(f"{self.url}/health").status_code != 200:
            assert time.monotonic() < deadline, "the model did not load"
            time.sleep(0.1)

    def __exit__(self, *exc: object) -> None:
        if self._token is not None and self._shutdown is not None:
            with contextlib.suppress(trio.RunFinishedError):
                trio.from_thread.run_sync(self._shutdown.set, trio_token=self._token)
        self._thread.join(timeout=60)
        assert not self._thread.is_alive(), "the test server did not stop"
        if self._error is not None:
            raise RuntimeError("the test server failed") from self._error


def scripted_server(runtime: RuntimeConfig, http: HttpSettings) -> ServerThread:
    """The real server over a fast scripted engine (2 ms a step), for the HTTP edge's tests."""
    options = ServeOptions(runtime=runtime, http=http)
    return ServerThread(options, engine=ScriptedEngine(Script(step_s=0.002)))


def model_id(server: ServerThread) -> str:
    """The model id a running server serves (its ``GET /v1/models``)."""
    return httpx.get(f"{server.url}/v1/models").json()["data"][0]["id"]


def wait_for(condition: Callable[[], bool], timeout_s: float, what: str) -> float:
    """Seconds until ``condition`` held; fails the test after ``timeout_s``."""
    start = time.monotonic()
    while not condition():
        if time.monotonic() - start > timeout_s:
            pytest.fail(f"{what} did not happen within {timeout_s} s")
        time.sleep(0.02)
    return time.monotonic() - start


def health(url: str) -> int:
    """The status code of a server's ``/health``."""
    return httpx.get(f"{url}/health", timeout=5).status_code


def ask(client: openai.OpenAI, model: str, question: str, max_tokens: int) -> str:
    """The text of ``model``'s greedy chat reply to ``question``."""
    answer = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": question}],
        max_tokens=max_tokens,
        temperature=0,
    )
    return answer.choices[0].message.content or ""
