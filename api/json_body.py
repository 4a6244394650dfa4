"""Parsing a request body's JSON, with the limits the parser itself does not keep.

``json.loads`` raises ``RecursionError`` on deep nesting and ``ValueError`` on an integer over
Python's digit limit, and it accepts escaped lone surrogates (``"\\ud800"``) that no tokenizer
can encode. Each is refused here as :class:`InvalidRequestError`: no request body needs more
than a few levels, so nesting past :data:`MAX_DEPTH` is refused too, before any schema sees it.
"""

from __future__ import annotations

import json
import re
import sys
from typing import Any

from ..engine.errors import InvalidRequestError
from .field_names import format_param

MAX_DEPTH = 64
_SURROGATE = re.compile("[\ud800-\udfff]")

Path = tuple[int | str, ...]


def loads(text: str) -> Any:
    """The JSON value of ``text``, checked for depth and surrogates."""
    try:
        data = json.loads(text)
    except RecursionError:
        raise _too_deep() from None
    except json.JSONDecodeError as exc:
        raise InvalidRequestError(f"request body is not valid JSON: {exc.msg}") from None
    except ValueError:  # an integer over the digit limit; no other ValueError comes from loads
        raise InvalidRequestError(
            f"request body holds an integer of more than {sys.get_int_max_str_digits()} digits"
        ) from None
    check(data)
    return data


def check(data: Any) -> None:
    """Refuse nesting deeper than :data:`MAX_DEPTH` and any string (a key too) holding a
    surrogate code point. Iterative, so a deep value costs no recursion."""
    stack: list[tuple[dict[str, Any] | list[Any], Path]] = []
    _visit(data, (), stack)
    while stack:
        container, path = stack.pop()
        if len(path) >= MAX_DEPTH:
            raise _too_deep()
        if isinstance(container, dict):
            for key, value in container.items():
                _check_string(key, path)
                _visit(value, (*path, key), stack)
        else:
            for index, value in enumerate(container):
                _visit(value, (*path, index), stack)


def _visit(value: Any, path: Path, stack: list[tuple[dict[str, Any] | list[Any], Path]]) -> None:
    if isinstance(value, str):
        _check_string(value, path)
    elif isinstance(value, dict | list):
        stack.append((value, path))


def _check_string(text: str, path: Path) -> None:
    if text.isascii() or not _SURROGATE.search(text):
        return
    param = format_param(path)
    where = f" in {param}" if param else ""
    raise InvalidRequestError(
        f"request body holds a lone UTF-16 surrogate (a \\ud800-\\udfff escape not in a "
        f"pair){where}; strings must be valid Unicode",
        param=param,
    )


def _too_deep() -> InvalidRequestError:
    return InvalidRequestError(f"request body is nested more than {MAX_DEPTH} levels deep")
