"""The error tree holds: what engine/ and actors/ raise on purpose is an ``MlxTrioError``, and
the options refuse a bad value at construction with the field named."""

from __future__ import annotations

import ast
import builtins
from pathlib import Path

import pytest

from mlx_trio.actors.config import RuntimeConfig
from mlx_trio.engine.errors import InvalidRequestError
from mlx_trio.engine.options import EngineOptions

ROOT = Path(__file__).resolve().parent.parent

# Raises of Python's own exceptions that are a contract with a caller in this code, caught
# there, never a user's to see (path, exception): each says why.
INTERNAL = {
    # OpenBLAS's loading and the ELF patcher behind it: caught where it loads, which then
    # warns and leaves MLX on its reference BLAS
    ("engine/_blas.py", "OSError"),
    ("engine/_elf.py", "ValueError"),
    # mlx-lm's tool parsers' protocol: the caller takes ValueError as "not a call"
    ("engine/vocabulary/tools.py", "ValueError"),
    # a missing member of a model package, caught beside it and raised as ModelImportError
    ("engine/model/model_store.py", "KeyError"),
    # fault injection: the out-of-memory error MLX raises, injected as MLX would raise it
    ("actors/testing/faulty.py", "MemoryError"),
    # a quantized cache's prompt chunk: ``bits`` absent to mlx-lm's attention's ``hasattr``, once
    ("engine/batch/quantized_kv.py", "AttributeError"),
}
# Python's exceptions that say a caller broke a contract or an invariant, not a user's input.
PROGRAMMING = {"AssertionError", "NotImplementedError", "StopIteration", "StopAsyncIteration"}


def builtin_raises() -> list[tuple[str, int, str]]:
    """(path, line, exception) of each ``raise X(...)`` or ``raise X`` of a builtin exception
    in engine/ and actors/."""
    found = []
    for folder in ("engine", "actors"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
                if not isinstance(node, ast.Raise) or node.exc is None:
                    continue
                raised = node.exc.func if isinstance(node.exc, ast.Call) else node.exc
                name = raised.id if isinstance(raised, ast.Name) else None
                exception = getattr(builtins, name or "", None)
                if isinstance(exception, type) and issubclass(exception, BaseException):
                    found.append((str(path.relative_to(ROOT)), node.lineno, name or ""))
    return found


def test_engine_and_actors_raise_only_the_error_tree_on_purpose():
    assert builtin_raises(), "the scan finds nothing: it would pass whatever the code raised"
    leaks = [
        f"{path}:{line}: {name}"
        for path, line, name in builtin_raises()
        if name not in PROGRAMMING and (path, name) not in INTERNAL
    ]
    assert leaks == []


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: RuntimeConfig(max_batch=0), "max_batch must be at least 1, got 0"),
        (lambda: RuntimeConfig(max_queued=-1), "max_queued must be at least 0, got -1"),
        (lambda: RuntimeConfig(idle_timeout_s=0), "idle_timeout_s must be above 0, got 0"),
        (
            lambda: EngineOptions(max_iteration_tokens=0),
            "max_iteration_tokens must be at least 1, got 0",
        ),
        (
            lambda: EngineOptions(prompt_cache_bytes=-1),
            "prompt_cache_bytes must be at least 0, got -1",
        ),
        (lambda: EngineOptions(device="tpu"), "device must be auto, cpu or gpu, got 'tpu'"),  # type: ignore[arg-type]
    ],
)
def test_options_refuse_a_bad_value_naming_the_field(make, message):
    with pytest.raises(InvalidRequestError, match=f"^{message}$") as refused:
        make()
    assert message.startswith(refused.value.param)


def test_renamed_gives_an_errors_field_and_message_the_apis_names():
    error = InvalidRequestError("prompt[2].content must be a string", param="prompt[2].content")
    chat = error.renamed({"prompt": "messages"})
    assert (chat.param, chat.message) == (
        "messages[2].content",
        "messages[2].content must be a string",
    )
    assert str(chat) == chat.message
    assert error.renamed({"grammar": "response_format"}) is error  # no other name: itself
    assert (error.param, error.message) == (
        "prompt[2].content",
        "prompt[2].content must be a string",
    )
