"""Make MLX's Linux CPU backend use OpenBLAS instead of the reference BLAS.

The ``mlx-cpu`` wheel links netlib's reference BLAS (about 5 GFLOP/s for f32 GEMM). Loading
``cmeel-openblas``'s ``libopenblas.so.0`` with ``RTLD_GLOBAL`` *before the first ``import mlx``*
makes MLX's ``cblas_sgemm`` resolve to OpenBLAS (about 200 GFLOP/s). See design/001-openblas.md.

``libopenblas.so.0`` needs ``libgfortran.so.5``. Where the system has none, the copy that a wheel
already bundles (``mlx_cpu.libs/``, ``numpy.libs/``: auditwheel renamed its SONAME) is loaded
from memory under the SONAME ``libgfortran.so.5``; the dynamic linker matches a library that is
already loaded by its SONAME, so OpenBLAS's ``NEEDED`` entry resolves to it. If that fails too,
one warning, and MLX keeps the reference BLAS.

This is the one place that does it: importing this module loads it, and every module of ours
that imports MLX imports this one first (above an ``# isort: split``), so whichever reaches MLX
first, OpenBLAS is there before it.
"""

from __future__ import annotations

import ctypes
import logging
import os
import platform
import sys
import sysconfig
from pathlib import Path

from . import _elf

logger = logging.getLogger(__name__)

GFORTRAN = "libgfortran.so.5"

_loaded: Path | None = None
_library: ctypes.CDLL | None = None  # the loaded OpenBLAS, for its thread count
_own_threads: int | None = None  # OpenBLAS's thread count as it loaded, before ours
_gfortran: Path | None = None
_memfds: list[int] = []  # kept open: a closed descriptor's /proc/self/fd/N could name another file


def _site_roots() -> list[Path]:
    paths = sysconfig.get_paths()
    roots = dict.fromkeys([paths["purelib"], paths["platlib"], *sys.path])
    return [Path(root) for root in roots if root]


def _candidates() -> list[Path]:
    return [root / "cmeel.prefix" / "lib" / "libopenblas.so.0" for root in _site_roots()]


def bundled_gfortran_copies() -> list[Path]:
    """The libgfortran copies that installed wheels bundle (``<dist>.libs/``), MLX's first."""
    found = {
        path.resolve() for root in _site_roots() for path in root.glob("*.libs/libgfortran-*.so.5*")
    }
    return sorted(found, key=lambda path: (not path.parent.name.startswith("mlx"), str(path)))


def _memfd_with(name: str, data: bytes) -> str:
    """A path to an anonymous in-memory file holding ``data``; its descriptor stays open."""
    fd = os.memfd_create(name)
    _memfds.append(fd)
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]
    return f"/proc/self/fd/{fd}"


def _load_as_gfortran(path: Path) -> None:
    """Load a bundled libgfortran so that it answers to ``NEEDED libgfortran.so.5``."""
    data = path.read_bytes()
    for name in _elf.needed(data):
        sibling = path.parent / name  # libquadmath-<hash>.so.0, renamed alongside it
        if sibling.is_file():
            ctypes.CDLL(str(sibling))
    ctypes.CDLL(_memfd_with(GFORTRAN, _elf.with_soname(data, GFORTRAN)))


def _provide_gfortran() -> Path:
    """Load the first bundled libgfortran that loads; raise OSError if none does."""
    global _gfortran
    errors = []
    for path in bundled_gfortran_copies():
        try:
            _load_as_gfortran(path)
        except (OSError, ValueError) as error:
            errors.append(f"{path}: {error}")
            continue
        _gfortran = path
        logger.debug("loaded %s as %s", path, GFORTRAN)
        return path
    raise OSError(f"no bundled {GFORTRAN} loads ({'; '.join(errors) or 'none installed'})")


def _load_openblas(path: Path) -> ctypes.CDLL:
    try:
        return ctypes.CDLL(str(path), mode=ctypes.RTLD_GLOBAL)
    except OSError as error:
        if GFORTRAN not in str(error):
            raise
    _provide_gfortran()
    return ctypes.CDLL(str(path), mode=ctypes.RTLD_GLOBAL)


def ensure_openblas() -> Path | None:
    """Load OpenBLAS globally once; return its path, or None where it does not apply or fails.

    Returns None on platforms other than Linux x86-64 (macOS uses Accelerate), when
    ``cmeel-openblas`` is not installed, and when it cannot be loaded (then with a warning: MLX
    works, with the reference BLAS). Logs a warning if MLX was imported first, since the binding
    is then already made.
    """
    global _loaded, _library, _own_threads
    if _loaded is not None:
        return _loaded
    if sys.platform != "linux" or platform.machine() != "x86_64":
        return None
    if "mlx.core" in sys.modules:
        logger.warning("mlx was imported before OpenBLAS was loaded; CPU GEMM stays slow")
    path = next((path for path in _candidates() if path.is_file()), None)
    if path is None:
        logger.warning("cmeel-openblas is not installed; MLX's CPU GEMM uses the reference BLAS")
        return None
    try:
        library = _load_openblas(path)
    except OSError as error:
        logger.warning("OpenBLAS did not load (%s); MLX's CPU GEMM uses the reference BLAS", error)
        return None
    _own_threads = library.openblas_get_num_threads()
    if "OPENBLAS_NUM_THREADS" not in os.environ:
        # One thread until the engine chooses (engine/threads.py): more are 20-30% faster on
        # an idle machine and 5-20x slower on a busy one (design/017), and a program that
        # imports us without running the engine gets the safe count.
        library.openblas_set_num_threads(1)
    _loaded, _library = path, library
    logger.debug("loaded OpenBLAS from %s", path)
    return path


def openblas_path() -> Path | None:
    """The OpenBLAS library this process loaded, if any."""
    return _loaded


def threads() -> int | None:
    """How many threads OpenBLAS runs a GEMM on now; None without OpenBLAS."""
    return _library.openblas_get_num_threads() if _library is not None else None


def own_threads() -> int | None:
    """OpenBLAS's thread count as it loaded (its ``OPENBLAS_NUM_THREADS``, else one per
    core), before this module pinned it; None without OpenBLAS."""
    return _own_threads


def set_threads(count: int) -> None:
    """Run OpenBLAS's GEMMs on ``count`` threads from now on (the whole process); nothing
    without OpenBLAS."""
    if _library is not None:
        _library.openblas_set_num_threads(count)


def gfortran_source() -> Path | None:
    """The bundled libgfortran loaded for OpenBLAS, if the system's was not found."""
    return _gfortran


ensure_openblas()
