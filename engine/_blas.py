"""Make MLX's Linux CPU backend use OpenBLAS instead of the reference BLAS.

The ``mlx-cpu`` wheel links netlib's reference BLAS (about 5 GFLOP/s for f32 GEMM). Loading
``cmeel-openblas``'s ``libopenblas.so.0`` with ``RTLD_GLOBAL`` *before the first ``import mlx``*
makes MLX's ``cblas_sgemm`` resolve to OpenBLAS (about 200 GFLOP/s). See design/001-openblas.md.

This is the one place that does it; ``mlx_trio.engine`` calls :func:`ensure_openblas` on import,
so every entry point that can reach MLX goes through it.
"""

from __future__ import annotations

import ctypes
import logging
import os
import platform
import sys
import sysconfig
from pathlib import Path

logger = logging.getLogger(__name__)

_loaded: Path | None = None


def _candidates() -> list[Path]:
    roots = {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"], *sys.path}
    return [Path(root) / "cmeel.prefix" / "lib" / "libopenblas.so.0" for root in roots if root]


def ensure_openblas() -> Path | None:
    """Load OpenBLAS globally once; return its path, or None where it does not apply.

    Returns None on platforms other than Linux x86-64 (macOS uses Accelerate) and when
    ``cmeel-openblas`` is not installed. Logs a warning if MLX was imported first, since the
    binding is then already made.
    """
    global _loaded
    if _loaded is not None:
        return _loaded
    if sys.platform != "linux" or platform.machine() != "x86_64":
        return None
    if "mlx.core" in sys.modules:
        logger.warning("mlx was imported before OpenBLAS was loaded; CPU GEMM stays slow")
    for path in _candidates():
        if path.is_file():
            library = ctypes.CDLL(str(path), mode=ctypes.RTLD_GLOBAL)
            if "OPENBLAS_NUM_THREADS" not in os.environ:
                # MLX runs its own CPU threads; OpenBLAS's threads fight them and make the
                # transformer-sized GEMMs 10-20x slower (design/001-openblas.md).
                library.openblas_set_num_threads(1)
            _loaded = path
            logger.debug("loaded OpenBLAS from %s", path)
            return path
    logger.warning("cmeel-openblas is not installed; MLX's CPU GEMM uses the reference BLAS")
    return None


def openblas_path() -> Path | None:
    """The OpenBLAS library this process loaded, if any."""
    return _loaded
