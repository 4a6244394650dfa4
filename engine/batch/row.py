"""One request's decoding state, shared by the single-request and the batch paths.

A :class:`RowDecoder` turns each sampled token (and its log-probability vector) into a
:class:`Delta`, decides when the generation ends (end-of-sequence or stop token, stop string,
``max_tokens``) and keeps the counts and timings for :class:`GenerationStats`.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from .. import _blas  # noqa: F401  (loads OpenBLAS: before MLX below)

# isort: split
import mlx.core as mx
from mlx_lm.tokenizer_utils import TokenizerWrapper

from ..outputs import Delta, FinishReason, GenerationStats, TokenLogprob
from ..params import SamplingParams
from ..speculative.lookup import DraftCounts
from ..vocabulary.text import TextStream


def token_logprob(logprobs: mx.array, token: int, top_n: int) -> TokenLogprob:
    """The chosen token's log-probability and the ``top_n`` most likely tokens, best first."""
    chosen = logprobs[token].item()
    if top_n == 0:
        return TokenLogprob(token=token, logprob=chosen)
    top_ids = mx.argpartition(-logprobs, kth=top_n - 1)[:top_n]
    top_values = logprobs[top_ids]
    order = mx.argsort(-top_values)
    ids = top_ids[order].tolist()
    values = top_values[order].tolist()
    return TokenLogprob(token=token, logprob=chosen, top=tuple(zip(ids, values, strict=True)))


class RowDecoder:
    """Decodes one generation, token by token."""

    def __init__(
        self,
        tokenizer: TokenizerWrapper,
        params: SamplingParams,
        *,
        num_prompt_tokens: int,
        num_cached_tokens: int = 0,
    ) -> None:
        self.params = params
        self.stop_token_ids = frozenset(tokenizer.eos_token_ids) | frozenset(params.stop_token_ids)
        self._text = TextStream(tokenizer, params.stop)
        self._num_prompt_tokens = num_prompt_tokens
        self.num_cached_tokens = num_cached_tokens
        self._num_generated = 0
        self._started_at = time.perf_counter()
        self._first_token_at: float | None = None
        self._finished_at: float | None = None
        self.finish_reason: FinishReason | None = None
        self.drafts = DraftCounts()  # what its steps drafted, if it speculates

    @property
    def is_finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def num_generated(self) -> int:
        return self._num_generated

    def feed(self, token: int, logprobs: mx.array | None) -> Delta:
        """Consume one sampled token; the returned delta carries the finish reason, if any."""
        return self.feed_many((token,), (logprobs,))

    def feed_many(
        self, tokens: Sequence[int], logprobs: Sequence[mx.array | None] | None = None
    ) -> Delta:
        """Consume the tokens of several steps (``logprobs``: one vector each, or None when
        the request asked for none) and return one delta for them all. Tokens after the one
        that ends the generation are dropped: the batch path decodes a row's tokens once per
        engine call, so it may have sampled a few past a stop string."""
        assert not self.is_finished, "fed a finished row"
        now = time.perf_counter()
        if self._first_token_at is None:
            self._first_token_at = now
        want_logprobs = self.params.logprobs and logprobs is not None
        if not want_logprobs and not self._text.has_stops:
            return self._feed_plain(tokens, now)
        texts: list[str] = []
        ids: list[int] = []
        records: list[TokenLogprob] = []
        reason: FinishReason | None = None
        for i, token in enumerate(tokens):
            self._num_generated += 1
            if token in self.stop_token_ids:
                texts.append(self._text.finish()[0])
                reason = "stop"
                break
            if want_logprobs:
                vector = logprobs[i]  # type: ignore[index]
                if vector is not None:
                    records.append(token_logprob(vector, token, self.params.top_logprobs))
            ids.append(token)
            text, matched = self._text.push(token)
            texts.append(text)
            if matched:
                reason = "stop"
                break
            if self._num_generated >= self.params.max_tokens:
                tail, matched = self._text.finish()
                texts.append(tail)
                reason = "stop" if matched else "length"
                break
        delta = Delta("".join(texts), tuple(ids), tuple(records) if records else None)
        return delta if reason is None else self._finish(delta, reason, now)

    def _feed_plain(self, tokens: Sequence[int], now: float) -> Delta:
        """:meth:`feed_many` without stop strings or logprobs: where the generation ends is
        known from the ids alone, and the text of all kept tokens is decoded at once."""
        kept = tokens[: self.params.max_tokens - self._num_generated]
        reason: FinishReason | None = None
        if not self.stop_token_ids.isdisjoint(kept):
            end = next(i for i, t in enumerate(kept) if t in self.stop_token_ids)
            kept, reason = kept[:end], "stop"
            self._num_generated += 1  # the stop token counts, but is not emitted
        self._num_generated += len(kept)
        text = self._text.extend(kept)
        if reason is None and self._num_generated >= self.params.max_tokens:
            reason = "length"
        if reason is not None:
            text += self._text.finish()[0]
        delta = Delta(text, tuple(kept))
        return delta if reason is None else self._finish(delta, reason, now)

    def _finish(self, delta: Delta, reason: FinishReason, now: float) -> Delta:
        self.finish_reason = reason
        self._finished_at = now
        return Delta(delta.text, delta.token_ids, delta.logprobs, finish_reason=reason)

    def stats(self) -> GenerationStats:
        """Counts and timings so far (final once the row is finished)."""
        end = self._finished_at or time.perf_counter()
        first = self._first_token_at or end
        return GenerationStats(
            prompt_tokens=self._num_prompt_tokens,
            cached_tokens=self.num_cached_tokens,
            generated_tokens=self._num_generated,
            prefill_s=first - self._started_at,
            decode_s=end - first,
            drafted_tokens=self.drafts.drafted,
            accepted_tokens=self.drafts.accepted,
        )
