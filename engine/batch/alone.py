"""Long prompts prefilled one row at a time, beside mlx-lm's batch (issue 38, design/027).

mlx-lm's ``BatchGenerator`` prefills the prompts it holds together, left-padded to one length,
their padding hidden by an array mask. On CUDA, attention with an array mask leaves MLX's fused
kernel for an unfused matmul and softmax, and the padding is computed too: a burst of 16-64
prompts of 1,536-2,048 tokens prefilled 1.7-3.0x faster one row at a time on an H200.

So a row whose prompt (past the prompt cache's hit) is long enough (``TokenBudget.alone_from``)
is prefilled here into caches of its own, under the causal mask, in whole chunks of at most
``max_chunk`` tokens while the step's budget lasts (the first row first: its first token is not
held back by the others). Once all of its prompt but the last token is in its caches, the row
goes to mlx-lm's batch with that token and those caches, as a prompt-cache hit does, and decodes
with the others.

Shapes repeat: MLX builds kernels per shape on a GPU, so a row's last chunk is padded on the right
to a multiple of ``PAD_GRANULE`` tokens and the padding trimmed off the caches afterwards
(``engine/padded_prefill.py``), where the caches trim exactly.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .. import _blas  # noqa: F401  (loads OpenBLAS: before MLX below)

# isort: split
import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache

from ..padded_prefill import can_pad, feed_padded

if TYPE_CHECKING:
    from .batch_row import BatchRow

Commit = Callable[[list[int], list[Any], str | None], None]
# Builds the forwards inside with row i on adapter slot slots[i] (engine/model/adapters.py).
Select = Callable[[Sequence[int]], AbstractContextManager[None]]


def no_adapters(slots: Sequence[int]) -> AbstractContextManager[None]:
    return nullcontext()


@dataclass(slots=True)
class AloneRow:
    """A row being prefilled here: its prompt past the hit (``rest``), the tokens its caches
    held when it came (``context``), the caches, and how much of ``rest`` they hold now."""

    row: BatchRow
    rest: list[int]
    context: list[int]
    caches: list[Any]
    done: int = 0

    @property
    def to_prefill(self) -> int:
        """Prompt tokens prefilled here: all but the last (mlx-lm's batch reads that one)."""
        return len(self.rest) - 1

    @property
    def left(self) -> int:
        return self.to_prefill - self.done

    def held_tokens(self) -> list[int]:
        """The tokens the caches hold now."""
        return self.context + self.rest[: self.done]


class AlonePrefill:
    """Rows prefilled one at a time, first come first (see the module docstring); called on the
    engine thread only. ``pad``: pad last chunks where the caches allow (off: a benchmark's
    unpadded side, and the CPU, which compiles nothing per shape). ``select``: each row's
    forwards with its LoRA adapter (``Engine.select_adapters``). ``make_caches(model)``: a
    row's fresh caches (``Engine.new_caches``'s scheme)."""

    def __init__(
        self,
        model: Any,
        *,
        max_chunk: int,
        checkpoints: bool,
        pad: bool = True,
        select: Select = no_adapters,
        make_caches: Callable[[Any], list[Any]] = make_prompt_cache,
    ) -> None:
        self._model = model
        self._make_caches = make_caches
        self._select = select
        self._max_chunk = max_chunk
        # Models whose prompt-cache entries are reused from their exact end only get one where
        # a repeat of the request starts: its prompt but the last token (engine/batch/caches.py).
        self._checkpoints = checkpoints
        self._pads = pad and can_pad(make_caches(model))
        self._rows: dict[int, AloneRow] = {}

    def __len__(self) -> int:
        return len(self._rows)

    def __contains__(self, row_id: int) -> bool:
        return row_id in self._rows

    @property
    def kv_bytes(self) -> int:
        return sum(c.nbytes for entry in self._rows.values() for c in entry.caches)

    def add(
        self,
        row: BatchRow,
        rest: list[int],
        caches: list[Any] | None,
        context: list[int] | None,
    ) -> None:
        """Take a row to prefill ``rest`` (at least 2 tokens) on top of ``caches``, which hold
        ``context`` (None: fresh caches)."""
        assert len(rest) >= 2, "a row prefilled alone has a prompt of at least 2 tokens"
        if caches is None:
            caches = self._make_caches(self._model)
        self._rows[row.id] = AloneRow(row, rest, list(context or []), caches)

    def drop(self, row_id: int) -> AloneRow | None:
        """Stop prefilling a row; what its caches hold (``AloneRow.held_tokens``) is the
        caller's."""
        return self._rows.pop(row_id, None)

    def step(self, tokens: int, commit: Commit) -> tuple[list[AloneRow], list[AloneRow]]:
        """Prefill whole chunks of the rows, first come first, while ``tokens`` last (at least
        one chunk); returns the rows it prefilled and, of them, those now ready for the batch
        (no longer held here). ``commit`` takes a checkpoint where the model wants them."""
        stepped: list[AloneRow] = []
        spent = 0
        for entry in self._rows.values():
            before = entry.done
            while entry.left > 0:
                chunk = min(self._max_chunk, entry.left)
                if spent and spent + chunk > tokens:
                    break
                self._prefill(entry, chunk)
                spent += chunk
            if entry.done > before:
                stepped.append(entry)
            if entry.left > 0:
                break
        if not stepped:
            return [], []
        mx.eval([c.state for entry in stepped for c in entry.caches])
        ready = [entry for entry in stepped if entry.left == 0]
        for entry in ready:
            del self._rows[entry.row.id]
            if self._checkpoints:  # a copy: the batch's merge reads the caches themselves
                held = copy.deepcopy(entry.caches)
                commit(entry.held_tokens(), held, entry.row.cache_salt)
        return stepped, ready

    def _prefill(self, entry: AloneRow, chunk: int) -> None:
        """Feed the row's next ``chunk`` prompt tokens (lazily: :meth:`step` evaluates)."""
        piece = entry.rest[entry.done : entry.done + chunk]
        with self._select([entry.row.adapter_slot]):
            if self._pads:
                feed_padded(self._model, piece, entry.caches, max_chunk=self._max_chunk)
            else:
                self._model(mx.array(piece)[None], cache=entry.caches)
        entry.done += chunk

    def close(self) -> None:
        self._rows.clear()
