"""A request's grammar compiled first in a child process, where a crash costs one request.

A request's grammar (``response_format``, a forced tool call, ``SamplingParams.grammar``) is
checked before admission. llguidance's compiler can die on what it is given (a stack overflow
is a segmentation fault: no exception reaches Python) or spend seconds on it; the serving
process must do neither. So :class:`GrammarSandbox` sends the grammar to a child
(``python -m mlx_trio.engine.vocabulary.grammar_sandbox``; it imports llguidance and this package's
plain modules, no MLX) that builds its matcher exactly as the engine will
(``grammar_text.new_matcher``, on a thread with the same stack), within a budget of time. The answer
is one of:

- it compiled, in so many seconds: the engine may build it (the same build, on the same stack,
  ends the same way), off its step (``grammar.Matchers``);
- it does not compile: llguidance's error, a 400 naming the field;
- the child died compiling it, or spent more than :data:`COMPILE_BUDGET_S` of CPU on it (or
  :data:`COMPILE_WALL_S` of time, waiting for a core included): a 400 naming the field; the
  child is replaced, and nothing else waited on it.

The budget is CPU time, the grammar's own cost: on a busy 2-core machine, where the engine's
steps come first (the children run at nice 10), a schema that compiles in 1.5 s of CPU took over
3 s of wall time, and a wall-clock budget refused it for the load of others.

``num_workers`` children compile at once (the rest wait their turn, in their own request's
time); answers are kept for the last :data:`REMEMBERED` grammars, so a schema sent again costs
nothing. The children are started on first use and ended with the sandbox.

Messages are pickles with a 4-byte length before each: first the tokenizer (llguidance's JSON
of it, its vocabulary size and end tokens), then a grammar per request, each answered with
``(error or None, seconds)``.
"""

from __future__ import annotations

import contextlib
import logging
import os
import pickle
import queue
import select
import struct
import subprocess
import sys
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import IO, Any

from ..errors import InvalidRequestError
from ..params import Grammar
from .grammar_text import STACK_BYTES, check_bounds, first_line, grammar_error, new_matcher

logger = logging.getLogger(__name__)

COMPILE_BUDGET_S = 3.0  # CPU seconds of a grammar's compile and first mask, in the child
COMPILE_WALL_S = 20.0  # the most it may take, waiting for a core included
START_TIMEOUT_S = 60.0  # a child's start: Python, llguidance and the tokenizer's view of it
REMEMBERED = 256
PROBE_TOKENS = 8  # tokens a grammar is walked in the child, past its first mask
TOO_COSTLY_EXIT = 3  # the child's exit status when a compile ran past the budget


@dataclass(frozen=True, slots=True)
class TokenizerSpec:
    """What the child needs to build llguidance's tokenizer: the Hugging Face tokenizer as
    JSON, and its end tokens."""

    json: str
    eos_token_ids: tuple[int, ...]

    @classmethod
    def of(cls, tokenizer: Any) -> TokenizerSpec:
        """For an mlx-lm ``TokenizerWrapper`` (as ``grammar.GrammarTokenizers`` reads it)."""
        from copy import copy

        backend = copy(tokenizer._tokenizer.backend_tokenizer)
        backend.no_padding()
        backend.no_truncation()
        return cls(backend.to_str(), tuple(sorted(tokenizer.eos_token_ids)))


class GrammarSandbox:
    """Checks grammars in child processes; see the module docstring. Thread-safe: ``check``
    blocks its caller (a worker thread) until a child answers."""

    def __init__(
        self, tokenizer: TokenizerSpec, *, num_workers: int = 2, stack_bytes: int = STACK_BYTES
    ) -> None:
        """``stack_bytes``: the compiling thread's stack in the child; the engine's is
        ``STACK_BYTES``, and a smaller one is for tests (a real crash, within bounds)."""
        self._tokenizer = tokenizer
        self._stack_bytes = stack_bytes
        self._idle: queue.SimpleQueue[_Worker | None] = queue.SimpleQueue()
        for _ in range(num_workers):
            self._idle.put(None)  # a slot: a worker is started when first needed
        self._answers: OrderedDict[Grammar, str | None] = OrderedDict()
        self._lock = threading.Lock()
        self._closed = False
        self._workers: set[_Worker] = set()

    def check(self, grammar: Grammar) -> None:
        """Raise ``InvalidRequestError`` (``param`` ``grammar``) unless ``grammar`` compiles
        within the budget; see the module docstring."""
        check_bounds(grammar)
        with self._lock:
            if grammar in self._answers:
                self._answers.move_to_end(grammar)
                error = self._answers[grammar]
                if error is not None:
                    raise grammar_error(grammar, error)
                return
        error = self._compile(grammar)
        with self._lock:
            self._answers[grammar] = error
            while len(self._answers) > REMEMBERED:
                self._answers.popitem(last=False)
        if error is not None:
            raise grammar_error(grammar, error)

    def _compile(self, grammar: Grammar) -> str | None:
        worker = self._idle.get()
        try:
            if worker is None or not worker.is_alive():
                worker = self._start()
            error, seconds = worker.ask(grammar, COMPILE_BUDGET_S)
        except _WorkerLost as lost:
            logger.warning("a grammar (%s, %d bytes) %s", grammar.kind, len(grammar.spec), lost)
            self._stop(worker)
            worker = None
            return str(lost)
        finally:
            self._idle.put(worker)
        logger.debug("a grammar (%s) compiled in %.3f s", grammar.kind, seconds)
        return error

    def _start(self) -> _Worker:
        if self._closed:
            raise InvalidRequestError("the server is shutting down", param="grammar")
        worker = _Worker.start(self._tokenizer, self._stack_bytes)
        with self._lock:
            self._workers.add(worker)
        return worker

    def _stop(self, worker: _Worker | None) -> None:
        if worker is not None:
            worker.kill()
            with self._lock:
                self._workers.discard(worker)

    def close(self) -> None:
        """End the children (a check in flight then fails)."""
        self._closed = True
        with self._lock:
            workers, self._workers = list(self._workers), set()
        for worker in workers:
            worker.kill()


class _WorkerLost(Exception):
    """The child died on a grammar, or ran past its budget: the message says which."""


class _Worker:
    def __init__(self, process: subprocess.Popen[bytes]) -> None:
        self._process = process
        assert process.stdin is not None and process.stdout is not None
        self._stdin: IO[bytes] = process.stdin
        self._stdout: IO[bytes] = process.stdout

    @classmethod
    def start(cls, tokenizer: TokenizerSpec, stack_bytes: int) -> _Worker:
        process = subprocess.Popen(
            [sys.executable, "-m", "mlx_trio.engine.vocabulary.grammar_sandbox"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
        worker = cls(process)
        _write(worker._stdin, (tokenizer, stack_bytes))
        if worker._read(START_TIMEOUT_S) != "ready":
            worker.kill()
            raise _WorkerLost("the grammar compiler did not start")
        return worker

    def is_alive(self) -> bool:
        return self._process.poll() is None

    def ask(self, grammar: Grammar, budget_s: float) -> tuple[str | None, float]:
        try:
            _write(self._stdin, grammar)
        except OSError:
            raise _WorkerLost("could not be compiled: the compiler had ended") from None
        answer = self._read(COMPILE_WALL_S + 1.0)  # its own clocks stop it first
        error, seconds = answer
        if error is None and seconds > budget_s:
            raise _WorkerLost(f"took over {budget_s:g} s to compile: too costly")
        return error, seconds

    def _read(self, timeout_s: float) -> Any:
        deadline = time.monotonic() + timeout_s
        header = self._read_exactly(4, deadline)
        return pickle.loads(self._read_exactly(struct.unpack("<I", header)[0], deadline))

    def _read_exactly(self, size: int, deadline: float) -> bytes:
        data = b""
        fd = self._stdout.fileno()
        while len(data) < size:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                raise _WorkerLost(f"took over {COMPILE_BUDGET_S:g} s to compile: too costly")
            chunk = os.read(fd, size - len(data))
            if not chunk:
                code = self._process.wait()
                if code == TOO_COSTLY_EXIT:
                    raise _WorkerLost(f"took over {COMPILE_BUDGET_S:g} s to compile: too costly")
                raise _WorkerLost(f"crashed the grammar compiler (exit status {code})")
            data += chunk
        return data

    def kill(self) -> None:
        if self._process.poll() is None:
            self._process.kill()
        self._process.wait()
        for pipe in (self._stdin, self._stdout):
            with contextlib.suppress(OSError):
                pipe.close()


def _write(pipe: IO[bytes], value: object) -> None:
    payload = pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)
    pipe.write(struct.pack("<I", len(payload)) + payload)
    pipe.flush()


def _serve() -> None:
    """The child: build the tokenizer's view, then answer grammars until stdin closes. A
    compile that runs past the budget is not waited for: the child exits, and the parent
    starts another."""
    import llguidance

    from . import grammar_text

    stdin, stdout = sys.stdin.buffer, sys.stdout.buffer
    sys.stdout = sys.stderr  # nothing but answers on the pipe
    with contextlib.suppress(OSError):
        os.nice(10)  # the engine's steps come first: a compile waits its turn for a core

    def read() -> Any:
        header = stdin.read(4)
        if len(header) < 4:
            return None
        return pickle.loads(stdin.read(struct.unpack("<I", header)[0]))

    spec: TokenizerSpec
    spec, stack_bytes = read()
    grammar_text.COMPILERS = grammar_text.Compilers(1, stack_bytes=stack_bytes)
    tokenizer = llguidance.LLTokenizer(spec.json, eos_token=list(spec.eos_token_ids))
    _write(stdout, "ready")
    answers: queue.SimpleQueue[str | None] = queue.SimpleQueue()
    while (grammar := read()) is not None:
        started, cpu_started = time.monotonic(), time.process_time()
        grammar_text.COMPILERS.submit(lambda g=grammar: answers.put(_attempt(g, tokenizer)))
        while True:  # the compile's CPU (this process does nothing else), and a wall limit
            try:
                error = answers.get(timeout=0.05)
                break
            except queue.Empty:
                cpu = time.process_time() - cpu_started
                if cpu > COMPILE_BUDGET_S or time.monotonic() - started > COMPILE_WALL_S:
                    os._exit(TOO_COSTLY_EXIT)
        _write(stdout, (error, time.process_time() - cpu_started))


def _attempt(grammar: Grammar, tokenizer: Any) -> str | None:
    """What the engine will do with ``grammar``: build its matcher, fill its first mask; then
    a short walk (:data:`PROBE_TOKENS` tokens, each the lowest allowed id but the end), which
    finds the grammars whose matcher gives up at once (10,000 optional properties: right
    after the ``{``)."""
    import llguidance.numpy as llnumpy
    import numpy as np

    try:
        matcher = new_matcher(grammar, tokenizer)
    except InvalidRequestError as exc:
        return str(exc).removeprefix(f"invalid {grammar.kind}: ")
    bitmask = llnumpy.allocate_token_bitmask(1, tokenizer.vocab_size)
    for _ in range(PROBE_TOKENS):
        llnumpy.fill_next_token_bitmask(matcher, bitmask, 0)
        if matcher.is_error():  # e.g. a $ref cycle: nothing can be written
            return f"the grammar cannot be followed ({first_line(matcher.get_error())})"
        allowed = np.flatnonzero(np.unpackbits(bitmask[0].view(np.uint8), bitorder="little"))
        allowed = np.setdiff1d(allowed[allowed < tokenizer.vocab_size], tokenizer.eos_tokens)
        if matcher.is_stopped() or not len(allowed):
            break
        matcher.consume_token(int(allowed[0]))
    return None


if __name__ == "__main__":
    _serve()
