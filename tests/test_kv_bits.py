"""Quantized KV caches that batch (``--kv-bits``, issue 40): the default model's rows keep their
keys and values in 4 or 8 bits in mlx-lm's batch, give mlx-lm's own quantized-cache generation,
hold a fraction of the bytes, and the memory budget counts what they really hold."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import replace

import mlx.core as mx
import pytest
import trio
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import QuantizedKVCache

from mlx_trio.actors.messages import Completed, GenerationRequest
from mlx_trio.api.inprocess import open_runtime
from mlx_trio.engine.batch.batch import BatchEngine
from mlx_trio.engine.batch.quantized_kv import BatchQuantizedKVCache, KVScheme, QuantizedRowCache
from mlx_trio.engine.errors import InvalidRequestError
from mlx_trio.engine.generate import Engine
from mlx_trio.engine.options import EngineOptions
from mlx_trio.engine.params import SamplingParams
from mlx_trio.engine.vocabulary.prompt import ChatMessage
from tests.test_engine import run_batch

pytestmark = pytest.mark.e2e

GREEDY = SamplingParams(temperature=0, max_tokens=16)
# Prompts whose greedy replies have no near-tie in their first tokens: a batched forward's
# sums differ from a lone row's in the last bits, and quantizing keys can turn a tie of 0.01 in
# the logits either way (one, "What is the capital of France?", did).
PROMPTS = (
    "Tell me a story about a cat.",
    "List three fruits.",
    "Why is the sky blue? Explain it to a child in detail please.",
)


FIRST = 8  # tokens of a batched row that must be mlx-lm's


def chat(text: str) -> tuple[ChatMessage, ...]:
    return (ChatMessage("user", text),)


@pytest.fixture(scope="module")
def engine() -> Engine:
    """4 bits, where quantization moves the numbers most (8 bits: the bytes test below)."""
    return Engine.load(None, device="cpu", prompt_cache_bytes=1 << 28, kv_scheme=KVScheme(4, 64))


def mlx_lm_quantized(engine: Engine, text: str) -> list[int]:
    """mlx-lm's ``generate_step`` with ``kv_bits`` from the first token on, greedy, up to a
    stop: it prefills the prompt (one chunk) unquantized, then keeps the cache quantized."""
    prompt = engine.prepare(chat(text), GREEDY).prompt_tokens
    steps = generate_step(
        mx.array(prompt),
        engine.model,
        max_tokens=16,
        kv_bits=engine.kv_scheme.bits,
        kv_group_size=64,
        quantized_kv_start=0,
    )
    tokens = [int(token) for token, _ in steps]
    stops = {engine.tokenizer.eos_token_id, *engine.tokenizer.eos_token_ids}
    return tokens[: next((i for i, t in enumerate(tokens) if t in stops), len(tokens))]


def test_quantized_rows_batch_and_give_mlx_lms_quantized_generation(engine):
    """Batched, each row's reply starts as mlx-lm's quantized generation of its prompt alone
    (past a few tokens a near-tie may go the other way: the batch's sums differ in the last
    bits, quantization rounds them apart); the serial lane's is the same, token for token."""
    assert engine.caches.batch_mode == "batch"
    want = [mlx_lm_quantized(engine, text) for text in PROMPTS]
    batch = BatchEngine(engine, max_batch=8)
    rows = [batch.add(engine.prepare(chat(text), GREEDY)) for text in PROMPTS]
    batch.step()
    assert {type(c) for c in batch._batch._generator._prompt_batch.prompt_cache} <= {
        BatchQuantizedKVCache
    }
    got = run_batch(batch)
    for row, tokens in zip(rows, want, strict=True):
        assert got[row][:FIRST] == tokens[:FIRST] and len(tokens) >= FIRST
    # A salt of its own: the batch left this prompt in the prompt cache.
    request = replace(engine.prepare(chat(PROMPTS[1]), GREEDY), cache_salt="serial")
    serial = [t for d in engine.generate(request) for t in d.token_ids]
    assert serial == want[1]


def test_quantized_rows_hold_a_fraction_of_the_bytes_and_the_budget_counts_it():
    """The same rows after the same steps: 4 bits hold at most 0.3x of float32's KV bytes,
    8 bits 0.55x; the memory budget's bytes a token say the same, so it admits more rows."""
    held, per_token = {}, {}
    for bits in (None, 4, 8):
        engine = Engine.load(None, device="cpu", kv_scheme=KVScheme(bits, 64), memory_limit=2 << 30)
        batch = BatchEngine(engine, max_batch=8)
        for text in PROMPTS:
            batch.add(engine.prepare(chat(text), GREEDY))
        for _ in range(4):
            batch.step()
        held[bits] = batch.kv_bytes
        assert engine.model_memory is not None
        per_token[bits] = engine.model_memory.kv_bytes_per_token
    assert held[4] <= 0.3 * held[None] and held[8] <= 0.55 * held[None], held
    assert per_token[4] <= 0.3 * per_token[None] and per_token[8] <= 0.55 * per_token[None]


def test_a_quantized_prompt_cache_hit_is_reused(engine):
    prompt = replace(
        engine.prepare(chat("Name three colours of the rainbow, please."), GREEDY),
        cache_salt="colours",  # apart from the other tests' entries
    )
    first = engine.generate(prompt)
    text = "".join(d.text for d in first)
    again = engine.generate(prompt)
    assert "".join(d.text for d in again) == text
    assert first.stats().cached_tokens == 0
    assert again.stats().cached_tokens >= len(prompt.prompt_tokens) - 1


def test_the_runtime_serves_kv_bits_and_says_so():
    async def main() -> tuple[str, object]:
        async with open_runtime(device="cpu", kv_bits=4, max_batch=4) as rt:
            collected = await rt.collect(GenerationRequest(chat(PROMPTS[0]), GREEDY))
            return rt.kv_scheme, collected.outcome

    scheme, outcome = trio.run(main)
    assert scheme == "KV quantized to 4 bits, groups of 64"
    assert isinstance(outcome, Completed)
    with pytest.raises(InvalidRequestError, match="kv_bits must be one of 4, 8, got 3"):
        EngineOptions(kv_bits=3)


def test_a_group_size_the_head_does_not_divide_is_one_line():
    flags = ("--kv-bits", "4", "--kv-group-size", "128")
    done = subprocess.run(
        [sys.executable, "-m", "mlx_trio.api.cli", "generate", "hi", *flags],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode != 0
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("mlx-trio: error: --kv-bits 4 with groups of 128 does not fit"), last


def random_kv(length: int, seed: int) -> tuple[mx.array, mx.array]:
    keys = mx.random.normal((1, 2, length, 64), key=mx.random.key(seed))
    return keys, -keys


def quantized(length: int, seed: int) -> QuantizedRowCache:
    cache = QuantizedRowCache(group_size=64, bits=4)
    cache.update_and_fetch(*random_kv(length, seed))
    return cache


def same(a: QuantizedKVCache, b: QuantizedKVCache) -> bool:
    """Whether two one-row caches hold the same tokens, bit for bit."""
    if a.offset != b.offset:
        return False
    pairs = zip((*a.keys, *a.values), (*b.keys, *b.values), strict=True)
    return all(mx.array_equal(x[..., : a.offset, :], y[..., : b.offset, :]) for x, y in pairs)


def test_the_batch_cache_keeps_each_rows_tokens_through_merge_step_filter_and_extend():
    """Rows of 5, 9 and 3 tokens merged (left-padded), a step of one token each, one row
    filtered out, another batch extended in: every row extracted holds exactly what a lone
    mlx-lm cache fed the same keys and values holds."""
    lengths = (5, 9, 3)
    lone = [quantized(n, seed) for seed, n in enumerate(lengths)]
    batch = lone[0].merge([quantized(n, seed) for seed, n in enumerate(lengths)])
    step_keys = mx.random.normal((3, 2, 1, 64), key=mx.random.key(7))
    batch.update_and_fetch(step_keys, -step_keys)
    for row, cache in enumerate(lone):
        cache.update_and_fetch(step_keys[row : row + 1], -step_keys[row : row + 1])
        assert same(batch.extract(row), cache), row
    batch.filter([0, 2])
    other = quantized(12, 9)
    batch.extend(other.merge([quantized(12, 9)]))
    for row, cache in enumerate([lone[0], lone[2], other]):
        assert same(batch.extract(row), cache), row
    assert batch.nbytes > 0
