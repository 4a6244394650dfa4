"""MLX uses OpenBLAS on Linux x86-64: a 1024x1024 f32 matmul is far faster than without it.

Relative, not a timed threshold: the same matmul in two fresh interpreters, one importing MLX
after mlx_trio.api (which loads OpenBLAS first) and one importing MLX alone. Where OpenBLAS
cannot load, the engine warns and MLX keeps the reference BLAS. tests/test_install.py proves the
load without the system's libgfortran.
"""

from __future__ import annotations

import logging
import platform
import subprocess
import sys
from pathlib import Path

import pytest

from mlx_trio.engine import _blas, _elf

LINUX_X86_64 = pytest.mark.skipif(
    sys.platform != "linux" or platform.machine() != "x86_64",
    reason="the reference-BLAS problem is specific to MLX's Linux x86-64 CPU wheel",
)

BENCH = """
import sys, time
if sys.argv[1] == "mlx_trio":
    import mlx_trio.api
import mlx.core as mx
a = mx.random.normal((1024, 1024)); mx.eval(a @ a)
best = float("inf")
for _ in range(5):
    t = time.perf_counter(); mx.eval(a @ a); best = min(best, time.perf_counter() - t)
print(best)
"""


def matmul_seconds(mode: str, python: str = sys.executable) -> float:
    """The best of five 1024x1024 f32 matmuls in a fresh interpreter; ``mode`` is ``mlx_trio``
    (MLX imported after mlx_trio.api) or ``plain``."""
    out = subprocess.run([python, "-c", BENCH, mode], check=True, capture_output=True, text=True)
    return float(out.stdout.strip())


@LINUX_X86_64
def test_matmul_through_mlx_trio_is_at_least_5x_faster_than_plain_mlx():
    assert _blas.openblas_path() is not None, "cmeel-openblas must be installed"
    fast = matmul_seconds("mlx_trio")
    slow = matmul_seconds("plain")
    assert slow / fast > 5, f"OpenBLAS {fast * 1e3:.1f} ms vs reference {slow * 1e3:.1f} ms"


def test_openblas_that_does_not_load_leaves_a_warning_not_a_crash(monkeypatch, caplog):
    def fail(path):
        raise OSError("libgfortran.so.5: cannot open shared object file")

    monkeypatch.setattr(_blas, "_loaded", None)
    monkeypatch.setattr(_blas, "_load_openblas", fail)
    monkeypatch.setattr(sys, "platform", "linux")
    monkeypatch.setattr(platform, "machine", lambda: "x86_64")
    # Any file that exists stands for the library; the load itself is what fails.
    monkeypatch.setattr(_blas, "_candidates", lambda: [Path(_blas.__file__)])
    with caplog.at_level(logging.WARNING, logger=_blas.__name__):
        assert _blas.ensure_openblas() is None
    assert "OpenBLAS did not load (libgfortran.so.5" in caplog.text
    assert "reference BLAS" in caplog.text


def test_no_loadable_bundled_libgfortran_is_an_os_error(monkeypatch):
    monkeypatch.setattr(_blas, "bundled_gfortran_copies", lambda: [])
    with pytest.raises(OSError, match=r"no bundled libgfortran\.so\.5 loads"):
        _blas._provide_gfortran()


@pytest.fixture(scope="module")
def bundled_gfortran() -> bytes:
    copies = _blas.bundled_gfortran_copies()
    if not copies:
        pytest.skip("no installed wheel bundles libgfortran (mlx-cpu does on Linux x86-64)")
    return copies[0].read_bytes()


def test_renaming_the_soname_rewrites_only_the_soname(bundled_gfortran):
    renamed = _elf.with_soname(bundled_gfortran, "libgfortran.so.5")
    assert _elf.soname(renamed) == "libgfortran.so.5"
    assert _elf.needed(renamed) == _elf.needed(bundled_gfortran)
    table = _elf.dynamic(bundled_gfortran)
    start = table.strtab + table.soname
    end = bundled_gfortran.index(b"\0", start)
    assert len(renamed) == len(bundled_gfortran)
    assert renamed[:start] == bundled_gfortran[:start]
    assert renamed[end + 1 :] == bundled_gfortran[end + 1 :]


def test_a_soname_longer_than_the_old_one_is_refused(bundled_gfortran):
    with pytest.raises(ValueError, match="longer than the SONAME"):
        _elf.with_soname(bundled_gfortran, "lib" + "x" * 200 + ".so")


def test_a_file_that_is_not_elf_is_refused():
    with pytest.raises(ValueError, match="not a 64-bit little-endian ELF"):
        _elf.needed(b"#!/bin/sh\n")
