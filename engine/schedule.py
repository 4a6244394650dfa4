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

Plain arithmetic, no MLX: the engine's batch (``engine/batch_rows.py``) applies it to mlx-lm's
``BatchGenerator`` before each step, and the scripted engine (``actors/scripted.py``) steps by it,
so the actors' tests see the same rules.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

# A chunk smaller than this costs a step's fixed overhead for too few tokens.
MIN_CHUNK = 16


@dataclass(frozen=True, slots=True)
class TokenBudget:
    """The two budgets (see the module docstring); ``max_chunk`` bounds one row's chunk (the
    model's attention over a chunk grows with it; mlx-lm prefills 2,048 at most)."""

    max_preparation_tokens: int = 2048
    max_iteration_tokens: int = 512
    max_chunk: int = 2048

    def __post_init__(self) -> None:
        if min(self.max_preparation_tokens, self.max_iteration_tokens, self.max_chunk) < 1:
            raise ValueError(f"every budget must be positive: {self}")

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
        ``decoding`` rows that take one token each: the iteration budget's rest, shared evenly,
        at least ``MIN_CHUNK`` and at most ``max_chunk``."""
        if preparing <= 0:
            return self.max_chunk
        share = (self.max_iteration_tokens - decoding) // preparing
        return max(MIN_CHUNK, min(self.max_chunk, share))
