"""What a generation produces, as plain frozen values (no MLX), shared with the runtime.

The values an engine process sends every call (a row's tokens, its progress) pickle as their
fields in order (:func:`_pickled_as_fields`): the dataclass default (``fields()`` for every object)
took 3 us an event each way, 1.5 ms a call of 256 rows (now 0.5 ms) on a 2-core machine, half
of it the engine's own time (design/030).
"""

from __future__ import annotations

from dataclasses import dataclass
from operator import attrgetter
from typing import Any, Literal, TypeVar

FinishReason = Literal["stop", "length"]
T = TypeVar("T")


def _pickled_as_fields(cls: type[T]) -> type[T]:
    """A slotted dataclass of two fields or more (``attrgetter`` of one returns no tuple) that
    pickles as its constructor and its fields, in order."""
    assert len(cls.__slots__) > 1  # type: ignore[attr-defined]
    fields = attrgetter(*cls.__slots__)  # type: ignore[attr-defined]

    def reduce(self: Any) -> tuple[type, tuple[Any, ...]]:
        return cls, fields(self)

    cls.__reduce__ = reduce  # type: ignore[assignment,method-assign]
    return cls


@_pickled_as_fields
@dataclass(frozen=True, slots=True)
class TokenLogprob:
    """The chosen token's log-probability and, if asked for, the most likely alternatives."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@_pickled_as_fields
@dataclass(frozen=True, slots=True)
class Delta:
    """One decode step's output for one request.

    ``text`` may be empty while the detokenizer or a possible stop string holds text back.
    ``token_ids`` are the tokens this step consumed (never an end-of-sequence or stop token id);
    ``logprobs``, when requested, has one entry per token id, in order.
    ``finish_reason`` is set on the last delta of a generation.
    """

    text: str
    token_ids: tuple[int, ...]
    logprobs: tuple[TokenLogprob, ...] | None = None
    finish_reason: FinishReason | None = None


@_pickled_as_fields
@dataclass(frozen=True, slots=True)
class GenerationStats:
    """Counts and timings of one finished generation. ``drafted_tokens``: tokens speculative
    decoding proposed; ``accepted_tokens``: how many of them the model kept (both 0 for a row
    that did not speculate)."""

    prompt_tokens: int
    cached_tokens: int
    generated_tokens: int
    prefill_s: float
    decode_s: float
    drafted_tokens: int = 0
    accepted_tokens: int = 0

    @property
    def decode_tokens_per_s(self) -> float:
        """Decode speed, counting the tokens after the first (the first comes from prefill)."""
        if self.generated_tokens < 2 or self.decode_s <= 0:
            return 0.0
        return (self.generated_tokens - 1) / self.decode_s


@_pickled_as_fields
@dataclass(frozen=True, slots=True)
class RowProgress:
    """Prompt processing progress of one row: ``done`` of ``total`` prompt tokens."""

    row: int
    done: int
    total: int


@_pickled_as_fields
@dataclass(frozen=True, slots=True)
class RowOutput:
    """A row's delta for this engine call (one token a step); ``stats`` is set on its last one
    (the row has left)."""

    row: int
    delta: Delta
    stats: GenerationStats | None = None


@_pickled_as_fields
@dataclass(frozen=True, slots=True)
class RowFailed:
    """A row that the engine had to drop: its sampler or a step failed. The row has left."""

    row: int
    message: str


RowEvent = RowProgress | RowOutput | RowFailed


@dataclass(frozen=True, slots=True)
class PromptCacheStatistics:
    hits: int
    misses: int
    hit_tokens: int
    entries: int
    bytes: int
    budget_bytes: int
    evictions: int


@dataclass(frozen=True, slots=True)
class AdapterInfo:
    """A LoRA adapter an engine serves (``engine/model/adapters.py``): the model id it is served
    as, its directory, its rank and scale, and how many linear layers it changes."""

    name: str
    path: str
    rank: int
    scale: float
    layers: int
