"""Models built in memory: a llama with seeded random weights and a byte-level BPE tokenizer.

Nothing is downloaded or read from disk, so tests and benchmarks run anywhere. Two users, one
recipe: the tests' tiny llama (``tests/tiny.py``: float32, a few hundred ids, a chat template)
and the benchmark's Llama-3.2-1B shape (``mlx_trio.api.bench.models``: bfloat16 or 4-bit, 128,256
ids). Random weights cost what trained ones of the same shape cost per step, which is all a
throughput benchmark or a test of the runtime's plumbing needs. :func:`in_memory` wraps the two
in the ``LoadedModel`` an ``Engine`` takes, as a checkpoint loaded by ``loader`` would be.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from pathlib import Path

from .. import _blas  # noqa: F401  (loads OpenBLAS: before MLX below)

# isort: split
import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import llama
from mlx_lm.tokenizer_utils import BPEStreamingDetokenizer, TokenizerWrapper
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from .loader import LoadedModel


def byte_level_tokenizer(
    extra_tokens: Iterable[str],
    specials: Sequence[str],
    *,
    eos_token: str,
    bos_token: str | None = None,
    merges: Sequence[tuple[str, str]] = (),
    chat_template: str | None = None,
) -> TokenizerWrapper:
    """Byte-level BPE: ids 0-255 the byte symbols, then ``extra_tokens`` in order, then
    ``specials``; ``merges`` (pairs whose joined token is among ``extra_tokens``) in order.

    With no merges an extra token is only ever decoded, never produced by encoding: a way to a
    real model's vocabulary size without a real vocabulary.
    """
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {symbol: i for i, symbol in enumerate(alphabet)}
    for token in extra_tokens:
        vocab[token] = len(vocab)
    backend = Tokenizer(models.BPE(vocab=vocab, merges=list(merges)))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens(list(specials))
    hf = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token=bos_token,
        eos_token=eos_token,
        chat_template=chat_template,
    )
    return TokenizerWrapper(hf, detokenizer_class=BPEStreamingDetokenizer)


def random_llama(
    args: llama.ModelArgs,
    *,
    seed: int = 0,
    dtype: mx.Dtype | None = None,
    quantize_bits: int | None = None,
) -> llama.Model:
    """A llama of ``args`` with mlx-lm's initial weights from ``seed``, evaluated.

    ``dtype``: the weights' type (MLX's default float32 if None); ``quantize_bits``: then
    quantized with ``mlx.nn.quantize`` in groups of 64, mlx-lm's default.
    """
    mx.random.seed(seed)
    model = llama.Model(args)
    if dtype is not None:
        model.set_dtype(dtype)
    if quantize_bits is not None:
        nn.quantize(model, group_size=64, bits=quantize_bits)
    mx.eval(model.parameters())
    return model


def in_memory(
    model: nn.Module,
    tokenizer: TokenizerWrapper,
    model_id: str,
    *,
    dtype: str,
    is_quantized: bool,
    context_length: int,
    device: str,
) -> LoadedModel:
    """``model`` and ``tokenizer`` as a loaded model (its path ``.``: there is no folder)."""
    return LoadedModel(
        model=model,
        tokenizer=tokenizer,
        model_id=model_id,
        path=Path("."),
        dtype=dtype,
        is_quantized=is_quantized,
        context_length=context_length,
        device=device,
    )


def random_adapter(
    model: nn.Module, out: Path, *, seed: int, rank: int, keys: Sequence[str], layers: int = 8
) -> Path:
    """An mlx-lm LoRA adapter directory for ``model``'s shape in ``out``, as ``mlx_lm.lora``
    saves one (its config, and ``lora_a`` and ``lora_b`` for the linears named by ``keys``,
    such as ``self_attn.q_proj``, of the last ``layers`` layers), with seeded random weights
    (a fresh adapter's ``lora_b`` is zero: it would change nothing). ``model`` is only read."""
    from mlx.utils import tree_flatten

    from .adapters import linear_dims

    mx.random.seed(seed)
    blocks = model.layers[-layers:]
    first = len(model.layers) - len(blocks)
    prefix = next(
        name.removesuffix(".0") for name, m in model.named_modules() if m is model.layers[0]
    )
    weights = {}
    for index, block in enumerate(blocks, start=first):
        linears = dict(tree_flatten(block.leaf_modules(), is_leaf=nn.Module.is_module))
        for key in keys:
            inputs, outputs = linear_dims(linears[key])
            name = f"{prefix}.{index}.{key}"
            weights[f"{name}.lora_a"] = mx.random.normal((inputs, rank)) * 0.05
            weights[f"{name}.lora_b"] = mx.random.normal((rank, outputs)) * 0.05
    out.mkdir(parents=True)
    mx.save_safetensors(str(out / "adapters.safetensors"), weights)
    parameters = {"rank": rank, "scale": 10.0, "dropout": 0.0, "keys": list(keys)}
    config = {"fine_tune_type": "lora", "num_layers": layers, "lora_parameters": parameters}
    (out / "adapter_config.json").write_text(json.dumps(config))
    return out
