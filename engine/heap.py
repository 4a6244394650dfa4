"""The garbage collector and a long-lived process's startup heap (no MLX here: the runtime's
own process imports this too)."""

from __future__ import annotations

import gc
import logging
import time

logger = logging.getLogger(__name__)


def freeze_heap(what: str) -> int:
    """Collect garbage once, then move every object alive now out of the garbage collector's
    reach (``gc.freeze``); logs it as ``what`` and returns how many. Once the model is
    loaded and warmed up: those objects live as long as the process, and a full collection
    walks them all, stalling whatever the process does meanwhile (an engine process's steps:
    230-260 ms a collection of the 8B shape's engine process on the H200, design/030; the
    event loop's streams, design/024). Objects freed by reference counting still are; only a
    reference cycle among the frozen ones would never be collected. vLLM's server does the
    same after its warm-up."""
    start = time.perf_counter()
    gc.collect()
    collected_s = time.perf_counter() - start
    gc.freeze()
    frozen = gc.get_freeze_count()
    logger.info(
        "%s: %d objects moved out of the garbage collector's way (a full collection took %.0f ms)",
        what,
        frozen,
        collected_s * 1e3,
    )
    return frozen
