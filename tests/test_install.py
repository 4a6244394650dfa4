"""Without the system's libgfortran.so.5, importing mlx_trio loads OpenBLAS and GEMM is fast.

The issue: ``pip install mlx-trio`` on a Linux without Debian's ``libgfortran5`` crashed at import.
Each system copy is hidden in a private mount namespace (``unshare --mount``, which needs root):
an empty file is bind-mounted over it, and the child first checks that ``libgfortran.so.5`` no
longer loads. Then it imports ``mlx_trio.api`` and times a matmul, compared with plain MLX's
reference BLAS in the same environment. Once in this checkout's environment, once in a fresh venv
with the checkout pip-installed (not editable), as a user gets it.
"""

from __future__ import annotations

import json
import os
import platform
import shlex
import shutil
import subprocess
import sys
import venv
from pathlib import Path

import pytest

from tests.test_blas import matmul_seconds

ROOT = Path(__file__).parent.parent

pytestmark = pytest.mark.skipif(
    sys.platform != "linux" or platform.machine() != "x86_64",
    reason="OpenBLAS from cmeel-openblas is loaded on Linux x86-64 only",
)

CHILD = """
import ctypes, json, sys, time
try:
    ctypes.CDLL("libgfortran.so.5")
except OSError:
    pass
else:
    sys.exit("the system's libgfortran.so.5 is still loadable: the test hides nothing")
import mlx_trio.api
from mlx_trio.engine._blas import gfortran_source, openblas_path
import mlx.core as mx
a = mx.random.normal((1024, 1024)); mx.eval(a @ a)
best = float("inf")
for _ in range(5):
    t = time.perf_counter(); mx.eval(a @ a); best = min(best, time.perf_counter() - t)
print(json.dumps({"openblas": str(openblas_path()), "gfortran": str(gfortran_source()),
                  "seconds": best}))
"""


def system_gfortran() -> list[str]:
    """The files the dynamic linker would load for ``libgfortran.so.5``, per its cache."""
    if shutil.which("ldconfig") is None:
        return []  # the child still checks that libgfortran.so.5 does not load
    cache = subprocess.run(["ldconfig", "-p"], capture_output=True, text=True).stdout
    paths = {
        str(Path(line.rsplit("=>", 1)[1].strip()).resolve())
        for line in cache.splitlines()
        if line.strip().startswith("libgfortran.so.5 ")
    }
    return sorted(paths)


def without_system_gfortran(argv: list[str]) -> list[str]:
    """``argv`` run in a private mount namespace where the system's libgfortran is empty."""
    mounts = [f"mount --bind /dev/null {shlex.quote(path)}" for path in system_gfortran()]
    return ["unshare", "--mount", "sh", "-c", " && ".join([*mounts, f"exec {shlex.join(argv)}"])]


@pytest.fixture(scope="module")
def namespace() -> None:
    """Skip where a private mount namespace is not allowed, except on CI, which runs as root."""
    if shutil.which("unshare") is None:
        reason = "unshare (util-linux) is not installed"
    elif (probe := subprocess.run(["unshare", "--mount", "true"], capture_output=True)).returncode:
        reason = f"unshare --mount is not permitted here ({probe.stderr.decode().strip()})"
    else:
        return
    if os.environ.get("CI"):
        pytest.fail(f"CI must run the hidden-libgfortran tests: {reason}")
    pytest.skip(reason)


def run_hidden(python: str) -> dict[str, str | float]:
    result = subprocess.run(
        without_system_gfortran([python, "-c", CHILD]), capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr
    assert "reference BLAS" not in result.stderr, result.stderr
    return json.loads(result.stdout.strip().splitlines()[-1])


def assert_fast_openblas(report: dict[str, str | float], python: str, prefix: str) -> None:
    assert report["openblas"].startswith(prefix), report
    assert report["openblas"].endswith("libopenblas.so.0"), report
    assert ".libs/libgfortran-" in report["gfortran"], report  # a wheel's bundled copy
    reference = matmul_seconds("plain", python)
    assert reference / report["seconds"] > 5, f"{report['seconds']:.4f} s vs {reference:.4f} s"


def test_import_loads_openblas_without_the_system_libgfortran(namespace):
    assert_fast_openblas(run_hidden(sys.executable), sys.executable, sys.prefix)


@pytest.fixture(scope="module")
def fresh_venv(tmp_path_factory, namespace) -> str:
    """A new venv with this checkout pip-installed from a copy (no build/ left in the tree)."""
    base = tmp_path_factory.mktemp("install")
    source = base / "src"
    source.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(ROOT / name, source)
    for name in ("actors", "engine", "api"):
        shutil.copytree(ROOT / name, source / name, ignore=shutil.ignore_patterns("__pycache__"))
    venv.create(base / "venv", with_pip=True)
    python = str(base / "venv" / "bin" / "python")
    # No byte-compiling of the dependencies at install time (transformers alone is thousands of
    # modules): Python compiles what the child imports as it imports it, so the import and the
    # GEMM it checks are the same.
    pip = [python, "-m", "pip", "install", "-q", "--disable-pip-version-check", "--no-compile"]
    pip.append(str(source))
    result = subprocess.run(pip, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stderr
    return python


@pytest.mark.install
def test_a_fresh_pip_install_runs_fast_gemm_without_the_system_libgfortran(fresh_venv):
    prefix = str(Path(fresh_venv).parent.parent)
    assert_fast_openblas(run_hidden(fresh_venv), fresh_venv, prefix)
