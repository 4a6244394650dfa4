"""A row's steps with drafts (prompt lookup, or a draft model): the same contract as mlx-lm's
``generate_step`` (iterate for ``(token, logprobs)``, one token at a time; ``close`` when done),
so the serial lane and the batch's solo row swap one for the other.

A step feeds the row's pending token and the draft (:class:`NgramIndex`'s, or
``ModelDrafter``'s) in one forward, samples every position with the row's own sampler, keeps
the draft's tokens while they equal the samples, then the first sample that differs (or the one
after the whole draft). For a greedy
row that is the argmax chain; for a sampled row it is the standard rejection rule for a draft
that puts all its mass on one token (accept it with the target's probability of it, else draw
from the target without it), so the output keeps the target's distribution. The KV cache is
trimmed back past the rejected tokens. With no draft the step is a plain one-token step, and
the draft's length adapts: halved after a draft that won nothing, doubled (up to the request's
``num_draft_tokens``) after one taken whole.

Logits processors (penalties, logit bias) see, at each position, the tokens before it, as mlx-lm's
``speculative_generate_step`` applies them; a row held to a grammar drafts nothing (its
matcher would have to take and give back tokens a draft proposes: design/032).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from .. import _blas  # noqa: F401  (loads OpenBLAS: before MLX below)

# isort: split
import mlx.core as mx
from mlx_lm.generate import generate_step, generation_stream
from mlx_lm.models.cache import trim_prompt_cache
from mlx_lm.sample_utils import greedy_sampler

from ..padded_prefill import can_pad, offset_progress, prefill_then
from ..params import Speculation
from ..vocabulary.grammar import GrammarProcessor
from ..vocabulary.sampling import with_history
from .draft_model import ModelDrafter
from .lookup import DraftCounts, NgramIndex

Sampler = Callable[[mx.array], mx.array]
LogitsProcessor = Callable[[mx.array, mx.array], mx.array]


@dataclass(frozen=True, slots=True)
class _Flight:
    """A forward started: the draft it verifies, its samples and log-probabilities."""

    draft: list[int]
    sampled: mx.array
    logprobs: mx.array


class Drafter(Protocol):
    """Where a row's drafts come from: ``NgramIndex`` or ``ModelDrafter``."""

    def draft(self, k: int) -> list[int]: ...

    def accepted(self, kept: list[int], num_accepted: int) -> None: ...


class SpeculativeSteps:
    """``generate_step`` with drafts for one row (see the module docstring)."""

    def __init__(
        self,
        model: Any,
        prompt: Sequence[int],
        *,
        caches: list[Any],
        max_tokens: int,
        num_draft_tokens: int,
        drafter: Drafter,
        sampler: Sampler | None = None,
        logits_processors: Sequence[LogitsProcessor] = (),
        prefill_step_size: int = 512,
        on_progress: Callable[[int, int], None] | None = None,
        counts: DraftCounts | None = None,
    ) -> None:
        """``prompt``: the tokens to feed on top of ``caches`` (``drafter`` has them, and the
        tokens before); ``logits_processors`` are handed the tokens from ``prompt`` on, as
        ``generate_step`` hands them (``with_history`` prepends the rest). ``counts``: where the
        drafts are counted (a row's, kept across its runs)."""
        assert prompt, "a row steps from at least one token"
        self._model = model
        self._caches = caches
        self._sampler = sampler or greedy_sampler
        self._processors = list(logits_processors)
        self._max_tokens = max_tokens
        self._max_draft = 0 if _has_grammar(self._processors) else num_draft_tokens
        self._num_draft = self._max_draft
        self._drafter = drafter
        self._seen = list(prompt[:-1])  # fed before the pending token, for the processors
        self._ready: deque[tuple[int, mx.array]] = deque()
        self._num_generated = 0
        self._flight: _Flight | None = None
        self.counts = counts if counts is not None else DraftCounts()
        # Prefilled at the first step, as generate_step's: until then the caches are untouched.
        self._prompt: list[int] | None = list(prompt)
        self._prefill_step_size = prefill_step_size
        self._on_progress = on_progress
        self._pending = prompt[-1]

    def _prefill(self, prompt: list[int]) -> None:
        """Feed all of ``prompt`` but its last token, in chunks; the last is pending."""
        total, step, on_progress = len(prompt), self._prefill_step_size, self._on_progress
        if on_progress is not None:
            on_progress(0, total)
        with mx.stream(generation_stream):
            for start in range(0, total - 1, step):
                chunk = prompt[start : min(start + step, total - 1)]
                self._model(mx.array(chunk)[None], cache=self._caches)
                mx.eval([c.state for c in self._caches])
                if on_progress is not None:
                    on_progress(start + len(chunk), total)

    def __iter__(self) -> SpeculativeSteps:
        return self

    def __next__(self) -> tuple[int, mx.array]:
        prompt, self._prompt = self._prompt, None
        if prompt is not None:
            self._prefill(prompt)
        if not self._ready:
            if self._flight is None:
                if self._num_generated >= self._max_tokens:
                    raise StopIteration
                self._flight = self._launch()
            self._land(self._flight)
            # The next forward runs while the caller takes these tokens (``generate_step``'s
            # step ahead): its input is known now.
            self._flight = self._launch() if self._num_generated < self._max_tokens else None
        if prompt is not None and self._on_progress is not None:
            self._on_progress(len(prompt), len(prompt))  # as generate_step: after its first step
        return self._ready.popleft()

    def _launch(self) -> _Flight:
        """Start one forward over the pending token and a draft."""
        room = self._max_tokens - self._num_generated - 1  # the last token needs no draft
        with mx.stream(generation_stream):
            draft = self._drafter.draft(min(self._num_draft, room))
            logits = self._model(mx.array([self._pending, *draft])[None], cache=self._caches)[0]
            logits = self._processed(logits, draft)
            logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
            sampled = self._sampler(logprobs)
            mx.async_eval(sampled, logprobs)
        return _Flight(draft, sampled, logprobs)

    def _land(self, flight: _Flight) -> None:
        """Keep the draft's tokens the samples agree with and the next sample; trim the rest
        of the draft back out of the caches."""
        draft, tokens = flight.draft, flight.sampled.tolist()
        num_accepted = 0
        while num_accepted < len(draft) and draft[num_accepted] == tokens[num_accepted]:
            num_accepted += 1
        kept = tokens[: num_accepted + 1]
        if rejected := len(draft) - num_accepted:
            trim_prompt_cache(self._caches, rejected)
        self._adapt(len(draft), num_accepted)
        self.counts.drafted += len(draft)
        self.counts.accepted += num_accepted
        self._num_generated += len(kept)
        self._drafter.accepted(kept, num_accepted)
        self._seen.extend([self._pending, *kept[:-1]])
        self._pending = kept[-1]
        self._ready.extend(zip(kept, flight.logprobs[: len(kept)], strict=True))

    def _processed(self, logits: mx.array, draft: list[int]) -> mx.array:
        """``logits`` through the row's processors, each position after the tokens before it."""
        if not self._processors:
            return logits
        rows = []
        for i in range(len(draft) + 1):
            seen = mx.array([*self._seen, self._pending, *draft[:i]])
            row = logits[i : i + 1]
            for processor in self._processors:
                row = processor(seen, row)
            rows.append(row)
        return mx.concatenate(rows, axis=0)

    def _adapt(self, num_drafted: int, num_accepted: int) -> None:
        if not num_drafted:
            return
        if num_accepted == 0:
            self._num_draft = max(1, self._num_draft // 2)
        elif num_accepted == num_drafted:
            self._num_draft = min(self._max_draft, self._num_draft * 2)

    def close(self) -> None:
        """Stop: the caches keep the tokens handed out, as ``generate_step``'s do (the step
        ahead fed the last one), and no more: the tokens still queued, and the step ahead's
        draft, are trimmed back out."""
        extra = len(self._ready)
        if self._flight is not None:
            mx.eval(self._flight.sampled)
            extra += len(self._flight.draft)
        elif self._ready:  # the last queued token is pending: never fed
            extra -= 1
        if extra:
            trim_prompt_cache(self._caches, extra)
        self._ready.clear()
        self._flight = None


def _has_grammar(processors: Sequence[LogitsProcessor]) -> bool:
    return any(isinstance(p, GrammarProcessor) for p in processors)


def open_steps(
    model: Any,
    prompt: Sequence[int],
    *,
    caches: list[Any],
    history: Sequence[int],
    max_tokens: int,
    sampler: Sampler | None,
    processors: list[LogitsProcessor],
    prefill_step_size: int,
    speculation: Speculation | None,
    on_progress: Callable[[int, int], None] | None = None,
    counts: DraftCounts | None = None,
    draft_model: Any = None,
    pad_prefill: bool = False,
) -> Iterator[tuple[int, mx.array]]:
    """A row's steps from ``prompt`` over ``caches`` (which hold ``history``): mlx-lm's
    ``generate_step``, or :class:`SpeculativeSteps` where the row speculates (``speculation``:
    resolved, ``plan.resolve``; ``counts``: where its drafts are counted; ``draft_model``: the
    engine's, for the method ``draft_model``). ``pad_prefill``: prefill the prompt in chunks
    whose shapes repeat (``engine/padded_prefill.py``; a GPU's), where the caches allow. Close
    it when done."""
    if pad_prefill and len(prompt) > 1 and can_pad(caches):

        def steps(last: Sequence[int], done: int) -> Iterator[tuple[int, mx.array]]:
            return open_steps(
                model,
                last,
                caches=caches,
                history=[*history, *prompt[:done]],
                max_tokens=max_tokens,
                sampler=sampler,
                processors=processors,
                prefill_step_size=prefill_step_size,
                speculation=speculation,
                on_progress=offset_progress(on_progress, done),
                counts=counts,
                draft_model=draft_model,
            )

        return prefill_then(
            model,
            history,
            prompt,
            caches,
            max_chunk=prefill_step_size,
            stream=generation_stream,
            steps=steps,
        )
    processors = with_history(processors, list(history))
    if speculation is None:
        return generate_step(
            mx.array(prompt),
            model,
            max_tokens=max_tokens,
            sampler=sampler or greedy_sampler,
            logits_processors=processors,
            prompt_cache=caches,
            prefill_step_size=prefill_step_size,
            prompt_progress_callback=on_progress,
        )
    assert speculation.num_draft_tokens is not None and speculation.ngram_size is not None
    tokens = [*history, *prompt]
    drafter: Drafter
    if speculation.method == "draft_model":
        assert draft_model is not None
        drafter = ModelDrafter(draft_model, tokens, prefill_step_size=prefill_step_size)
    else:
        drafter = NgramIndex(tokens, max_n=speculation.ngram_size)
    return SpeculativeSteps(
        model,
        prompt,
        caches=caches,
        max_tokens=max_tokens,
        num_draft_tokens=speculation.num_draft_tokens,
        drafter=drafter,
        sampler=sampler,
        logits_processors=processors,
        prefill_step_size=prefill_step_size,
        on_progress=on_progress,
        counts=counts,
    )
