"""The synchronous engine: model loading, sampling, text streaming and generation over mlx-lm.

Importing this package loads nothing. Its folders: ``model/`` (what a model is and where it
comes from), ``batch/`` (the batch path), ``ranks/`` (mx.distributed), ``vocabulary/`` (text in
and out). The plain types every side shares (``params``, ``outputs``, ``errors``, and
``vocabulary``'s ``prompt``, ``stops``, ``sampling_defaults``) import no MLX; each module
that imports MLX imports ``_blas`` first, which loads OpenBLAS before MLX binds its BLAS.
Only the engine thread or the engine process calls into MLX (``core``, ``calls``).
"""
