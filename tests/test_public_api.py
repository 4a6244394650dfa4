"""The in-process API's public names: all importable from ``mlx_trio.api``, and the README's
example imports from nowhere else."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

import mlx_trio.api

README = Path(__file__).parent.parent / "README.md"

# What users import. Taking a name away (or moving it without keeping it here) breaks them:
# this list changes only on purpose.
PUBLIC = {
    "open_runtime", "RuntimeHandle", "SessionHandle", "Collected", "RuntimeConfig", "EngineOptions",
    "RuntimeStatistics", "freeze_startup_heap",
    "GenerationRequest", "SamplingParams", "SamplingDefaults", "ChatMessage",
    "Grammar", "Chat", "Tool", "ToolCall", "ToolChoice", "call_grammar",
    "ReplySyntax", "ReplySplitter", "Content", "Reasoning", "Called",
    "TextDelta", "Progress", "Completed", "Cancelled", "Failed", "Event", "Outcome",
    "CancelReason", "FinishReason", "Usage", "Timings", "TokenLogprob",
    "MlxTrioError", "InvalidRequestError", "ContextLengthExceededError", "RuntimeRefusal",
    "OverloadedError", "RuntimeClosedError", "EngineError", "EngineUnavailableError",
    "ModelError",
    "ModelNotFoundError", "UnsupportedModelError", "ModelImportError", "SecondReaderError",
    "AdapterSpec", "AdapterInfo", "AdapterError", "UnknownAdapterError",
}  # fmt: skip


def test_every_public_name_is_exported_and_importable():
    assert set(mlx_trio.api.__all__) == PUBLIC
    for name in PUBLIC:
        assert getattr(mlx_trio.api, name) is not None


def test_the_readme_imports_only_from_the_public_surface():
    imports = re.findall(r"^from (mlx_trio[\w.]*) import", README.read_text(), flags=re.M)
    assert imports and set(imports) == {"mlx_trio.api"}


async def test_open_runtime_sorts_its_keywords_into_the_engines_options_and_the_runtimes():
    """``open_runtime``'s keywords are ``EngineOptions`` and ``RuntimeConfig`` fields; any
    other is a TypeError naming it, raised before a model loads."""
    from mlx_trio.actors.testing.scripted import ScriptedEngine

    with pytest.raises(TypeError, match=r"^open_runtime\(\) got unknown keyword arguments: bogus$"):
        async with mlx_trio.api.open_runtime(bogus=1):
            pass
    with pytest.raises(mlx_trio.api.InvalidRequestError, match=r"^max_batch must be at least 1"):
        async with mlx_trio.api.open_runtime(max_batch=0):
            pass
    async with mlx_trio.api.open_runtime(engine=ScriptedEngine(), max_batch=3) as rt:
        assert rt.config == mlx_trio.api.RuntimeConfig(max_batch=3)
