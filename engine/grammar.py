"""Constrained decoding: a row's tokens held to a grammar (a JSON schema, any JSON object, a
regular expression or a Lark grammar), with llguidance.

Why llguidance: it compiles a JSON schema or a grammar lazily (no up-front automaton over the
vocabulary, so a request's schema costs milliseconds, not seconds), computes a token mask in
0.15 ms (median; under 2 ms) for the default model's 49,152 tokens, reports unsupported schema
keywords as errors (which become a 400 before admission), and reads the tokenizer straight from
Hugging Face's.
Its MLX helper applies the mask with a Metal kernel only, so the mask is applied here with
``mx.where`` on any device.

A grammar travels in ``SamplingParams.grammar`` (a plain, picklable ``params.Grammar``); the
engine turns it into one more logits processor for the row (:func:`grammar_processor`), applied
after the others, so it works on both lanes and wherever the row is (mlx-lm's batch, solo, or
resumed after parking). A processor is called once for each token the row generates, with the
tokens so far: each call after the first feeds the grammar the row's last token first.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from typing import Any

import llguidance
import llguidance.hf
import llguidance.numpy as llnumpy
import numpy as np

from . import _blas  # noqa: F401  (loads OpenBLAS: before MLX below)

# isort: split
import mlx.core as mx

from .errors import InvalidRequestError
from .params import Grammar

ANY_JSON_OBJECT = '{"type": "object"}'
# JSON on one line, separators fixed: a model free to put whitespace between tokens may emit it
# forever (the tiny random model of the tests did, and small models do), and none is needed.
JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def llguidance_grammar(grammar: Grammar) -> str:
    """``grammar`` as llguidance's grammar text; raises ``InvalidRequestError``."""
    try:
        match grammar.kind:
            case "json_object":
                return llguidance.LLMatcher.grammar_from_json_schema(ANY_JSON_OBJECT, JSON_LAYOUT)
            case "json_schema":
                json.loads(grammar.spec)  # a clear error for text that is not JSON at all
                return llguidance.LLMatcher.grammar_from_json_schema(grammar.spec, JSON_LAYOUT)
            case "regex":
                return llguidance.LLMatcher.grammar_from_regex(grammar.spec)
            case "lark":
                return llguidance.LLMatcher.grammar_from_lark(grammar.spec)
    except (ValueError, TypeError) as exc:
        raise InvalidRequestError(f"invalid {grammar.kind}: {exc}", param="grammar") from None
    raise InvalidRequestError(f"unknown grammar kind {grammar.kind!r}", param="grammar")


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


def check_grammar(grammar: Grammar, tokenizer: Any) -> None:
    """Raise ``InvalidRequestError`` (``param`` ``grammar``) if ``grammar`` cannot be compiled
    for ``tokenizer``: a bad schema, an unsupported keyword, a regex that does not parse."""
    text = llguidance_grammar(grammar)
    error = llguidance.LLMatcher.validate_grammar(text, TOKENIZERS.of(tokenizer))
    if error:
        raise InvalidRequestError(f"invalid {grammar.kind}: {error}", param="grammar")


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
    the end tokens are allowed. A token the matcher refuses (none should reach it) leaves the
    mask at the end tokens only, so the row ends rather than run on unconstrained."""

    def __init__(self, grammar: Grammar, tokenizer: llguidance.LLTokenizer) -> None:
        self._matcher = llguidance.LLMatcher(tokenizer, llguidance_grammar(grammar), log_level=0)
        self._vocab = tokenizer.vocab_size
        self._bitmask = llnumpy.allocate_token_bitmask(1, self._vocab)
        self._started = False
        self._consumed = 0  # tokens fed to the matcher

    def rewind(self) -> None:
        """Forget the last token fed (it will be fed again): see :func:`rewind`."""
        if self._consumed:
            self._matcher.rollback(1)
            self._consumed -= 1

    def __call__(self, tokens: mx.array, logits: mx.array) -> mx.array:
        if self._started:
            self._matcher.consume_token(int(tokens.reshape(-1)[-1].item()))
            self._consumed += 1
        self._started = True
        llnumpy.fill_next_token_bitmask(self._matcher, self._bitmask, 0)
        allowed = np.unpackbits(self._bitmask[0].view(np.uint8), bitorder="little")
        width = logits.shape[-1]
        if allowed.size < width:
            allowed = np.pad(allowed, (0, width - allowed.size))
        mask = mx.array(allowed[:width].astype(np.bool_))
        return mx.where(mask, logits, mx.array(-mx.inf, dtype=logits.dtype))
