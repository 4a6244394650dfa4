"""Quantized weights dequantized at load (engine/model/dequantize.py), CUDA's default.

What a user would notice if it were wrong: other tokens than the quantized model gives, a
memory figure that does not match what the weights take, or a model dequantized where it does
not fit (or off CUDA). The policy's CUDA branch needs CUDA; its parts run here on the tiny
random llama.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx.utils import tree_flatten

from mlx_trio.engine.errors import InvalidRequestError
from mlx_trio.engine.model import dequantize
from mlx_trio.engine.model.random_model import in_memory
from tests.tiny import TOKEN_PROMPTS, greedy, make_model, make_tokenizer

VOCAB = 300


def quantized_loaded(device: str = "gpu", bits: int = 4):
    model = make_model(VOCAB)
    nn.quantize(model, group_size=32, bits=bits)
    mx.eval(model.parameters())
    return in_memory(
        model,
        make_tokenizer(),
        "tiny-q",
        dtype="float32",
        is_quantized=True,
        context_length=512,
        device=device,
    )


def test_dequantized_weights_give_the_quantized_models_tokens_and_logits() -> None:
    loaded = quantized_loaded()
    tokens, logits = greedy(loaded.model, TOKEN_PROMPTS, 8)
    plain = dequantize.dequantize(loaded)
    assert not plain.is_quantized
    assert plain.weights == "float32, dequantized from 4-bit at load"
    assert not any("scales" in m for _, m in plain.model.named_modules())
    plain_tokens, plain_logits = greedy(plain.model, TOKEN_PROMPTS, 8)
    assert mx.array_equal(tokens, plain_tokens)
    assert mx.allclose(logits, plain_logits, atol=1e-4)


def test_the_dequantized_size_is_what_the_plain_layers_take() -> None:
    loaded = quantized_loaded(bits=8)
    expected = dequantize.dequantized_bytes(loaded.model)
    quantized_names = {
        name for name, m in loaded.model.named_modules() if "scales" in m and hasattr(m, "bits")
    }
    plain = dequantize.dequantize(loaded).model
    weights = dict(tree_flatten(plain.parameters()))
    assert expected == sum(weights[f"{name}.weight"].nbytes for name in quantized_names)
    assert expected > 0


def test_the_policy_dequantizes_on_cuda_only_and_the_environment_overrides_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv(dequantize.ENV, raising=False)
    loaded = quantized_loaded()
    plain = dequantize.dequantize(quantized_loaded())
    # A model that is not quantized never is; off CUDA (this machine) the default keeps it.
    assert not dequantize.wanted(plain, given=True)
    assert dequantize.wanted(loaded) == mx.cuda.is_available()
    assert not dequantize.wanted(quantized_loaded(device="cpu"))
    assert dequantize.wanted(loaded, given=True) and not dequantize.wanted(loaded, given=False)
    monkeypatch.setenv(dequantize.ENV, "on")
    assert dequantize.wanted(quantized_loaded(device="cpu"))
    monkeypatch.setenv(dequantize.ENV, "off")
    assert not dequantize.wanted(loaded)
    monkeypatch.setenv(dequantize.ENV, "sometimes")
    with pytest.raises(InvalidRequestError, match=dequantize.ENV):
        dequantize.wanted(loaded)


def test_on_cuda_a_model_too_large_to_dequantize_keeps_its_form(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv(dequantize.ENV, raising=False)
    monkeypatch.setattr(dequantize.mx.cuda, "is_available", lambda: True)
    loaded = quantized_loaded()
    size = dequantize.dequantized_bytes(loaded.model)
    # Dequantized, the weights would take 0.4 of the GPU's memory (at most half may): done.
    monkeypatch.setattr(dequantize, "device_memory_bytes", lambda on_gpu: int(size / 0.4))
    assert dequantize.wanted(loaded)
    monkeypatch.setattr(dequantize, "device_memory_bytes", lambda on_gpu: int(size / 0.6))
    assert not dequantize.wanted(loaded)
