"""A grammar as llguidance compiles it, and the bounds it is held to first; no MLX.

llguidance's compiler is recursive Rust: a chain of thousands of ``$ref``s or Lark rules
overflows a thread's stack and takes the whole process down (a segmentation fault, no
exception). So everything llguidance compiles here is compiled on a thread with a large stack
(:data:`STACK_BYTES`, reserved, not committed: only the pages a compile touches cost memory), a
grammar is bounded before it gets there (:func:`check_bounds`: its size, the nesting of its JSON,
its ``$ref``s), and a request's grammar is first compiled in a child process that may die in its
place (``engine/vocabulary/grammar_sandbox.py``). ``LIMITS`` bounds what a matcher may spend on one
mask: past it the matcher stops with an error, which fails its row (never a "stop").
"""

from __future__ import annotations

import json
import queue
import threading
from collections.abc import Callable
from typing import Any, TypeVar

import llguidance

from ..errors import InvalidRequestError
from ..params import Grammar

T = TypeVar("T")

ANY_JSON_OBJECT = '{"type": "object"}'
# JSON on one line, separators fixed: a model free to put whitespace between tokens may emit it
# forever (the tiny random model of the tests did, and small models do), and none is needed.
JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}

MAX_GRAMMAR_BYTES = 256 * 1024  # a schema or grammar's text; tool calls carry all offered tools
MAX_JSON_DEPTH = 64  # nesting of a schema's JSON (Pydantic's run to ten or so)
MAX_REFS = 512  # ``$ref``s in a schema (the red team's crash was a chain of 1,000)
STACK_BYTES = 256 * 1024 * 1024  # a compiling thread's stack: 3,000 chained Lark rules need it

# llguidance's defaults, but no verbose errors: they would put the schema in a client's reply.
LIMITS = llguidance.LLParserLimits(verbose_errors=False)


def grammar_error(grammar: Grammar, message: str) -> InvalidRequestError:
    return InvalidRequestError(f"invalid {grammar.kind}: {message}", param="grammar")


def check_bounds(grammar: Grammar) -> None:
    """Raise ``InvalidRequestError`` (``param`` ``grammar``) for a grammar too large for the
    compiler to be given: over :data:`MAX_GRAMMAR_BYTES` of text, or a schema nested deeper
    than :data:`MAX_JSON_DEPTH` or with more than :data:`MAX_REFS` references."""
    size = len(grammar.spec.encode())
    if size > MAX_GRAMMAR_BYTES:
        raise grammar_error(grammar, f"{size} bytes, over the limit of {MAX_GRAMMAR_BYTES}")
    if grammar.kind != "json_schema":
        return
    try:
        schema = json.loads(grammar.spec)
    except (ValueError, RecursionError) as exc:
        raise grammar_error(grammar, f"not JSON ({exc})") from None
    refs = 0
    stack: list[tuple[Any, int]] = [(schema, 1)]
    while stack:
        value, depth = stack.pop()
        if depth > MAX_JSON_DEPTH:
            raise grammar_error(grammar, f"nested deeper than {MAX_JSON_DEPTH} levels")
        if isinstance(value, dict):
            refs += "$ref" in value
            stack.extend((v, depth + 1) for v in value.values())
        elif isinstance(value, list):
            stack.extend((v, depth + 1) for v in value)
    if refs > MAX_REFS:
        raise grammar_error(grammar, f"{refs} $refs, over the limit of {MAX_REFS}")


def llguidance_grammar(grammar: Grammar) -> str:
    """``grammar`` as llguidance's grammar text; raises ``InvalidRequestError``. Call it on a
    compiling thread (:data:`COMPILERS`), after :func:`check_bounds`."""
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
        raise grammar_error(grammar, str(exc)) from None
    raise InvalidRequestError(f"unknown grammar kind {grammar.kind!r}", param="grammar")


def new_matcher(grammar: Grammar, tokenizer: llguidance.LLTokenizer) -> llguidance.LLMatcher:
    """A matcher for ``grammar`` (on a compiling thread); raises ``InvalidRequestError`` for a
    grammar that does not compile, or whose matcher cannot even start."""
    text = llguidance_grammar(grammar)
    error = llguidance.LLMatcher.validate_grammar(text, tokenizer, limits=LIMITS)
    if error:
        raise grammar_error(grammar, error)
    matcher = llguidance.LLMatcher(tokenizer, text, log_level=0, limits=LIMITS)
    if matcher.is_error():
        raise grammar_error(grammar, first_line(matcher.get_error()))
    return matcher


def first_line(error: str) -> str:
    return error.strip().splitlines()[0] if error.strip() else "the matcher stopped"


class Compilers:
    """Threads with :data:`STACK_BYTES` of stack that run compiles, ``num_threads`` at once.
    llguidance releases the GIL while it compiles, so other threads (the engine's step, the
    event loop) go on meanwhile."""

    def __init__(self, num_threads: int = 2, *, stack_bytes: int = STACK_BYTES) -> None:
        self._stack_bytes = stack_bytes
        self._jobs: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._num_threads = num_threads
        self._threads: list[threading.Thread] = []
        self._lock = threading.Lock()

    def submit(self, job: Callable[[], None]) -> None:
        """Run ``job`` on a compiling thread (it must not raise)."""
        with self._lock:
            if len(self._threads) < self._num_threads:
                previous = threading.stack_size(self._stack_bytes)
                try:
                    thread = threading.Thread(target=self._serve, name="grammar", daemon=True)
                    thread.start()
                finally:
                    threading.stack_size(previous)
                self._threads.append(thread)
        self._jobs.put(job)

    def _serve(self) -> None:
        while True:
            self._jobs.get()()


COMPILERS = Compilers()
