"""A tiny random llama and a byte-level BPE tokenizer, built in memory (no download).

The recipe is ``mlx_trio.engine.model.random_model``'s, which the benchmark's model shares; what is
the tests' own is the size, the few merges and the chat template.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import llama
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.tokenizer_utils import TokenizerWrapper

from mlx_trio.engine.batch.batch import BatchEngine
from mlx_trio.engine.errors import UnsupportedModelError
from mlx_trio.engine.generate import Engine
from mlx_trio.engine.model.loader import LoadedModel
from mlx_trio.engine.model.random_model import byte_level_tokenizer, in_memory, random_llama
from mlx_trio.engine.outputs import RowOutput
from mlx_trio.engine.params import SamplingParams
from mlx_trio.engine.preparer import RequestPreparer

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MERGES = [("Ġ", "t"), ("h", "e"), ("Ġt", "he"), ("i", "n")]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def make_tokenizer() -> TokenizerWrapper:
    """Byte-level BPE over the 256 bytes plus a few merges; ``<|im_end|>`` ends a turn."""
    return byte_level_tokenizer(
        [a + b for a, b in MERGES],
        SPECIALS,
        eos_token="<|im_end|>",
        merges=MERGES,
        chat_template=CHAT_TEMPLATE,
    )


def make_model(vocab_size: int, *, seed: int = 0, bias: bool = False) -> llama.Model:
    """``bias``: the attention and MLP projections have biases (as Qwen2's query, key and
    value projections do)."""
    args = llama.ModelArgs(
        attention_bias=bias,
        mlp_bias=bias,
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
    model = random_llama(args, seed=seed)
    # Unit-scale embeddings and an untied head make greedy decoding wander instead of
    # repeating one token, so tests see varied text.
    model.update({"model": {"embed_tokens": {"weight": mx.random.normal((vocab_size, 64))}}})
    mx.eval(model.parameters())
    return model


def make_loaded(context_length: int = 512) -> LoadedModel:
    tokenizer = make_tokenizer()
    model = make_model(len(tokenizer))
    return in_memory(
        model,
        tokenizer,
        "tiny-llama",
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


# Token prompts for the model-level tests (a vocabulary of at least 300).
TOKEN_PROMPTS = [[5, 9, 23, 41, 7, 2], [100, 3, 3, 8, 250, 17], [1, 2, 3, 4, 5, 6]]


def greedy(model: nn.Module, prompts: list[list[int]], steps: int) -> tuple[mx.array, mx.array]:
    """Greedy tokens (rows, steps + 1) of ``model`` over mlx-lm's cache, and the logits after
    the prompts."""
    cache = make_prompt_cache(model)
    logits = model(mx.array(prompts), cache=cache)[:, -1, :]
    tokens = [mx.argmax(logits, axis=-1)]
    for _ in range(steps):
        tokens.append(mx.argmax(model(tokens[-1][:, None], cache=cache)[:, -1, :], axis=-1))
    return mx.stack(tokens, axis=1), logits


# Two prompts of different lengths: a batch of them is left-padded, so it attends under a mask.
UNEVEN_PROMPTS = ["in the beginning", "the cat sat on the mat and looked at the door for a while"]


def batch_tokens(engine: Engine, prompts: list[str], max_tokens: int = 8) -> list[list[int]]:
    """The greedy tokens of ``prompts`` generated together by a batch engine (no solo row)."""
    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    batch = BatchEngine(engine, max_batch=4, solo=False)
    rows = [batch.add(engine.prepare(p, params)) for p in prompts]
    out: dict[int, list[int]] = {row: [] for row in rows}
    while batch.num_rows:
        for event in batch.step():
            if isinstance(event, RowOutput):
                out[event.row].extend(event.delta.token_ids)
    batch.close()
    return [out[row] for row in rows]
