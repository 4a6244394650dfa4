"""A kernel of our own is checked before it is used: its largest difference from a float32
reference against MLX's own. One that is further off, or that the MLX at hand cannot build
or run, is logged and left out, so it costs speed, never a request (``gemm.sound``,
``batch/decode_attention.sound``)."""

from __future__ import annotations

import logging
from collections.abc import Callable

log = logging.getLogger(__name__)


def close(ours: float, theirs: float) -> bool:
    """Whether a kernel's error is within twice MLX's plus a bf16 step."""
    return ours <= 2 * theirs + 0.01


def passes(kernel: str, measure: Callable[[], tuple[float, float]]) -> bool:
    """Whether ``kernel`` (its name, as logged) is :func:`close` on ``measure``'s errors (its
    own, MLX's); a build or run that raises MLX's errors fails the check."""
    try:
        ours, theirs = measure()
    except (RuntimeError, ValueError) as exc:  # MLX's errors for a kernel it cannot build
        log.warning("%s failed its check (%s): not used", kernel, exc)
        return False
    if not close(ours, theirs):
        log.warning("%s is off by %.4f (MLX: %.4f): not used", kernel, ours, theirs)
        return False
    log.info("%s passed its check (off by %.4f, MLX %.4f)", kernel, ours, theirs)
    return True
