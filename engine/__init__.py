"""The synchronous engine: model loading, sampling, text streaming and generation over mlx-lm.

Importing this package loads OpenBLAS before anything imports MLX (see ``_blas``).
Only the engine thread (``mlx_trio.engine.thread``) calls into MLX.
"""

from mlx_trio.engine._blas import ensure_openblas

ensure_openblas()
