"""The synchronous engine: model loading, sampling, text streaming and generation over mlx-lm.

Importing this package loads nothing. The plain types every side shares (``params``,
``outputs``, ``errors``, ``prompt``, ``stops``, ``sampling_defaults``) import no MLX; each module
that imports MLX imports ``_blas`` first, which loads OpenBLAS before MLX binds its BLAS.
Only the engine thread or the engine process calls into MLX (``core``, ``calls``).
"""
