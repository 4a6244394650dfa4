"""A tiny random llama and a byte-level BPE tokenizer, built in memory (no download)."""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
from mlx_lm.models import llama
from mlx_lm.tokenizer_utils import BPEStreamingDetokenizer, TokenizerWrapper
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from mlx_trio.engine.errors import UnsupportedModelError
from mlx_trio.engine.generate import Engine, RequestPreparer
from mlx_trio.engine.loader import LoadedModel

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def make_tokenizer() -> TokenizerWrapper:
    """Byte-level BPE over the 256 bytes plus a few merges; ``<|im_end|>`` ends a turn."""
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    merges = [("Ġ", "t"), ("h", "e"), ("Ġt", "he"), ("i", "n")]
    for a, b in merges:
        vocab[a + b] = len(vocab)
    backend = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens(SPECIALS)
    hf = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        eos_token="<|im_end|>",
        bos_token=None,
        chat_template=CHAT_TEMPLATE,
    )
    return TokenizerWrapper(hf, detokenizer_class=BPEStreamingDetokenizer)


def make_model(vocab_size: int, *, seed: int = 0) -> llama.Model:
    args = llama.ModelArgs(
        model_type="llama",
        hidden_size=64,
        num_hidden_layers=2,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        rms_norm_eps=1e-5,
        vocab_size=vocab_size,
        tie_word_embeddings=False,
        max_position_embeddings=512,
    )
    mx.random.seed(seed)
    model = llama.Model(args)
    # Unit-scale embeddings and an untied head make greedy decoding wander instead of
    # repeating one token, so tests see varied text.
    model.update({"model": {"embed_tokens": {"weight": mx.random.normal((vocab_size, 64))}}})
    mx.eval(model.parameters())
    return model


def make_loaded(context_length: int = 512) -> LoadedModel:
    tokenizer = make_tokenizer()
    return LoadedModel(
        model=make_model(len(tokenizer)),
        tokenizer=tokenizer,
        model_id="tiny-llama",
        path=Path("."),
        dtype="float32",
        is_quantized=False,
        context_length=context_length,
        device="cpu",
    )


def build_engine() -> Engine:
    """The tiny engine, built where it runs: an engine process's ``build`` (it pickles)."""
    return Engine(make_loaded(), prefill_step_size=16)


def make_preparer() -> RequestPreparer:
    """The parent's side of a tiny engine process: its tokenizer."""
    return RequestPreparer(make_tokenizer(), 512)


def build_nothing() -> Engine:
    """An engine process's ``build`` that fails as a model that cannot load does."""
    raise UnsupportedModelError("model type 'nothing' is not supported by mlx-lm")
