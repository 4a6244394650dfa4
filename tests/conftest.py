from __future__ import annotations

import pytest

import mlx_trio.engine._blas  # noqa: F401  (loads OpenBLAS before anything imports MLX)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """End-to-end and install tests are slow by nature: ``-m "not slow"`` leaves them out."""
    for item in items:
        if item.get_closest_marker("e2e") or item.get_closest_marker("install"):
            item.add_marker(pytest.mark.slow)


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
