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

A prompt whose rest (past the prompt cache's hit) is at least ``alone_from`` tokens is not
prefilled in mlx-lm's left-padded batch but one row at a time under a causal mask, in whole
chunks of at most ``max_chunk`` within the iteration budget (``engine/batch/alone.py``,
design/027: on CUDA the padded batch's array mask costs attention its fused kernel).

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
    alone_from: int | None = None  # None: every prompt prefills in mlx-lm's batch

    def __post_init__(self) -> None:
        for name in ("max_preparation_tokens", "max_iteration_tokens", "max_chunk"):
            if (value := getattr(self, name)) < 1:
                raise InvalidRequestError(f"{name} must be at least 1, got {value}", param=name)
        if self.alone_from is not None and self.alone_from < 1:
            raise InvalidRequestError(
                f"alone_from must be at least 1, got {self.alone_from}", param="alone_from"
            )

    def prefills_alone(self, rest: int) -> bool:
        """Whether a prompt with ``rest`` tokens to prefill goes one row at a time (a single
        token has nothing to prefill: it is the batch's to read)."""
        return self.alone_from is not None and rest >= max(2, self.alone_from)

    def alone_tokens(self, decoding: int) -> int:
        """Prompt tokens prefilled one row at a time in the next iteration, beside ``decoding``
        rows: the iteration budget's rest, at least one whole chunk."""
        return max(self.max_chunk, self.max_iteration_tokens - decoding)

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
# Bursts of 16-64 prompts of 1,536-2,048 tokens prefilled 1.7-3.0x faster one at a time than in
# mlx-lm's padded batch on the H200 (design/027); on CPU attention has no fused kernel to lose.
DEVICE_BUDGETS = {
    "cpu": TokenBudget(max_preparation_tokens=1024, max_iteration_tokens=256, max_chunk=256),
    "gpu": TokenBudget(
        max_preparation_tokens=32768, max_iteration_tokens=8192, max_chunk=2048, alone_from=512
    ),
}


def default_budget(
    device: str,
    *,
    preparation: int | None = None,
    iteration: int | None = None,
    alone_from: int | None = None,
) -> TokenBudget:
    """The budget for ``device`` (``cpu`` or ``gpu``), with any limit overridden
    (``alone_from`` 0: no prompt prefills alone)."""
    budget = DEVICE_BUDGETS["gpu" if device == "gpu" else "cpu"]
    if alone_from is None:
        alone_from = budget.alone_from
    return TokenBudget(
        preparation if preparation is not None else budget.max_preparation_tokens,
        iteration if iteration is not None else budget.max_iteration_tokens,
        budget.max_chunk,
        alone_from or None,
    )
