"""Request fields by name: an unknown one logged once, and a body's names as a client sends
them, for the ``param`` of an error (OpenAI's ``messages.[0].content``).

Each API's bodies (``schemas.py``, ``responses_schemas.py``, ``anthropic_schemas.py``) decide
which fields they refuse or ignore; this module is what they share.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from pydantic import BaseModel

logger = logging.getLogger(__name__)

MAX_LOGGED_FIELDS = 1000  # names logged at most, so that no client can grow the set
MAX_LOGGED_NAME = 64  # characters of a name logged (a client chooses it)
_logged_unknown: set[str] = set()


def log_ignored(name: str, api: str) -> None:
    """Log, once per name, that a request field ``api`` does not define was ignored."""
    if _first_time(name):
        shown = name if len(name) <= MAX_LOGGED_NAME else name[:MAX_LOGGED_NAME] + "..."
        logger.info("ignoring the request field %r: %s does not define it", shown, api)


def _first_time(name: str) -> bool:
    """Whether ``name`` is an unknown field not seen (and logged) before."""
    if name in _logged_unknown or len(_logged_unknown) >= MAX_LOGGED_FIELDS:
        return False
    _logged_unknown.add(name)
    return True


def fields_of(*bodies: type[BaseModel]) -> frozenset[str]:
    """The field names (as sent: by alias) of ``bodies``: what ``schemas.error_param`` keeps of
    an error's location."""
    fields = [(name, f) for body in bodies for name, f in body.model_fields.items()]
    return frozenset(f.alias or name for name, f in fields)


def format_param(path: Sequence[int | str]) -> str | None:
    """A path into the body as OpenAI names a parameter: ``messages.[0].content``."""
    return ".".join(f"[{part}]" if isinstance(part, int) else part for part in path) or None
