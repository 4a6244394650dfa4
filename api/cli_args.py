"""The command line's value checks and help layout: every flag is checked as it is parsed, so a
value that would disable the server (``--step-timeout 0``, ``--max-live 0``, ``--port 99999``),
a huge one that would overflow on the way to MLX, or a ``--model`` that is no model, is one
line naming the flag, exit status 2, before anything loads.

Each check is an argparse ``type``: it raises ``ArgumentTypeError``, which argparse prints as
``argument --flag: <why>``. The bounds above are generous (no real use comes near them): they
keep a typo's extra digits from reaching C++ (``--memory-limit 100000000000TB``) or from a
plan of a billion requests."""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from ..engine.budget import MemoryLimit
from ..engine.errors import InvalidRequestError, MlxTrioError
from ..engine.model.gguf_header import is_gguf
from ..engine.model.hub import HubId, parse_hub_id
from ..engine.params import MAX_SEED, SamplingParams

T = TypeVar("T")

MAX_ROWS = 65_536  # --max-batch, --max-n
MAX_SESSIONS = 1_000_000  # --max-live, --max-queued
MAX_TOKENS = 10_000_000  # longer than any model's context (the loader's own bound)
MAX_BYTES = 1 << 50  # 1 PiB: --memory-limit, --prompt-cache-bytes
# mlx.launch's backends (mlx/_distributed_utils/launch.py)
DISTRIBUTED_BACKENDS = ("ring", "mpi", "nccl", "jaccl", "jaccl-ring")


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
    """A finite number."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"expected a finite number, got {text}")
    return value


def sampling(name: str, parse: Callable[[str], Any]) -> Callable[[str], Any]:
    """``parse``'s value, in the range a request's ``name`` has (``SamplingParams``' checks,
    the same as over HTTP): ``--temperature 5`` is refused as ``temperature: 5`` would be."""

    def check(text: str) -> Any:
        value = parse(text)
        try:
            SamplingParams(**{name: value})
        except InvalidRequestError as exc:
            raise argparse.ArgumentTypeError(exc.message) from None
        return value

    return check


def nonempty(what: str) -> Callable[[str], str]:
    """A string that is not empty (``what`` names it in the message)."""

    def parse(value: str) -> str:
        if not value.strip():
            raise argparse.ArgumentTypeError(f"{what} must not be empty")
        return value

    return parse


def logit_bias(value: str) -> dict[int, float]:
    """A JSON object of token id to bias, each in OpenAI's range (-100 to 100)."""
    try:
        given = json.loads(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"not JSON ({exc}): {value!r}") from None
    if not isinstance(given, dict):
        raise argparse.ArgumentTypeError(
            f"must be a JSON object of token id to bias, as '{{\"42\": -100}}', got {value!r}"
        )
    try:
        bias = {int(token): float(b) for token, b in given.items()}
    except (TypeError, ValueError):
        raise argparse.ArgumentTypeError(
            f"token ids must be whole numbers and biases numbers, got {value!r}"
        ) from None
    try:
        SamplingParams(logit_bias=bias)
    except InvalidRequestError as exc:
        raise argparse.ArgumentTypeError(exc.message) from None
    return bias


def memory_limit(value: str) -> MemoryLimit:
    """``MemoryLimit.parse``'s, at most ``MAX_BYTES``."""
    try:
        limit = MemoryLimit.parse(value)
    except InvalidRequestError as exc:
        raise argparse.ArgumentTypeError(exc.message) from None
    if limit.bytes is not None and limit.bytes > MAX_BYTES:
        raise argparse.ArgumentTypeError(f"must be at most 1 PiB, got {value!r}")
    return limit


def model(value: str) -> str:
    """A model as ``resolve_model`` takes it: ``default``, a directory whose ``config.json``
    is a JSON object, a GGUF file, or a Hugging Face id (``org/name[@revision]``, fetched
    when the model loads); checked without loading anything."""
    if value == "default" or parse_hub_id(value) is not None:
        return value
    path = Path(value).expanduser()
    if not path.exists():
        raise argparse.ArgumentTypeError(
            f"model not found: {value} (not a file, a directory or a Hugging Face id org/name)"
        )
    if path.is_dir():
        config = path / "config.json"
        if not config.is_file():
            raise argparse.ArgumentTypeError(f"not a model directory (no config.json): {value}")
        _json_object(config)
        return value
    try:
        gguf = path.is_file() and is_gguf(path)
    except OSError as exc:
        raise argparse.ArgumentTypeError(f"cannot read {value}: {exc.strerror}") from None
    if not gguf:
        raise argparse.ArgumentTypeError(f"not a model directory or a GGUF file: {value}")
    return value


def hub_id(value: str) -> HubId:
    """A Hugging Face model id: ``org/name`` or ``org/name@revision``."""
    if (parsed := parse_hub_id(value)) is None:
        raise argparse.ArgumentTypeError(
            f"not a Hugging Face id (org/name or org/name@revision): {value}"
        )
    return parsed


def model_directory(value: str) -> Path:
    """An MLX model's directory: its ``config.json`` a JSON object."""
    path = Path(value).expanduser()
    config = path / "config.json"
    if not config.is_file():
        raise argparse.ArgumentTypeError(f"{value}: no config.json there (not an MLX model)")
    _json_object(config)
    return path


def program(value: str) -> Path:
    """An executable file (an interpreter, say), or a command on ``PATH``."""
    path = Path(value).expanduser()
    if path.is_file() and os.access(path, os.X_OK):
        return path
    if os.sep not in value and (found := shutil.which(value)) is not None:
        return Path(found)
    raise argparse.ArgumentTypeError(f"not an executable file: {value}")


def hostfile(value: str) -> str:
    """mlx.launch's hostfile: a JSON file (a list of hosts, or an object with ``hosts``)."""
    path = Path(value).expanduser()
    if not path.is_file():
        raise argparse.ArgumentTypeError(f"no such file: {value}")
    data = _json(path)
    if not isinstance(data, list) and not (isinstance(data, dict) and "hosts" in data):
        raise argparse.ArgumentTypeError(
            f"{value} must be a JSON list of hosts or an object with 'hosts' (mlx.launch's)"
        )
    return value


def json_file(value: str) -> Path:
    """A file holding a JSON object."""
    path = Path(value).expanduser()
    if not path.is_file():
        raise argparse.ArgumentTypeError(f"no such file: {value}")
    _json_object(path)
    return path


def _json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise argparse.ArgumentTypeError(f"cannot read {path}: {exc.strerror}") from None
    except ValueError as exc:  # UnicodeDecodeError too
        raise argparse.ArgumentTypeError(f"{path} is not valid JSON ({exc})") from None


def _json_object(path: Path) -> None:
    if not isinstance(_json(path), dict):
        raise argparse.ArgumentTypeError(f"{path} is not a JSON object")


def given(cls: Callable[..., T], **values: object) -> T:
    """``cls`` built from the flags given (not None); the dataclass's defaults for the rest,
    so that each default is defined once, in the dataclass."""
    return cls(**{name: value for name, value in values.items() if value is not None})


def flag_of(param: str | None) -> str:
    """The flag that sets a request's ``param`` (``stop_token_ids``: ``--stop-token-id``)."""
    param = {"stop_token_ids": "stop_token_id"}.get(param or "", param or "")
    return "--" + param.replace("_", "-")


def model_refused(exc: InvalidRequestError) -> MlxTrioError:
    """The loaded model's refusal of the flags' request, naming the flag where one set the
    ``param`` (``--top-k`` past the vocabulary, a ``--stop-token-id`` outside it); a prompt
    too long for the context says so as it is."""
    if exc.param in ("top_k", "stop_token_ids", "logit_bias"):
        return MlxTrioError(f"{flag_of(exc.param)}: {exc.message}")
    return exc


POSITIVE = integer(1)
NON_NEGATIVE = integer(0)
PORT = integer(0, 65535)  # 0: any free port
TOKENS = integer(1, MAX_TOKENS)
SEED = integer(0, MAX_SEED)


class HelpFormatter(argparse.HelpFormatter):
    """Each flag's help ends with its default, unless it has none or already says it."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        help = action.help or ""
        if action.option_strings and "default" not in help and not _says_nothing(action.default):
            help += " (default: %(default)s)"
        return help


def _says_nothing(default: object) -> bool:
    """A default not worth showing: none, a flag that is off, an empty list. (By identity: a
    default of 0 is shown, though ``0 == False``.)"""
    empty = isinstance(default, list | dict) and not default
    return default is None or default is False or default is argparse.SUPPRESS or empty
