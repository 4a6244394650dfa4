"""How much prompt an iteration prepares beside the rows it decodes: the token budget.

The seed's scheduling loop (``driveExecutionGroup``) has two budgets, and so does the batch
engine:

- **preparation**: prompts join the rows being prepared (prefilled) while the prompt tokens
  those rows have left stay within ``max_preparation_tokens``, so a burst of long prompts is
  prefilled together in large batched chunks instead of one by one, and a burst of short ones
  all at once; one prompt always may, however long.
- **iteration**: each iteration (one batch step) reserves one token for every decoding row and
  fills the rest of ``max_iteration_tokens`` with prompt chunks shared evenly by the rows being
  prepared, so decoding rows keep their rhythm while a long prompt is prefilled beside them.

Plain arithmetic, no MLX: the engine's batch (``engine/batch/batch_rows.py``) applies it to mlx-lm's
``BatchGenerator`` before each step, and the scripted engine (``actors/testing/scripted.py``)
steps by it, so the actors' tests see the same rules.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ..errors import InvalidRequestError

# A chunk smaller than this costs a step's fixed overhead for too few tokens.
MIN_CHUNK = 16
# A shared chunk is rounded down to a multiple of max_chunk / CHUNK_GRANULES, so that steps
# beside a changing number of decoding rows repeat a few shapes (8,164 tokens left for 16 rows
# are chunks of 448, not 510, 509, 508 ...): MLX builds kernels per shape on a GPU.
CHUNK_GRANULES = 32


@dataclass(frozen=True, slots=True)
class TokenBudget:
    """The two budgets (see the module docstring); ``max_chunk`` bounds one row's chunk (the
    model's attention over a chunk grows with it; mlx-lm prefills 2,048 at most)."""

    max_preparation_tokens: int = 2048
    max_iteration_tokens: int = 512
    max_chunk: int = 2048

    def __post_init__(self) -> None:
        for name in ("max_preparation_tokens", "max_iteration_tokens", "max_chunk"):
            if (value := getattr(self, name)) < 1:
                raise InvalidRequestError(f"{name} must be at least 1, got {value}", param=name)

    def prompts_to_prepare(self, preparing: Sequence[int], waiting: Sequence[int]) -> int:
        """How many of the ``waiting`` prompts (their token counts, first come first) join the
        rows being prepared (``preparing``: the tokens each has left): in order, while the
        total stays within the preparation budget; the first always may when none is being
        prepared. In order, so a long prompt is never overtaken for good by short ones."""
        total = sum(preparing)
        joined = 0
        for tokens in waiting:
            if total + tokens > self.max_preparation_tokens and (joined or preparing):
                break
            total += tokens
            joined += 1
        return joined

    def chunk(self, decoding: int, preparing: int) -> int:
        """Prompt tokens for each of ``preparing`` rows in the next iteration, beside
        ``decoding`` rows that take one token each: the iteration budget's rest, shared evenly
        and rounded down to a granule (``CHUNK_GRANULES``), at least ``MIN_CHUNK`` and at most
        ``max_chunk``. With no row decoding there is no
        rhythm to keep: every row takes ``max_chunk`` (the preparation budget bounds them)."""
        if preparing <= 0 or decoding == 0:
            return self.max_chunk
        share = (self.max_iteration_tokens - decoding) // preparing
        granule = max(1, self.max_chunk // CHUNK_GRANULES)
        return max(MIN_CHUNK, min(self.max_chunk, share - share % granule))


# Chosen by measurement against the batch's earlier fixed 8 prompts x 256 tokens: long prompts
# reach their first tokens sooner and decoding rows beside them wait less (design/024, 017).
DEVICE_BUDGETS = {
    "cpu": TokenBudget(max_preparation_tokens=1024, max_iteration_tokens=256, max_chunk=256),
    "gpu": TokenBudget(max_preparation_tokens=32768, max_iteration_tokens=8192, max_chunk=2048),
}


def default_budget(
    device: str, *, preparation: int | None = None, iteration: int | None = None
) -> TokenBudget:
    """The budget for ``device`` (``cpu`` or ``gpu``), with either limit overridden."""
    budget = DEVICE_BUDGETS["gpu" if device == "gpu" else "cpu"]
    return TokenBudget(
        preparation if preparation is not None else budget.max_preparation_tokens,
        iteration if iteration is not None else budget.max_iteration_tokens,
        budget.max_chunk,
    )
