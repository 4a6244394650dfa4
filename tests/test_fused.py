"""Fused projections (engine/fused.py): one matmul for the projections that read one input.

What a user would notice if it were wrong: other tokens than mlx-lm's own forward gives, a
model that reports more memory, or a quantized model that breaks. The tiny random llama runs
in every quick run; the default model's greedy tokens through the batch engine are compared
in the e2e run.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx.utils import tree_flatten
from mlx_lm.models.cache import make_prompt_cache

from mlx_trio.engine import fused
from mlx_trio.engine.batch import BatchEngine
from mlx_trio.engine.generate import Engine
from mlx_trio.engine.outputs import RowOutput
from mlx_trio.engine.params import SamplingParams
from tests.tiny import make_model

VOCAB = 300


def greedy(model: nn.Module, prompts: list[list[int]], steps: int) -> tuple[mx.array, mx.array]:
    """Greedy tokens (rows, steps + 1) over mlx-lm's cache, and the prompt's last logits."""
    cache = make_prompt_cache(model)
    logits = model(mx.array(prompts), cache=cache)[:, -1, :]
    tokens = [mx.argmax(logits, axis=-1)]
    for _ in range(steps):
        tokens.append(mx.argmax(model(tokens[-1][:, None], cache=cache)[:, -1, :], axis=-1))
    return mx.stack(tokens, axis=1), logits


PROMPTS = [[5, 9, 23, 41, 7, 2], [100, 3, 3, 8, 250, 17], [1, 2, 3, 4, 5, 6]]


def test_fused_model_gives_mlx_lm_tokens_and_logits() -> None:
    plain, model = make_model(VOCAB), make_model(VOCAB)
    assert fused.fuse_projections(model) == 2
    want_tokens, want_logits = greedy(plain, PROMPTS, 12)
    tokens, logits = greedy(model, PROMPTS, 12)
    assert tokens.tolist() == want_tokens.tolist()
    assert mx.allclose(logits, want_logits, atol=1e-5).item()
    attn = model.model.layers[0].self_attn
    assert isinstance(attn.q_proj, fused.FusedLinear)
    # Every part was handed out: the group holds no activation until the next call.
    assert attn.q_proj._group._input is None


def test_fused_model_keeps_its_parameters_and_memory() -> None:
    plain, model = make_model(VOCAB), make_model(VOCAB)
    fused.fuse_projections(model)
    before = {k: v.shape for k, v in tree_flatten(plain.parameters())}
    after = {k: v.shape for k, v in tree_flatten(model.parameters())}
    assert after == before
    attn = model.model.layers[1].self_attn
    # The modules' weights are views of the one concatenation, not copies of it.
    group = attn.k_proj._group
    assert group.weight.shape[0] == sum(
        m.weight.shape[0] for m in (attn.q_proj, attn.k_proj, attn.v_proj)
    )
    assert mx.array_equal(attn.k_proj.weight, plain.model.layers[1].self_attn.k_proj.weight)


def test_a_quantized_model_is_left_as_it_is() -> None:
    model = make_model(VOCAB)
    nn.quantize(model, group_size=32, bits=8)
    assert fused.fuse_projections(model) == 0
    tokens, _ = greedy(model, PROMPTS[:1], 3)
    assert tokens.shape == (1, 4)


def test_the_default_is_on_for_a_gpu_and_the_environment_overrides_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv(fused.ENV, raising=False)
    assert fused.wanted("gpu") and not fused.wanted("cpu")
    assert fused.wanted("cpu", given=True) and not fused.wanted("gpu", given=False)
    monkeypatch.setenv(fused.ENV, "on")
    assert fused.wanted("cpu")
    monkeypatch.setenv(fused.ENV, "off")
    assert not fused.wanted("gpu")
    monkeypatch.setenv(fused.ENV, "sometimes")
    with pytest.raises(ValueError, match=fused.ENV):
        fused.wanted("gpu")


@pytest.mark.e2e
def test_default_model_batch_tokens_are_the_same_fused() -> None:
    """Four greedy rows of the default model through the batch engine, fused and not."""

    def run(engine: Engine) -> list[list[int]]:
        batch = BatchEngine(engine, max_batch=4)
        params = SamplingParams(temperature=0, max_tokens=24)
        prompts = ["The capital of France is", "def fib(n):", "Once upon a time", "1, 2, 3,"]
        rows = [batch.add(engine.prepare(p, params)) for p in prompts]
        tokens: dict[int, list[int]] = {r: [] for r in rows}
        while batch.num_rows:
            for event in batch.step(4):
                if isinstance(event, RowOutput):
                    tokens[event.row].extend(event.delta.token_ids)
        batch.close()
        return [tokens[r] for r in rows]

    plain = run(Engine.load(None, fuse=False))
    assert run(Engine.load(None, fuse=True)) == plain
    assert sum(len(t) for t in plain) > 24
