"""The errors mlx-trio raises, one tree for every layer.

    MlxTrioError
    ├── InvalidRequestError          bad input; carries the offending ``param`` (OpenAI's shape)
    │   ├── ContextLengthExceededError   prompt (+ max_tokens) longer than the model's context
    │   ├── MemoryBudgetExceededError    prompt (+ max_tokens) whose KV can never fit the budget
    │   ├── UnknownAdapterError          a LoRA adapter the engine does not serve
    │   └── ImageError                   an image that cannot be used: not an image, over a
    │                                    limit, or sent to a model that takes none
    ├── ModelError                   anything about finding, importing or loading a model
    │   ├── ModelNotFoundError           no such file or directory
    │   ├── UnsupportedModelError        a format, architecture or quantization we cannot load
    │   ├── ModelImportError             download, checksum or conversion failed
    │   └── AdapterError                 a LoRA adapter that cannot be read or does not fit
    ├── EngineError                  the engine failed: a step inside MLX or mlx-lm, its warm-up
    │   └── EngineProcessError           the engine's process (or group of ranks) ended or
    │                                    could not start, or a reply of its would not pickle
    ├── SecondReaderError            a second task read a request's events (they have one reader)
    └── RuntimeRefusal               the runtime did not admit a request
        ├── OverloadedError              admission is full; carries ``retry_after_s``
        ├── EngineUnavailableError       the engine died and is restarting, or gave up
        └── RuntimeClosedError           the runtime is shutting down or closed

Every error carries a message fit to show a user as is: it never echoes a file path that the
user did not give us.

An ``InvalidRequestError``'s ``param`` names the request's part in the engine's own words: a
field of ``GenerationRequest`` or ``SamplingParams`` (``prompt``, whether text or chat
messages; ``max_tokens``; ``grammar``, whatever the API called the constraint; ...), and its
message starts with that name where it names one. Each API edge says what it calls each part
in one table and shows the error through :meth:`InvalidRequestError.renamed`: the OpenAI chat
endpoint's ``prompt`` is ``messages``, its ``grammar`` ``response_format``.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Mapping, Sequence


class MlxTrioError(Exception):
    """Base of every error mlx-trio raises on purpose."""

    code: str | None = None

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class InvalidRequestError(MlxTrioError, ValueError):
    """A request parameter is missing, malformed or out of range; ``param`` names it (see the
    module docstring)."""

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.param = param
        self.code = code

    def renamed(self, names: Mapping[str, str]) -> InvalidRequestError:
        """This error as an API shows it: ``param`` through ``names`` (an API's names for the
        engine's fields; a path into one, ``prompt[0].role``, renamed by its field), and the
        message's leading field name with it; the same error where ``names`` has no other name
        for it. The copy is of the same class."""
        if self.param is None:
            return self
        field = re.split(r"[.\[]", self.param, maxsplit=1)[0]
        name = names.get(field)
        if name is None or name == field:
            return self
        renamed = copy.copy(self)
        renamed.param = name + self.param.removeprefix(field)
        if self.message.startswith(field):
            renamed.message = name + self.message.removeprefix(field)
            renamed.args = (renamed.message,)
        return renamed


def check_at_least(owner: object, low: float, *names: str, above: bool = False) -> None:
    """Raise :class:`InvalidRequestError` naming the first of ``owner``'s ``names`` below
    ``low`` (``above``: not above it; None passes: absent); for the options' dataclasses, at
    construction."""
    for name in names:
        value = getattr(owner, name)
        if value is not None and not (value > low if above else value >= low):
            bound = "above" if above else "at least"
            raise InvalidRequestError(f"{name} must be {bound} {low:g}, got {value}", param=name)


class ContextLengthExceededError(InvalidRequestError):
    """The prompt does not fit in the model's context window. The counts, where known, are
    kept for an API that words the error its own way: ``num_prompt_tokens`` (or, where the
    prompt was refused before it was tokenized, ``num_chars``), the ``max_tokens`` asked for
    (None: the prompt alone is over) and the ``context_length``."""

    def __init__(
        self,
        message: str,
        *,
        param: str | None = "prompt",
        num_prompt_tokens: int | None = None,
        num_chars: int | None = None,
        max_tokens: int | None = None,
        context_length: int | None = None,
    ) -> None:
        super().__init__(message, param=param, code="context_length_exceeded")
        self.num_prompt_tokens = num_prompt_tokens
        self.num_chars = num_chars
        self.max_tokens = max_tokens
        self.context_length = context_length


class MemoryBudgetExceededError(InvalidRequestError):
    """The request's projected KV bytes exceed the server's whole KV pool: it could never be
    admitted, however long it waited (``param``: ``max_tokens``, or ``prompt``)."""

    def __init__(self, message: str, *, param: str | None = "max_tokens") -> None:
        super().__init__(message, param=param, code="memory_budget_exceeded")


class UnknownAdapterError(InvalidRequestError):
    """A request asked for a LoRA adapter the engine does not serve (``param``: ``adapter``;
    an API renames it to its own field: ``model``, or mlx_lm.server's ``adapters``)."""

    def __init__(self, name: str, served: Sequence[str]) -> None:
        names = ", ".join(repr(n) for n in served) or "none"
        super().__init__(
            f"adapter {name!r} is not served (served adapters: {names})",
            param="adapter",
            code="adapter_not_found",
        )
        self.name = name


class ImageError(InvalidRequestError):
    """An image part that cannot be used (``param``: the part, in its API's own words, e.g.
    ``messages[0].content[1]``; the message starts with it): data that is not an image, an
    image over a byte or pixel limit, a URL that may not be fetched, or any image sent to a
    model whose processor takes none."""

    def __init__(self, where: str, problem: str) -> None:
        super().__init__(f"{where}: {problem}", param=where, code="invalid_image")
        self.where = where


class ModelError(MlxTrioError):
    """A model could not be found, imported or loaded."""


class ModelNotFoundError(ModelError):
    code = "model_not_found"


class UnsupportedModelError(ModelError):
    code = "unsupported_model"


class ModelImportError(ModelError):
    code = "model_import_failed"


class EngineError(MlxTrioError):
    """The engine failed: a generation step raised inside MLX or mlx-lm, or its warm-up."""

    code = "engine_fault"


class EngineProcessError(EngineError):
    """The engine process ended (it crashed, or was killed) or could not start; or a reply of
    its would not pickle."""


class SecondReaderError(MlxTrioError):
    """A request's events have one reader, the task that read them first: another task's read
    raises this rather than take events the first reader would then miss."""

    code = "second_reader"


class RuntimeRefusal(MlxTrioError):
    """The runtime did not admit a request; nothing was queued or run."""


class OverloadedError(RuntimeRefusal):
    """Every live-session slot and queue slot is taken; try again after ``retry_after_s``."""

    code = "overloaded"

    def __init__(
        self, message: str, *, retry_after_s: float, live: int = 0, queued: int = 0
    ) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s
        self.live = live  # the gate's counts when it refused
        self.queued = queued


class EngineUnavailableError(RuntimeRefusal):
    """The engine is down: it died or wedged and is being restarted (try again after
    ``retry_after_s``), or it crashed too often and the supervisor gave up (``retry_after_s``
    None). Engine calls made meanwhile raise it too, and their rows fail ``engine_fault``."""

    code = "engine_unavailable"

    def __init__(self, message: str, *, retry_after_s: float | None = None) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class RuntimeClosedError(RuntimeRefusal):
    """The runtime is shutting down or closed and admits nothing new."""

    code = "shutting_down"


class AdapterError(ModelError):
    """A LoRA adapter that cannot be read, or does not fit its base model
    (``engine/model/adapters.py``); the message names the adapter and what does not fit."""

    code = "adapter_error"
