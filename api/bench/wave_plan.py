"""The GPU run as data: its systems and what one run measures (no MLX here).

The command, the runner and the report all read this, and the report must work where no model
can load, so nothing here imports MLX. The systems are names only: every one of them runs in
the harness's own process on one model object (``waves``), unlike the suite's (``systems``),
each of which owns a process.
"""

from __future__ import annotations

from dataclasses import dataclass

# Keys for --systems, and the labels the GPU run's JSON and report use, in the table's order.
WAVE_SYSTEMS = {
    "generate_step": "raw generate_step",
    "batch": "raw BatchGenerator",
    "inprocess": "mlx-trio in-process",
    "one-step": "in-process, 1 step a call",
    "serial": "mlx-trio serial",
    "http": "mlx-trio HTTP",
    "proc": "in-process, engine process",
    "http-proc": "HTTP, engine process",
}
WAVE_LABELS = tuple(WAVE_SYSTEMS.values())
SINGLE_ONLY = {"raw generate_step", "mlx-trio serial"}
ONE_STEP = "in-process, 1 step a call"
INPROCESS = ("mlx-trio in-process", ONE_STEP, "mlx-trio serial", "in-process, engine process")
HTTP = ("mlx-trio HTTP", "HTTP, engine process")
ENGINE_PROCESS = ("in-process, engine process", "HTTP, engine process")
# The runtime's systems whose waves are paired with raw's.
PAIRED = ("mlx-trio in-process", "mlx-trio HTTP", *ENGINE_PROCESS)
MODELS = ("bf16", "q4")
LEVELS = (1, 8, 32, 128, 256)
QUICK_LEVELS = (1, 4, 8)
QUICK_MAX_TOKENS = 16


@dataclass(frozen=True, slots=True)
class WavePlan:
    """What a GPU run measures: which models (of ``MODELS``) and systems (labels), at which
    concurrency levels, with prompts of ``prompt_tokens`` ids and ``max_tokens`` new tokens;
    at most ``rounds`` timed rounds within ``budget_s`` (shared out among the models), single
    streams ``single_repeats`` times a round; ``quick``: the small model (``models``)."""

    models: tuple[str, ...] = MODELS
    systems: tuple[str, ...] = WAVE_LABELS
    concurrency: tuple[int, ...] = LEVELS
    prompt_tokens: int = 32
    max_tokens: int = 128
    rounds: int = 3
    single_repeats: int = 3
    budget_s: float = 420.0
    quick: bool = False

    @property
    def max_batch(self) -> int:
        """Rows in a batch: the most streams measured, and at least 2, since a runtime with
        ``max_batch`` 1 runs every request on the serial lane (``--concurrency 1`` would measure
        that instead of the batch lane's solo row)."""
        return max(2, *self.concurrency)
