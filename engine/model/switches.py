"""Environment switches that override an engine policy: ``on``, ``off`` or ``auto``."""

from __future__ import annotations

import os

from ..errors import InvalidRequestError


def env_switch(name: str) -> bool | None:
    """``name``'s setting: True (``on``), False (``off``) or None (``auto``, or unset). Another
    value is an :class:`InvalidRequestError` (the CLI's one-line error, as a ``--device gpu``
    without a GPU)."""
    setting = os.environ.get(name, "auto").strip().lower()
    if setting in {"on", "1", "true", "yes"}:
        return True
    if setting in {"off", "0", "false", "no"}:
        return False
    if setting != "auto":
        raise InvalidRequestError(f"{name} must be on, off or auto, not {setting!r}")
    return None
