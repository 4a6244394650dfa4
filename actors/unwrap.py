"""The exception a context manager's body raised, raised as it is, not in the exception groups
of the nurseries the manager keeps around its ``yield`` (Trio wraps every exception that leaves
a nursery's block, the body's own included): ``except KeyboardInterrupt`` around
``open_runtime`` sees Ctrl-C, ``except ValueError`` the body's ValueError.

    body = BodyError()
    try:
        async with trio.open_nursery():
            with body.kept():
                yield ...
    except BaseExceptionGroup as group:
        body.raise_unless_only_it(group)
    else:
        return
    raise body.exception()

The last ``raise`` stands outside the ``except`` clause, so that the body's exception keeps its
own ``__context__`` instead of taking the group as one.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager


class BodyError:
    """What the body raised, if anything; see the module docstring."""

    __slots__ = ("_raised",)

    def __init__(self) -> None:
        self._raised: BaseException | None = None

    @contextmanager
    def kept(self) -> Iterator[None]:
        """Keep what the block raises (and let it go on)."""
        try:
            yield
        except BaseException as exc:
            self._raised = exc
            raise

    def raise_unless_only_it(self, group: BaseExceptionGroup) -> None:
        """Re-raise ``group`` (from its ``except`` clause) unless the body's exception is all
        it holds."""
        leaves = _leaves(group)
        if self._raised is None or len(leaves) != 1 or leaves[0] is not self._raised:
            raise group

    def exception(self) -> BaseException:
        assert self._raised is not None, "the body raised"
        return self._raised


def _leaves(group: BaseExceptionGroup) -> list[BaseException]:
    leaves: list[BaseException] = []
    for exc in group.exceptions:
        leaves.extend(_leaves(exc) if isinstance(exc, BaseExceptionGroup) else [exc])
    return leaves
