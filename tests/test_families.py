"""Every mlx-lm family users serve gives mlx-lm's own greedy text on every path (issue 35).

A tiny random model of each family (``tests/families.py``), greedy: the batch lane (four rows
at once, one of them a repeat), the serial lane, a lone row in the batch, and a prompt-cache hit
each give the tokens mlx-lm's ``generate_step`` gives for the same prompt. The recurrent
families (Qwen3.5, Qwen3-Next, Mamba2) were an HTTP 500 (``'ArraysCache' object has no
attribute 'offset'``): their caches cannot rewind, so their rows are never parked or handed to
the solo row, and a repeat of a request reuses the checkpoint stored at its prompt's end.
Then the whole server on a checkpoint folder of a hybrid model, and a model whose caches cannot
batch, on the serial lane.
"""

from __future__ import annotations

import concurrent.futures
import hashlib
from pathlib import Path
from typing import Any

import httpx
import mlx.nn as nn
import numpy as np
import openai
import pytest
import trio
from mlx.utils import tree_flatten
from mlx_lm.models.cache import ConcatenateKVCache

from mlx_trio.actors.config import RuntimeConfig
from mlx_trio.actors.engine_port.thread import EngineThread, ThreadedEngine
from mlx_trio.actors.messages import Completed, GenerationRequest
from mlx_trio.api.inprocess import Collected, RuntimeHandle, open_runtime
from mlx_trio.api.server import ServeOptions
from mlx_trio.engine import padded_prefill
from mlx_trio.engine.batch.batch import BatchEngine
from mlx_trio.engine.batch.caches import CacheAbilities
from mlx_trio.engine.batch.schedule import TokenBudget
from mlx_trio.engine.generate import Engine
from mlx_trio.engine.model.random_model import in_memory
from mlx_trio.engine.options import EngineOptions
from mlx_trio.engine.outputs import RowOutput
from mlx_trio.engine.padded_prefill import can_pad
from mlx_trio.engine.params import PreparedRequest, SamplingParams
from tests.families import FAMILIES, RECURRENT, make_engine, make_model, mlx_lm_greedy, save
from tests.server_thread import ServerThread
from tests.tiny import make_tokenizer

GREEDY = SamplingParams(max_tokens=24, temperature=0)
PROMPTS = [
    "the cat sat on the mat, and then the dog came in",  # longer than the windows (16)
    "in the beginning",
    "x",
    "one dog sat on the cat and then the mat was gone",
]


# mlx-lm's greedy tokens by the model's weights and the prompt: the tests of a family build the
# same seeded model again and ask it the same prompts (a third of this module's time went to
# asking mlx-lm the same thing again).
_REFERENCE: dict[tuple[str, tuple[int, ...], int], list[int]] = {}


def expected(engine: Engine, requests: list[PreparedRequest]) -> list[list[int]]:
    weights = weights_digest(engine.model)
    replies = []
    for request in requests:
        key = (weights, tuple(request.prompt_tokens), GREEDY.max_tokens)
        if key not in _REFERENCE:
            _REFERENCE[key] = mlx_lm_greedy(engine.model, list(key[1]), GREEDY.max_tokens)
        replies.append(list(_REFERENCE[key]))
    return replies


def weights_digest(model: nn.Module) -> str:
    """A digest of the model's class and every parameter's name, dtype, shape and bytes."""
    digest = hashlib.sha256(type(model).__module__.encode())
    for name, value in tree_flatten(model.parameters()):
        digest.update(f"{name} {value.dtype} {value.shape}".encode())
        digest.update(memoryview(np.array(value, copy=False)).cast("B"))
    return digest.hexdigest()


def run_batch(batch: BatchEngine, requests: list[PreparedRequest]) -> list[list[int]]:
    rows = [batch.add(r) for r in requests]
    tokens: dict[int, list[int]] = {row: [] for row in rows}
    while batch.num_rows:
        for event in batch.step():
            if isinstance(event, RowOutput):
                tokens[event.row].extend(event.delta.token_ids)
    return [tokens[row] for row in rows]


async def collect_together(rt: RuntimeHandle, prompts: list[str]) -> list[Collected]:
    """Each prompt's greedy reply, all submitted at once."""
    results: dict[int, Collected] = {}

    async def ask(i: int) -> None:
        results[i] = await rt.collect(GenerationRequest(prompts[i], GREEDY))

    async with trio.open_nursery() as nursery:
        for i in range(len(prompts)):
            nursery.start_soon(ask, i)
    return [results[i] for i in range(len(prompts))]


def serial(engine: Engine, request: PreparedRequest) -> tuple[list[int], int]:
    """The serial lane's tokens, and how many prompt tokens came from the prompt cache."""
    generation = engine.generate(request)
    tokens = [t for delta in generation for t in delta.token_ids]
    return tokens, generation.stats().cached_tokens


@pytest.mark.parametrize("family", FAMILIES)
def test_every_path_gives_mlx_lms_greedy_text(family):
    engine = make_engine(family)
    requests = [engine.prepare(p, GREEDY) for p in PROMPTS]
    want = expected(engine, requests)
    assert any(len(set(tokens)) > 3 for tokens in want)  # the model says something varied
    assert [serial(engine, r)[0] for r in requests] == want
    batch = BatchEngine(engine, max_batch=4, prefill_chunk=16)
    assert run_batch(batch, [*requests, requests[0]]) == [*want, want[0]]
    assert run_batch(batch, requests[:1]) == want[:1]  # a lone row (solo where it can rewind)


@pytest.mark.parametrize("family", FAMILIES)
def test_a_repeated_request_reuses_the_prompt_cache_and_answers_the_same(family):
    engine = make_engine(family, prompt_cache_bytes=1 << 26)
    requests = [engine.prepare(p, GREEDY) for p in (PROMPTS[0], PROMPTS[3])]  # 16+ tokens
    want = expected(engine, requests)
    for request, tokens in zip(requests, want, strict=True):  # the serial lane
        assert serial(engine, request) == (tokens, 0)
        again, cached = serial(engine, request)
        assert again == tokens and cached >= len(request.prompt_tokens) - 1
    hits = engine.prompt_cache.statistics().hits
    batch = BatchEngine(engine, max_batch=4, prefill_chunk=16)  # the batch lane
    assert run_batch(batch, requests) == want
    assert engine.prompt_cache.statistics().hits == hits + 2


# Prompts of 6 tokens or more prefilled one row at a time, in chunks of 8 (the GPU's way): the
# last chunk padded where the caches trim exactly, never where a state would read the padding.
ALONE = TokenBudget(max_preparation_tokens=64, max_iteration_tokens=24, max_chunk=8, alone_from=6)


@pytest.mark.parametrize("family", FAMILIES)
def test_long_prompts_prefilled_alone_give_mlx_lms_greedy_text(family):
    engine = make_engine(family, prompt_cache_bytes=1 << 26)
    requests = [engine.prepare(p, GREEDY) for p in PROMPTS]
    follow_up = engine.prepare(PROMPTS[0] + " and then the dog sat on the mat too", GREEDY)
    want = expected(engine, [*requests, follow_up])
    batch = BatchEngine(engine, max_batch=4, prefill_chunk=8, budget=ALONE)
    assert run_batch(batch, requests) == want[:4]
    assert run_batch(batch, [follow_up, requests[1]]) == [want[4], want[1]]


@pytest.mark.parametrize("family", FAMILIES)
def test_prompts_prefilled_in_padded_chunks_give_mlx_lms_greedy_text(family, monkeypatch):
    """The GPU's way for the serial lane and a lone row (``engine/padded_prefill.py``): the
    prompt fed in chunks padded so that their shapes repeat, the padding trimmed back off; a
    model whose caches would keep some of the padding is fed unpadded."""
    fed: list[int] = []

    def feed_padded(model: Any, tokens: Any, caches: list[Any], *, max_chunk: int) -> None:
        fed.append(len(tokens))
        real_feed(model, tokens, caches, max_chunk=max_chunk)

    real_feed = padded_prefill.feed_padded
    monkeypatch.setattr(padded_prefill, "feed_padded", feed_padded)
    engine = make_engine(family, prompt_cache_bytes=1 << 26)
    engine.pads_prefill = True
    requests = [engine.prepare(p, GREEDY) for p in PROMPTS]
    want = expected(engine, requests)
    assert [serial(engine, r)[0] for r in requests] == want
    assert serial(engine, requests[0])[0] == want[0]  # past a prompt-cache hit
    batch = BatchEngine(engine, max_batch=4, prefill_chunk=16)
    assert run_batch(batch, requests[3:]) == want[3:]  # a lone row, solo where it can rewind
    assert bool(fed) == can_pad(engine.new_caches())
    assert can_pad(engine.new_caches()) == (family in ("llama", "llama-4bit", "qwen3", "qwen3_moe"))


@pytest.mark.parametrize("family", RECURRENT)
def test_a_recurrent_models_rows_are_never_rewound(family):
    """Its rows stay in mlx-lm's batch: no parking (a slow reader's row keeps its place), no
    solo row; the runtime is told it cannot park and goes on."""
    engine = make_engine(family)
    abilities = engine.caches
    assert abilities.batch and not abilities.rewind and abilities.checkpoints
    assert any("ArraysCache" in kind for kind in abilities.kinds)
    batch = BatchEngine(engine, max_batch=4, prefill_chunk=16)
    request = engine.prepare(PROMPTS[0], GREEDY)
    row = batch.add(request)
    for _ in range(4):
        batch.step()
    assert not batch.can_park(row) and batch.solo_row is None


def test_the_abilities_of_plain_windowed_and_unmergeable_caches():
    llama = CacheAbilities.of(make_model("llama"))
    assert (llama.batch, llama.rewind, llama.checkpoints) == (True, True, False)
    assert llama.batch_mode == "batch" and llama.unbatchable_reason is None
    windowed = CacheAbilities.of(make_model("gemma3_text"))
    assert windowed.rewind and windowed.checkpoints  # a full window stops rewinding
    unmergeable = CacheAbilities.of(UnmergeableKV(make_model("llama")))
    assert unmergeable.batch_mode == "serial" and not unmergeable.batch
    assert "ConcatenateKVCache" in (unmergeable.unbatchable_reason or "")


class UnmergeableKV:
    """A model whose caches cannot merge into a batch: mlx-lm's ``ConcatenateKVCache`` (as
    its ``QuantizedKVCache`` and ``ChunkedKVCache``, which llama4 makes) has no ``merge``."""

    def __init__(self, model: Any) -> None:
        self.model = model
        self.layers = model.layers

    def make_cache(self) -> list[Any]:
        return [ConcatenateKVCache() for _ in self.layers]

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.model(*args, **kwargs)

    def parameters(self) -> Any:
        return self.model.parameters()


async def test_a_model_whose_caches_cannot_batch_serves_every_request_on_the_serial_lane():
    model = UnmergeableKV(make_model("llama"))
    loaded = in_memory(
        model,  # type: ignore[arg-type]
        make_tokenizer(),
        "tiny-unmergeable-kv",
        dtype="float32",
        is_quantized=False,
        context_length=512,
        device="cpu",
    )
    engine = Engine(loaded, prefill_step_size=16)
    with EngineThread() as thread:
        port = ThreadedEngine.over(engine, thread, max_batch=4)
        async with open_runtime(engine=port, max_batch=4) as rt:
            assert rt.statistics().batch_mode == "serial"
            results = await collect_together(rt, PROMPTS[:3])
            stats = rt.statistics()
    assert all(isinstance(results[i].outcome, Completed) for i in range(3))
    assert stats.rows_submitted == {"batch": 0, "serial": 3}
    for i in range(3):
        want = mlx_lm_greedy(model, list(engine.prepare(PROMPTS[i], GREEDY).prompt_tokens), 24)
        assert list(results[i].token_ids) == want


def detokenize(tokens: list[int]) -> str:
    """Text as a reply streams it (mlx-lm's streaming detokenizer: a random model's stray
    bytes come out as it maps them, not as ``decode`` does)."""
    detokenizer = make_tokenizer().detokenizer
    detokenizer.reset()
    for token in tokens:
        detokenizer.add_token(token)
    detokenizer.finalize()
    return detokenizer.text


@pytest.fixture(scope="module")
def hybrid_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save("qwen3_5", tmp_path_factory.mktemp("models") / "tiny-qwen3_5")


@pytest.mark.parametrize("engine_process", [False, True], ids=["engine thread", "engine process"])
async def test_the_in_process_api_serves_a_hybrid_checkpoint(hybrid_dir, engine_process):
    """``open_runtime(model=DIR)``: loaded as a user's checkpoint is, on the engine thread and
    in an engine process, four at once and a repeat; mlx-lm's text, and the repeat's prompt
    from the cache."""
    engine = make_engine("qwen3_5")
    want = expected(engine, [engine.prepare(p, GREEDY) for p in PROMPTS])
    async with open_runtime(
        str(hybrid_dir), device="cpu", engine_process=engine_process, prompt_cache_bytes=1 << 26
    ) as rt:
        results = await collect_together(rt, PROMPTS)
        again = await rt.collect(GenerationRequest(PROMPTS[0], GREEDY))
        stats = rt.statistics()
    assert [list(results[i].token_ids) for i in range(4)] == want
    assert list(again.token_ids) == want[0]
    assert isinstance(again.outcome, Completed) and again.outcome.usage.cached_tokens > 0
    assert stats.batch_mode == "batch" and not any(stats.failed.values())


def test_the_server_serves_a_hybrid_checkpoint_streamed_or_not(hybrid_dir):
    """``serve --model DIR`` over HTTP with the openai SDK: the 500 the issue found is
    mlx-lm's text, streamed or not, alone or four at once; ``/v1/models`` says it batches."""
    engine = make_engine("qwen3_5")
    chat = [engine.prepare([{"role": "user", "content": p}], GREEDY).prompt_tokens for p in PROMPTS]
    want = [detokenize(mlx_lm_greedy(engine.model, list(c), 24)) for c in chat]
    options = ServeOptions(
        engine=EngineOptions(model=str(hybrid_dir), device="cpu", engine_process=False),
        runtime=RuntimeConfig(max_batch=4),
    )
    with ServerThread(options) as server:
        server.wait_healthy()
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)
        model = client.models.list().data[0]
        assert model.id == "tiny-qwen3_5" and model.model_extra["batch_mode"] == "batch"

        def ask(i: int, stream: bool) -> str:
            messages = [{"role": "user", "content": PROMPTS[i]}]
            if not stream:
                reply = client.chat.completions.create(
                    model=model.id, messages=messages, max_tokens=24, temperature=0
                )
                return reply.choices[0].message.content or ""
            chunks = client.chat.completions.create(
                model=model.id, messages=messages, max_tokens=24, temperature=0, stream=True
            )
            return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)

        assert ask(0, stream=False) == want[0]  # alone
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            together = list(pool.map(lambda i: ask(i, stream=i % 2 == 0), range(4)))
        assert together == want
        stats = httpx.get(f"{server.url}/v1/stats").json()
        assert stats["batch_mode"] == "batch" and not any(stats["failed"].values())
        assert stats["prompt_cache"]["hits"] > 0
