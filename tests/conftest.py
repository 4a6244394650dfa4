from __future__ import annotations

import pytest

import mlx_trio.engine  # noqa: F401  (loads OpenBLAS before anything imports MLX)


@pytest.fixture(scope="session")
def tiny_engine():
    from mlx_trio.engine.generate import Engine
    from tests.tiny import make_loaded

    return Engine(make_loaded(), prefill_step_size=16)
