"""A row of the batch path: its state, its prompt past the prompt cache's hit, its sampler.

:class:`BatchRow` is what :class:`BatchEngine` keeps for each row it was given: the
:class:`RowDecoder` it shares with the single-request path, the row's sampler and logits
processors, where the row is (mlx-lm's batch, parked, or the solo row: ``engine/batch/solo.py``),
and the tokens it sampled in the current engine call, decoded at the call's end.
:class:`PromptStart` is a new row's prompt past what the prompt cache already held;
:func:`guard_sampler` makes a failing sampler fail its own row only. mlx-lm's batch of these
rows is ``engine/batch/batch_rows.py``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .. import _blas  # noqa: F401  (loads OpenBLAS: before MLX below)

# isort: split
import mlx.core as mx
from mlx_lm.generate import StopSequences
from mlx_lm.tokenizer_utils import TokenizerWrapper

from ..outputs import RowOutput
from ..params import PreparedRequest
from ..vocabulary.sampling import (
    LogitsProcessor,
    Sampler,
    make_row_processors,
    repair_random_state,
)
from .prompt_cache import PromptCache
from .row import RowDecoder


@dataclass(slots=True)
class BatchRow:
    id: int
    decoder: RowDecoder
    sampler: Sampler | None
    processors: list[LogitsProcessor]
    stops: StopSequences
    wants_logprobs: bool
    num_prompt_tokens: int = 0
    uid: int | None = None
    decoding: bool = False  # in mlx-lm's generation batch (not prefilling)
    parked: tuple[list[Any], list[int]] | None = None  # KV caches, tokens (last one not in them)
    # This engine call's tokens (and log-probability vectors, if asked for), decoded at its end.
    sampled: list[int] = field(default_factory=list)
    sampled_logprobs: list[mx.array] = field(default_factory=list)
    took_at: int | None = None  # the step that gave it its last sampled token
    failure: str | None = None  # its sampler failed: it left the generator, fails at the end
    cache_salt: str | None = None  # its prompt-cache partition (PreparedRequest.cache_salt)
    # Prompt tokens prefilled alone before it joined mlx-lm's batch (its progress goes on from).
    prefilled_alone: int = 0
    adapter_slot: int = 0  # its LoRA adapter's (engine/model/adapters.py; 0: the base model)

    @classmethod
    def new(
        cls,
        row_id: int,
        tokenizer: TokenizerWrapper,
        request: PreparedRequest,
        sampler: Sampler | None,
        adapter_slot: int = 0,
    ) -> BatchRow:
        """A row for ``request``, sampling with ``sampler`` (None: greedy), on the adapter
        ``adapter_slot``."""
        params = request.params
        decoder = RowDecoder(tokenizer, params, num_prompt_tokens=len(request.prompt_tokens))
        return cls(
            id=row_id,
            decoder=decoder,
            sampler=sampler,
            processors=make_row_processors(params, tokenizer),
            stops=StopSequences([[t] for t in sorted(decoder.stop_token_ids)] or None),
            wants_logprobs=params.logprobs,
            num_prompt_tokens=len(request.prompt_tokens),
            cache_salt=request.cache_partition,
            adapter_slot=adapter_slot,
        )

    @property
    def num_sampled(self) -> int:
        """Tokens generated so far, this call's undecoded ones included."""
        return self.decoder.num_generated + len(self.sampled)

    @property
    def remaining_tokens(self) -> int:
        """Tokens it may still generate."""
        return self.decoder.params.max_tokens - self.num_sampled

    def take(self, token: int, logprobs: mx.array, step: int) -> bool:
        """Keep a token sampled in ``step``; whether it is the row's first. (The batch's rows
        take theirs inline in :meth:`GeneratorRows.step`, the hot path.)"""
        first = self.num_sampled == 0
        self.sampled.append(token)
        if self.wants_logprobs:
            self.sampled_logprobs.append(logprobs)
        self.took_at = step
        return first

    def ends_with(self, token: int) -> bool:
        """Whether ``token``, just sampled, ends the row by a stop token or ``max_tokens`` (a
        stop string is only seen once the row's tokens are decoded)."""
        return token in self.decoder.stop_token_ids or self.remaining_tokens <= 0

    def fail(self, message: str, step: int) -> None:
        """Mark the row failed in ``step``; the token it got in that step is dropped (it may be
        a failed sampler's placeholder)."""
        self.failure = message
        if self.sampled and self.took_at == step:
            self.sampled.pop()
            if self.sampled_logprobs:
                self.sampled_logprobs.pop()

    def decode(self) -> RowOutput | None:
        """The row's output for this call's tokens (None if it got none); ``stats`` is set if
        the row finished."""
        if not self.sampled:
            return None
        tokens, self.sampled = self.sampled, []
        logprobs, self.sampled_logprobs = self.sampled_logprobs, []
        delta = self.decoder.feed_many(tokens, logprobs if self.wants_logprobs else None)
        if delta.finish_reason is None:
            return RowOutput(row=self.id, delta=delta)
        return RowOutput(row=self.id, delta=delta, stats=self.decoder.stats())


@dataclass(frozen=True, slots=True)
class PromptStart:
    """A new row's prompt past the prompt cache's hit (``rest``), and the hit: its KV caches
    and the tokens they hold (both None on a miss)."""

    rest: list[int]
    hit_cache: list[Any] | None
    context: list[int] | None

    @classmethod
    def take(cls, cache: PromptCache | None, prompt: list[int], salt: str | None) -> PromptStart:
        """Take the longest prefix of ``prompt`` that ``cache`` holds under ``salt`` out of it."""
        hit = cache.take(prompt, salt) if cache is not None else None
        if hit is None:
            return cls(prompt[:], None, None)
        return cls(prompt[hit.num_tokens :], hit.cache, prompt[: hit.num_tokens])

    @property
    def num_cached(self) -> int:
        return len(self.context) if self.context is not None else 0


def guard_sampler(row_id: int, sampler: Sampler, faults: dict[int, str]) -> Sampler:
    """A sampler whose failure fails only its own row: it records the error in ``faults`` and
    returns a placeholder token; the batch engine then drops the row with a ``RowFailed``.
    Whatever shared state the failure broke (MLX's global random state) is repaired before the
    step's graph is evaluated, so the other rows' step goes on."""

    def guarded(logprobs: mx.array) -> mx.array:
        try:
            return sampler(logprobs)
        except Exception as exc:
            faults[row_id] = f"sampler failed: {type(exc).__name__}: {exc}"
            repair_random_state()
            return mx.argmax(logprobs, axis=-1)

    return guarded
