"""What the engine's warm-up waits on while the kernel primers (``engine/primers.py``) compile:
which primer's kernels each warm-up run needs (:func:`group_of`), and whether that primer has
ended (:class:`PrimersDone`)."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

SAMPLER = "sampler"
# The model's groups: every warm-up run but the sampled lane's belongs to one (``group_of``),
# each a chain of kernels that compile one after another (a primer per chain).
MODEL_GROUPS = ("chat", "long", "burst")
# A quantized model's 1-row prefills, one group each: each selects a tile of MLX's 4-bit matmul,
# which compiles for about 38 s (design/008).
TILE_GROUPS = ("tile-17", "tile-33")
POLL_S = 0.05


def group_of(run: Any, *, quantized: bool) -> str:
    """The primer group of a warm-up run (``warmup.WarmupRun``): the sampled lane's kernels are
    the row sampler's (``sampler``, no model needed); then what a chat burst uses (serial,
    batches, a group of chat prompts, prompt-cache hits), long prompts prefilled together, or
    a burst of long prompts and those prefilled alone."""
    from .warmup import CHAT_PROMPT

    if run.lane == "sampled":
        return SAMPLER
    if run.lane == "prefill" and run.rows == 1 and quantized:
        tile = f"tile-{run.prompt_tokens}"
        if tile in TILE_GROUPS:
            return tile
    if run.lane in ("serial", "image", "batch", "cached"):
        return "chat"
    if run.lane == "prefill" and run.prompt_tokens == CHAT_PROMPT:
        return "chat"
    if run.lane in ("burst", "alone"):
        return "burst"
    return "long"


@dataclass(frozen=True, slots=True)
class PrimersDone:
    """What the engine's warm-up waits on: a marker per primer in ``directory``, written once
    that primer has ended (published, failed or died), and one per warm-up run a model group's
    primer has run and published the kernels of (:meth:`mark`). Picklable, for the engine's
    process and the primers'."""

    directory: Path
    groups: tuple[str, ...]
    deadline: float  # time.time() past which nothing waits for them: one that hangs is left
    first: tuple[str, ...] = ()  # the primers whose kernels every run needs (probes, forward)

    def wait(self, groups: Iterable[str] | None = None) -> float:
        """Block until the primers of ``groups`` (None: all; a group not started is not
        waited for) have ended, or the deadline; returns the seconds waited."""
        start = time.time()
        wanted = list(dict.fromkeys(self.groups if groups is None else groups))
        while not all(self.ended(group) for group in wanted):
            time.sleep(POLL_S)
        waited = time.time() - start
        self._waited(waited, wanted)
        return waited

    def _waited(self, seconds: float, groups: list[str]) -> None:
        late = [g for g in groups if g in self.groups and not self._marker(g).exists()]
        if late and self._past():
            logger.warning("kernel primers %s still running; not waited for", late)
        elif seconds > POLL_S:
            logger.info("waited %.1f s for kernel primers %s", seconds, ", ".join(groups))

    def ended(self, group: str) -> bool:
        """Whether nothing need wait for ``group``'s primer: it has ended, it never started, or
        the deadline is past."""
        return group not in self.groups or self._marker(group).exists() or self._past()

    def mark(self, group: str, run: Any) -> None:
        """Note that ``group``'s primer has run ``run`` (``warmup.WarmupRun``) and published
        what it compiled."""
        self._marker(group, run).touch()

    def ran(self, group: str, run: Any) -> bool:
        """Whether ``run``'s kernels are on disk as far as ``group``'s primer knows: it has run
        ``run`` already, or it has ended."""
        return self._marker(group, run).exists() or self.ended(group)

    def _marker(self, group: str, run: Any = None) -> Path:
        if run is None:
            return self.directory / f"{group}.done"
        return self.directory / f"{group}.{run.lane}-{run.rows}-{run.prompt_tokens}.run"

    def _past(self) -> bool:
        return time.time() >= self.deadline

    def chooser(self, quantized: bool) -> Callable[[Sequence[Any]], int]:
        """What the engine's warm-up calls for its next run (``warmup.WarmupRun``): the index
        of the first run left whose kernels are on disk, waiting until there is one. So the
        engine runs each shape right behind its group's primer (which runs it over one layer),
        once the kernels every run needs (:attr:`first`) are there. The sampled lane's run also
        needs the model's own kernels: it waits for the sampler's primer and the chat primer."""

        def needs(run: Any) -> list[str]:
            group = group_of(run, quantized=quantized)
            return [*self.first, group, *(["chat"] if group == SAMPLER else [])]

        def choose(runs: Sequence[Any]) -> int:
            start = time.time()
            while True:
                for index, run in enumerate(runs):
                    if all(self.ran(group, run) for group in needs(run)):
                        self._waited(time.time() - start, needs(run))
                        return index
                time.sleep(POLL_S)

        return choose
