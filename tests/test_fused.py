"""Fused projections (engine/model/fused.py): one matmul for the projections that read one input.

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

from mlx_trio.engine.batch.batch import BatchEngine
from mlx_trio.engine.errors import InvalidRequestError
from mlx_trio.engine.generate import Engine
from mlx_trio.engine.model import fused
from mlx_trio.engine.outputs import RowOutput
from mlx_trio.engine.params import SamplingParams
from tests.tiny import TOKEN_PROMPTS, greedy, make_model

VOCAB = 300


@pytest.mark.parametrize("bias", [False, True], ids=["no biases", "biases"])
def test_fused_model_gives_mlx_lm_tokens_and_logits(bias: bool) -> None:
    plain, model = make_model(VOCAB, bias=bias), make_model(VOCAB, bias=bias)
    assert fused.fuse_projections(model) == 2
    want_tokens, want_logits = greedy(plain, TOKEN_PROMPTS, 12)
    tokens, logits = greedy(model, TOKEN_PROMPTS, 12)
    assert tokens.tolist() == want_tokens.tolist()
    assert mx.allclose(logits, want_logits, atol=1e-5).item()
    attn = model.model.layers[0].self_attn
    assert isinstance(attn.q_proj, fused.FusedLinear)
    # Every part was handed out: the group holds no activation until the next call.
    assert attn.q_proj.group._input is None


def test_fused_model_keeps_its_parameters_as_views() -> None:
    plain, model = make_model(VOCAB), make_model(VOCAB)
    fused.fuse_projections(model)
    before = {k: v.shape for k, v in tree_flatten(plain.parameters())}
    after = {k: v.shape for k, v in tree_flatten(model.parameters())}
    assert after == before
    attn, plain_attn = model.model.layers[1].self_attn, plain.model.layers[1].self_attn
    group = attn.k_proj.group
    assert group.weight.shape[0] == sum(
        m.weight.shape[0] for m in (attn.q_proj, attn.k_proj, attn.v_proj)
    )
    assert mx.array_equal(attn.k_proj.weight, plain_attn.k_proj.weight)


def test_a_projection_called_alone_or_twice_gives_its_own_output() -> None:
    plain, model = make_model(VOCAB, bias=True), make_model(VOCAB, bias=True)
    fused.fuse_projections(model)
    attn, plain_attn = model.model.layers[0].self_attn, plain.model.layers[0].self_attn
    x = mx.random.normal((2, 3, 64))
    assert mx.allclose(attn.v_proj(x), plain_attn.v_proj(x), atol=1e-5).item()
    assert mx.allclose(attn.v_proj(x), plain_attn.v_proj(x), atol=1e-5).item()
    assert mx.allclose(attn.q_proj(x), plain_attn.q_proj(x), atol=1e-5).item()


def test_weights_replaced_after_fusing_are_the_ones_used() -> None:
    """``update`` (or loading weights, or a dtype change) after fusing: the modules compute
    with the new weights, on their own."""
    plain, model = make_model(VOCAB), make_model(VOCAB)
    fused.fuse_projections(model)
    other = make_model(VOCAB, seed=1)
    model.update(other.parameters())
    plain.update(other.parameters())
    want, _ = greedy(plain, TOKEN_PROMPTS, 6)
    got, _ = greedy(model, TOKEN_PROMPTS, 6)
    assert got.tolist() == want.tolist()
    assert got.tolist() != greedy(make_model(VOCAB), TOKEN_PROMPTS, 6)[0].tolist()


def test_a_quantized_model_or_another_model_type_is_left_as_it_is() -> None:
    model = make_model(VOCAB)
    nn.quantize(model, group_size=32, bits=8)
    assert fused.fuse_projections(model) == 0
    tokens, _ = greedy(model, TOKEN_PROMPTS[:1], 3)
    assert tokens.shape == (1, 4)
    other = make_model(VOCAB)
    other.model_type = "some_new_model"
    assert fused.fuse_projections(other) == 0
    assert type(other.model.layers[0].self_attn.q_proj) is nn.Linear


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
    with pytest.raises(InvalidRequestError, match=fused.ENV):
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
