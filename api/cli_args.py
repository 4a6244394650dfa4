"""The command line's value checks and help layout: every flag is checked as it is parsed, so a
value that would disable the server (``--step-timeout 0``, ``--max-live 0``, ``--port 99999``)
is one line naming the flag, exit status 2, before anything loads."""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable


def integer(low: int, high: int | None = None) -> Callable[[str], int]:
    """An int in ``[low, high]``."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
        if value < low or (high is not None and value > high):
            span = f"at least {low}" if high is None else f"from {low} to {high}"
            raise argparse.ArgumentTypeError(f"must be {span}, got {value}")
        return value

    return parse


def seconds(*, zero: bool = False) -> Callable[[str], float]:
    """A finite number of seconds, above 0 (``zero``: at least 0)."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected seconds, got {text!r}") from None
        if not math.isfinite(value) or value < 0 or (value == 0 and not zero):
            bound = "at least 0" if zero else "above 0"
            raise argparse.ArgumentTypeError(f"must be {bound} seconds, got {text}")
        return value

    return parse


def number(text: str) -> float:
    """A finite number (the sampling flags' ranges are the engine's: ``SamplingDefaults``)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"expected a finite number, got {text}")
    return value


POSITIVE = integer(1)
NON_NEGATIVE = integer(0)
PORT = integer(0, 65535)  # 0: any free port


class HelpFormatter(argparse.HelpFormatter):
    """Each flag's help ends with its default, unless it has none or already says it."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        default = action.default
        if (
            action.option_strings
            and "default" not in text
            and default not in (None, False, [], {}, argparse.SUPPRESS)
        ):
            text += " (default: %(default)s)"
        return text
