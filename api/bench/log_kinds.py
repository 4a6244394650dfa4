"""One log line for each kind of failure, not a traceback for each request that failed.

The GPU run serves HTTP in its own process: when a system is broken, every request fails the
same way and the server logs each one with its traceback (86 of them for one run). While
:func:`once_per_kind` is in force, an error record of the runtime's loggers (``mlx_trio.*``, the
harness's own excepted) is printed the first time its kind is seen, as one line (the message
and the exception, no traceback), and counted after that; on the way out one line says how
many more of each kind there were. A kind is the logger, the message's format string and the
exception's type and text, so the same failure of different requests is one kind.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager

logger = logging.getLogger(__name__)

Kind = tuple[str, str, str]
OWN = "mlx_trio.api.bench"
DECIDED = "_mlx_trio_once_per_kind"


class OncePerKind(logging.Filter):
    """A handler filter: the first error record of each kind, on one line; the rest counted."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: Counter[Kind] = Counter()
        self.lines: dict[Kind, str] = {}

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.ERROR or not record.name.startswith("mlx_trio."):
            return True
        if record.name.startswith(OWN):
            return True
        decided = getattr(record, DECIDED, None)  # another handler saw this record first
        if decided is not None:
            return decided
        keep = self._first_of_its_kind(record)
        setattr(record, DECIDED, keep)
        return keep

    def _first_of_its_kind(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        error = "" if exc is None else f"{type(exc).__name__}: {exc}"
        kind = (record.name, str(record.msg), error)
        self.seen[kind] += 1
        if self.seen[kind] > 1:
            return False
        line = record.getMessage() + (f": {error}" if error else "")
        self.lines[kind] = line
        # The record goes on as one line: its message with the exception, no traceback.
        record.msg, record.args = "%s (once; later ones alike are counted)", (line,)
        record.exc_info, record.exc_text, record.stack_info = None, None, None
        return True

    def repeats(self) -> list[tuple[str, int]]:
        """Each kind seen more than once: its line and how many more times it came."""
        return [(self.lines[k], n - 1) for k, n in self.seen.items() if n > 1]


@contextmanager
def once_per_kind() -> Iterator[OncePerKind]:
    """Put a :class:`OncePerKind` on the root logger's handlers; on the way out, take it off
    and log one line for each kind that came again."""
    kinds = OncePerKind()
    handlers = list(logging.getLogger().handlers)
    for handler in handlers:
        handler.addFilter(kinds)
    try:
        yield kinds
    finally:
        for handler in handlers:
            handler.removeFilter(kinds)
        for line, more in kinds.repeats():
            logger.error("%d more like it: %s", more, line)
