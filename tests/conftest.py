from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

import pytest

import mlx_trio.engine._blas  # noqa: F401  (loads OpenBLAS before anything imports MLX)

if TYPE_CHECKING:
    from tests.server_thread import ServerThread


@pytest.hookimpl(wrapper=True)
def pytest_collection_modifyitems(items: list[pytest.Item]):
    """End-to-end and install tests are slow by nature: ``-m "not slow"`` leaves them out (they
    are marked before the other implementations, the ``-m`` selection among them, run).

    Then, on an xdist worker, the files with a slow test come first, in their order: ``--dist
    loadfile`` hands out files in collection order (``--no-loadscope-reorder``, in pyproject),
    so the long ones start at once and the quick ones fill in beside them at the end."""
    for item in items:
        if item.get_closest_marker("e2e") or item.get_closest_marker("install"):
            item.add_marker(pytest.mark.slow)
    yield
    if os.environ.get("PYTEST_XDIST_WORKER"):
        slow_files = {item.path for item in items if item.get_closest_marker("slow")}
        items.sort(key=lambda item: item.path not in slow_files)  # stable


@pytest.fixture(scope="session")
def tiny_engine():
    from mlx_trio.engine.generate import Engine
    from tests.tiny import make_loaded

    return Engine(make_loaded(), prefill_step_size=16)


@pytest.fixture
def client(server):
    """An httpx client of the module's ``server`` fixture."""
    import httpx

    with httpx.Client(base_url=server.url, timeout=30) as http:
        yield http


# For a costly test whose point is not the transport: it runs on one of the module's two
# servers (the other's run would show nothing new and cost as much).
ON_ENGINE_THREAD = pytest.mark.parametrize(
    "default_model_server", [False], indirect=True, ids=["engine thread"]
)
ON_ENGINE_PROCESS = pytest.mark.parametrize(
    "default_model_server", [True], indirect=True, ids=["engine process"]
)


@pytest.fixture(scope="session")
def default_model_servers() -> Iterator[Callable[[bool], ServerThread]]:
    """The real server on the embedded default model over the engine thread (False) or the
    engine process (True): each started on first use and kept for the worker's session, so the
    modules that test the API on it share two servers instead of starting two each."""
    from mlx_trio.actors.config import RuntimeConfig
    from mlx_trio.api.server import ServeOptions
    from mlx_trio.engine.options import EngineOptions
    from tests.server_thread import ServerThread

    with contextlib.ExitStack() as stack:
        servers: dict[bool, ServerThread] = {}

        def server(engine_process: bool) -> ServerThread:
            if engine_process not in servers:
                options = ServeOptions(
                    engine=EngineOptions(engine_process=engine_process),
                    runtime=RuntimeConfig(max_batch=8),
                )
                running = stack.enter_context(ServerThread(options))
                running.wait_healthy()
                servers[engine_process] = running
            return servers[engine_process]

        yield server


@pytest.fixture(scope="module", params=[False, True], ids=["engine thread", "engine process"])
def default_model_server(
    request: pytest.FixtureRequest, default_model_servers: Callable[[bool], ServerThread]
) -> ServerThread:
    """The real server on the embedded default model, healthy, over the engine thread and
    the engine process in turn (one of each a module; ``default_model_servers``')."""
    return default_model_servers(request.param)
