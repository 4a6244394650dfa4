"""MLX uses OpenBLAS on Linux x86-64: a 1024x1024 f32 matmul is far faster than without it.

Relative, not a timed threshold: the same matmul in two fresh interpreters, one importing MLX
through mlx_trio.engine (which loads OpenBLAS first) and one importing MLX alone.
"""

from __future__ import annotations

import platform
import subprocess
import sys

import pytest

BENCH = """
import sys, time
if sys.argv[1] == "mlx_trio":
    import mlx_trio.engine
import mlx.core as mx
a = mx.random.normal((1024, 1024)); mx.eval(a @ a)
best = float("inf")
for _ in range(5):
    t = time.perf_counter(); mx.eval(a @ a); best = min(best, time.perf_counter() - t)
print(best)
"""


def matmul_seconds(mode: str) -> float:
    out = subprocess.run(
        [sys.executable, "-c", BENCH, mode], check=True, capture_output=True, text=True
    )
    return float(out.stdout.strip())


@pytest.mark.skipif(
    sys.platform != "linux" or platform.machine() != "x86_64",
    reason="the reference-BLAS problem is specific to MLX's Linux x86-64 CPU wheel",
)
def test_matmul_through_mlx_trio_is_at_least_5x_faster_than_plain_mlx():
    from mlx_trio.engine._blas import openblas_path

    assert openblas_path() is not None, "cmeel-openblas (and libgfortran5) must be installed"
    fast = matmul_seconds("mlx_trio")
    slow = matmul_seconds("plain")
    assert slow / fast > 5, f"OpenBLAS {fast * 1e3:.1f} ms vs reference {slow * 1e3:.1f} ms"
