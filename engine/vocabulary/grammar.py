"""Constrained decoding: a row's tokens held to a grammar (a JSON schema, any JSON object, a
regular expression or a Lark grammar), with llguidance.

Why llguidance: it compiles a JSON schema or a grammar lazily (no up-front automaton over the
vocabulary, so a request's schema costs milliseconds, not seconds), computes a token mask in
0.15 ms (median; under 2 ms) for the default model's 49,152 tokens, reports unsupported schema
keywords as errors (which become a 400 before admission), and reads the tokenizer straight from
Hugging Face's.
Its MLX helper applies the mask with a Metal kernel only, so the mask is applied here with
``mx.where`` on any device.

What llguidance compiles is compiled on threads with a large stack, after bounds, and a
request's grammar first in a child process (``engine/vocabulary/grammar_text.py``,
``engine/vocabulary/grammar_sandbox.py``): a grammar that would crash the compiler or take seconds
is a 400 before admission. The engine builds each grammar's matcher once, on such a thread, off its
step (:class:`Matchers`; the batch engine holds a row back until its matcher is built), and a row
gets a copy.

A grammar travels in ``SamplingParams.grammar`` (a plain, picklable ``params.Grammar``); the
engine turns it into one more logits processor for the row (:func:`grammar_processor`), applied
after the others, so it works on both lanes and wherever the row is (mlx-lm's batch, solo, or
resumed after parking). A processor is called once for each token the row generates, with the
tokens so far: each call after the first feeds the grammar the row's last token first.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Any

import llguidance
import llguidance.hf
import llguidance.numpy as llnumpy
import numpy as np

from .. import _blas  # noqa: F401  (loads OpenBLAS: before MLX below)

# isort: split
import mlx.core as mx

from ..params import Grammar
from .grammar_text import COMPILERS, first_line, new_matcher


class GrammarTokenizers:
    """llguidance's view of each tokenizer (built once: 0.4 s for the default model's)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._built: dict[int, tuple[Any, llguidance.LLTokenizer]] = {}

    def of(self, tokenizer: Any) -> llguidance.LLTokenizer:
        """For an mlx-lm ``TokenizerWrapper`` (its Hugging Face tokenizer and end tokens)."""
        with self._lock:
            found = self._built.get(id(tokenizer))
            if found is None:
                built = llguidance.hf.from_tokenizer(
                    tokenizer._tokenizer, eos_token=sorted(tokenizer.eos_token_ids)
                )
                # The tokenizer is kept beside its view, so that its id is never reused.
                found = self._built[id(tokenizer)] = (tokenizer, built)
            return found[1]


TOKENIZERS = GrammarTokenizers()


class Matchers:
    """Each grammar's matcher, built once on a compiling thread (off the engine's step) and
    kept for the next rows held to it, at most ``size`` grammars (least recently used out);
    a row gets a copy (a fraction of a millisecond)."""

    def __init__(self, size: int = 64) -> None:
        self._lock = threading.Lock()
        self._size = size
        self._built: OrderedDict[tuple[int, Grammar], Future[llguidance.LLMatcher]] = OrderedDict()

    def request(
        self, grammar: Grammar, tokenizer: llguidance.LLTokenizer
    ) -> Future[llguidance.LLMatcher]:
        """The matcher of ``grammar``, built or being built; a failed build's future holds its
        ``InvalidRequestError``."""
        key = (id(tokenizer), grammar)
        with self._lock:
            if (found := self._built.get(key)) is not None:
                self._built.move_to_end(key)
                return found
            future: Future[llguidance.LLMatcher] = Future()
            self._built[key] = future
            while len(self._built) > self._size:
                self._built.popitem(last=False)

        def build() -> None:
            try:
                future.set_result(new_matcher(grammar, tokenizer))
            except Exception as exc:
                future.set_exception(exc)

        COMPILERS.submit(build)
        return future


MATCHERS = Matchers()


def request_matcher(grammar: Grammar, tokenizer: Any) -> Future[llguidance.LLMatcher]:
    """Start building ``grammar``'s matcher for an mlx-lm tokenizer, if not built yet."""
    return MATCHERS.request(grammar, TOKENIZERS.of(tokenizer))


def grammar_processor(grammar: Grammar, tokenizer: Any) -> Callable[[mx.array, mx.array], Any]:
    """A logits processor holding one row to ``grammar``; see the module docstring."""
    return GrammarProcessor(grammar, TOKENIZERS.of(tokenizer))


def rewind(processors: list[Any]) -> None:
    """A row taken out of a generator that steps one token ahead (mlx-lm's batch, or
    ``generate_step`` when solo): that step's processor call fed the grammar the row's last
    token, which is fed again when the row resumes; so its grammar forgets it."""
    for processor in processors:
        if isinstance(processor, GrammarProcessor):
            processor.rewind()


class GrammarProcessor:
    """One row's matcher: each call feeds it the row's last token (none the first time) and
    masks the logits to the tokens the grammar allows next. Once the grammar is complete only
    the end tokens are allowed.

    A matcher that cannot go on (its grammar too costly for a step, by ``LIMITS``; a token it
    refuses, which none should be) sets :attr:`failure`; the row's lane then fails the row
    with it, and drops the token sampled meanwhile. Its output never ends as if complete."""

    def __init__(self, grammar: Grammar, tokenizer: llguidance.LLTokenizer) -> None:
        # Built on a compiling thread, once a grammar (waits if still building: the batch
        # engine holds a row back until its matcher is built, so its step never waits here).
        self._matcher = MATCHERS.request(grammar, tokenizer).result().deep_copy()
        self.failure: str | None = None
        self.vocab_size = tokenizer.vocab_size
        self._bitmask = llnumpy.allocate_token_bitmask(1, self.vocab_size)
        self._started = False
        self._consumed = 0  # tokens fed to the matcher

    def rewind(self) -> None:
        """Forget the last token fed (it will be fed again): see :func:`rewind`."""
        if self._consumed:
            self._matcher.rollback(1)
            self._consumed -= 1

    @property
    def matcher(self) -> llguidance.LLMatcher:
        return self._matcher

    def to_feed(self, token: int | None) -> tuple[llguidance.LLMatcher, int] | None:
        """What feeding the row's last token ahead of its next mask takes: its matcher and
        the token, to consume now (None before the first mask: the row's first token is
        masked before it exists)."""
        if not self._started:
            self._started = True
            return None
        assert token is not None
        self._consumed += 1
        return self._matcher, token

    def advance(self, token: int | None) -> None:
        feed = self.to_feed(token)
        if feed is not None:
            self._matcher.consume_token(feed[1])

    def check(self, bitmask: np.ndarray, row: int) -> None:
        """After a mask is filled into ``bitmask[row]``: a matcher in error sets
        :attr:`failure` and leaves the row's mask open (its token will be dropped)."""
        if self.failure is None and self._matcher.is_error():
            reason = first_line(self._matcher.get_error())
            self.failure = f"the output's grammar could not go on ({reason})"
        if self.failure is not None:
            bitmask[row].fill(-1)

    def __call__(self, tokens: mx.array, logits: mx.array) -> mx.array:
        self.advance(int(tokens.reshape(-1)[-1].item()) if self._started else None)
        llnumpy.fill_next_token_bitmask(self._matcher, self._bitmask, 0)
        self.check(self._bitmask, 0)
        return masked(logits, self._bitmask)


def masked(logits: mx.array, bitmask: np.ndarray) -> mx.array:
    """``logits`` (rows x vocabulary) with the tokens ``bitmask`` (llguidance's packed rows:
    bit ``t % 32`` of word ``t // 32`` allows token ``t``) does not allow set to -inf. The
    words go to the device as they are (a 32nd of the bytes of one flag a token) and are
    unpacked there."""
    words = mx.array(bitmask.view(np.uint32))
    rows, width = logits.shape
    bits = mx.arange(32, dtype=mx.uint32)  # made here: MLX's arrays belong to a thread's stream
    allowed = ((words[:, :, None] >> bits) & 1).reshape(rows, -1)
    if allowed.shape[-1] < width:  # a model's head wider than its tokenizer's vocabulary
        allowed = mx.pad(allowed, ((0, 0), (0, width - allowed.shape[-1])))
    return mx.where(allowed[:, :width] > 0, logits, mx.array(-mx.inf, dtype=logits.dtype))


class BatchMasks:
    """The masks of a batch's rows held to grammars, computed together: each matcher fed its
    row's last token, then every mask filled in parallel (llguidance's threads, without the
    GIL) while the model's forward runs, and applied to the batch's logits at once."""

    _executor: llguidance.LLExecutor | None = None

    def __init__(self, processors: Sequence[Sequence[Any] | None]) -> None:
        """``processors``: each row's logits processors (None: none)."""
        self.rows = [
            (row, p)
            for row, ps in enumerate(processors)
            for p in ps or ()
            if isinstance(p, GrammarProcessor)
        ]
        self.num_rows = len(processors)

    def fill(self, last_tokens: Sequence[int]) -> np.ndarray:
        """Feed each held row its last token; its packed masks (free rows allow all)."""
        if BatchMasks._executor is None:
            BatchMasks._executor = llguidance.LLExecutor()
        vocab = self.rows[0][1].vocab_size
        bitmask = llnumpy.allocate_token_bitmask(self.num_rows, vocab)
        bitmask.fill(-1)
        feeds = [p.to_feed(last_tokens[row]) for row, p in self.rows]
        llnumpy.consume_token_par(BatchMasks._executor, [f for f in feeds if f is not None])
        matchers = [(processor.matcher, row) for row, processor in self.rows]
        llnumpy.fill_next_token_bitmask_par(BatchMasks._executor, matchers, bitmask)
        for row, processor in self.rows:
            processor.check(bitmask, row)
        return bitmask


def grammar_failure(processors: Sequence[Any]) -> str | None:
    """Why a row's grammar could not go on, if it could not (:class:`GrammarProcessor`)."""
    for processor in processors:
        if isinstance(processor, GrammarProcessor) and processor.failure is not None:
            return processor.failure
    return None
