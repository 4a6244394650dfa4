"""The batch path's solo row: a lone generating row stepped by mlx-lm's ``generate_step``.

``generate_step`` runs one row faster than ``BatchGenerator`` (on an H200, 263 against 151
tok/s), so :class:`BatchEngine` hands a lone generating row to its :class:`SoloRow`: the row
leaves mlx-lm's batch with its KV cache, the way a parked row leaves, and goes back as a resumed
row as soon as another row arrives. A row added to an empty batch with a prompt of at most one
prefill chunk goes solo at once, "unstarted", prefilled by ``generate_step`` too, which reaches
its first token sooner; if another row arrives before its first step, it joins the batch with
its prompt (:meth:`SoloRow.drop_unstarted`). A solo row's logits processors (penalties) see the
tokens it had before going solo too (``with_history``), as they do in the batch.

:class:`SoloRow` holds the ``generate_step`` run and its caches; the row itself (its decoder,
its tokens of the call) stays the batch engine's, which decides when a row goes solo and back.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from .. import _blas  # noqa: F401  (loads OpenBLAS: before MLX below)

# isort: split
import mlx.core as mx

from ..generate import Engine
from ..speculative.steps import open_steps
from .batch_row import BatchRow, PromptStart
from .caches import tokens_held


@dataclass(slots=True)
class _Run:
    """The solo row's ``generate_step`` run; its caches hold a prefix of ``tokens`` (every
    token of the row so far)."""

    row_id: int
    steps: Iterator[tuple[int, mx.array]]  # with close(): generate_step's or LookupSteps
    caches: list[Any]
    tokens: list[int]
    # A row that went solo from its prompt, until its first step: the prompt left to prefill,
    # and the prompt cache's hit, to join the batch with instead.
    unstarted: PromptStart | None = None


class SoloRow:
    """At most one row stepped by ``generate_step``; called on the engine thread only."""

    def __init__(self, engine: Engine, *, prefill_chunk: int, enabled: bool = True) -> None:
        """``enabled``: False keeps every row in the batch."""
        self._engine = engine
        self._prefill_chunk = prefill_chunk
        self.enabled = enabled
        self._run: _Run | None = None

    @property
    def row_id(self) -> int | None:
        """The row stepped here, if one is."""
        return self._run.row_id if self._run is not None else None

    @property
    def is_unstarted(self) -> bool:
        """Whether the row went solo from its prompt and has not had its first step."""
        return self._run is not None and self._run.unstarted is not None

    @property
    def kv_bytes(self) -> int:
        return sum(c.nbytes for c in self._run.caches) if self._run is not None else 0

    def can_start_from_prompt(self, num_rows: int, prompt_tokens: int) -> bool:
        """Whether a new row can go solo from its prompt: the batch has no row (``num_rows``)
        and its prompt (past a prompt-cache hit) fits one prefill chunk, so a row arriving
        meanwhile waits no longer for it than for a chunk in the batch."""
        return (
            self.enabled
            and self._run is None
            and num_rows == 0
            and 0 < prompt_tokens <= self._prefill_chunk
        )

    def start(self, row: BatchRow, caches: list[Any], tokens: list[int]) -> None:
        """Step a generating row taken out of the batch: ``caches`` hold ``tokens`` but the
        last, which is fed again."""
        assert self._run is None
        steps = self._steps(row, tokens[-1:], caches, history=tokens[:-1])
        self._run = _Run(row.id, steps, caches, tokens)

    def start_from_prompt(self, row: BatchRow, prompt: list[int], start: PromptStart) -> None:
        """Step a new row from its prompt (``prompt``, of which ``start`` is left to prefill)."""
        assert self._run is None
        caches = start.hit_cache
        if caches is None:
            caches = self._engine.new_caches()
        steps = self._steps(row, start.rest, caches, history=start.context or [])
        self._run = _Run(row.id, steps, caches, list(prompt), start)

    def _steps(
        self, row: BatchRow, prompt: list[int], caches: list[Any], *, history: list[int]
    ) -> Iterator[tuple[int, mx.array]]:
        """``generate_step`` (or its speculative twin, ``engine/speculative/``) for the row:
        ``prompt`` to prefill on top of ``caches`` (which hold ``history``), then the row's
        remaining tokens."""
        return open_steps(
            self._engine.model_for(row.adapter_slot),
            prompt,
            caches=caches,
            history=history,
            max_tokens=row.remaining_tokens,
            sampler=row.sampler,
            processors=row.processors,
            prefill_step_size=self._prefill_chunk,
            speculation=self._engine.speculation_for(row.decoder.params),
            counts=row.decoder.drafts,
            draft_model=self._engine.draft_model,
            pad_prefill=self._engine.pads_prefill,
        )

    def step(self) -> tuple[int, mx.array, int | None]:
        """One step: the token sampled, its log-probability vector, and the prompt tokens
        prefilled first if this was an unstarted row's first step (else None)."""
        run = self._run
        assert run is not None
        token, logprobs = next(run.steps)
        prefilled = None
        if run.unstarted is not None:
            prefilled = len(run.unstarted.rest)
            run.unstarted = None
        run.tokens.append(token)
        return token, logprobs, prefilled

    def end(self) -> tuple[list[int], list[Any]]:
        """The row ended (``generate_step`` knows no stop tokens): stop stepping it; the
        tokens its caches hold and the caches, for the prompt cache."""
        run, self._run = self._run, None
        assert run is not None
        run.steps.close()
        held = tokens_held(run.caches)
        return (run.tokens[:held] if held is not None else []), run.caches

    def drop_unstarted(self) -> PromptStart:
        """Stop an unstarted row before its first step: its prompt left to prefill, and the
        prompt cache's hit."""
        run, self._run = self._run, None
        assert run is not None and run.unstarted is not None
        run.steps.close()
        return run.unstarted

    def drop(self) -> tuple[list[Any], list[int]]:
        """Stop stepping a started row: its caches and tokens, parked-style (the caches hold
        every token but the last, which is fed again, as on resume)."""
        run, self._run = self._run, None
        assert run is not None and run.unstarted is None
        run.steps.close()
        keep = len(run.tokens) - 1
        for cache in run.caches:
            cache.trim(cache.offset - keep)
        return run.caches, run.tokens

    def close(self) -> None:
        """Stop stepping the row, if any; its KV is dropped."""
        if self._run is not None:
            self._run.steps.close()
            self._run = None
