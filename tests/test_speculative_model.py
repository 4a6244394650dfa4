"""Both speculative methods on the real default model, in process (serial lane): greedy text
with a stop string equals plain steps'. The draft model is the model itself (one load), which
accepts every draft it makes."""

from __future__ import annotations

from dataclasses import replace

import pytest

from bench.speculative import TEXT
from mlx_trio.engine.generate import Engine
from mlx_trio.engine.params import SamplingParams, Speculation

pytestmark = pytest.mark.e2e

REWRITE = [{"role": "user", "content": f"Repeat this text: {' '.join(TEXT.split()[:60])}"}]


PARAMS = SamplingParams(temperature=0, max_tokens=24)


@pytest.fixture(scope="module")
def engine() -> Engine:
    plain = Engine.load(None, device="cpu")
    return Engine(plain.loaded, draft=plain.loaded)


@pytest.fixture(scope="module")
def text(engine: Engine) -> str:
    """The greedy rewrite with plain steps."""
    return "".join(d.text for d in engine.generate(engine.prepare(REWRITE, PARAMS)))


@pytest.mark.parametrize("method", ["prompt_lookup", "draft_model"])
def test_greedy_text_with_a_stop_string_equals_plain_steps(engine, text, method):
    stop = text[len(text) // 2 :][:5]
    stopped = replace(PARAMS, stop=(stop,), speculative=Speculation(method, num_draft_tokens=4))
    generation = engine.generate(engine.prepare(REWRITE, stopped))
    deltas = list(generation)
    assert "".join(d.text for d in deltas) == text[: text.index(stop)]
    assert deltas[-1].finish_reason == "stop"
    stats = generation.stats()
    assert stats.drafted_tokens > 0
    if method == "draft_model":
        assert stats.accepted_tokens == stats.drafted_tokens
