"""The prompt cache on both lanes: hits give the same greedy output as no cache, within budget."""

from __future__ import annotations

from dataclasses import replace

import mlx.core as mx
import pytest

from mlx_trio.engine.batch.batch import BatchEngine
from mlx_trio.engine.batch.schedule import TokenBudget
from mlx_trio.engine.budget import MemoryLimit
from mlx_trio.engine.core import EngineCore
from mlx_trio.engine.generate import Engine
from mlx_trio.engine.outputs import RowOutput
from mlx_trio.engine.params import PreparedRequest, SamplingParams
from tests.tiny import make_loaded

GREEDY = SamplingParams(temperature=0, max_tokens=12)
SYSTEM = "You are a helpful assistant who answers briefly and never makes anything up. "
FIRST = SYSTEM + "What is the tallest mountain on earth?"


@pytest.fixture(scope="module")
def loaded():
    return make_loaded()


def engine_with_cache(loaded, budget: int = 64 << 20) -> Engine:
    return Engine(loaded, prefill_step_size=16, prompt_cache_bytes=budget)


def prepare(engine: Engine, prompt: str, salt: str | None = None) -> PreparedRequest:
    return replace(engine.prepare(prompt, GREEDY), cache_salt=salt)


def serial(engine: Engine, prompt: str, salt: str | None = None) -> tuple[list[int], int]:
    generation = engine.generate(prepare(engine, prompt, salt))
    tokens = [t for d in generation for t in d.token_ids]
    return tokens, generation.stats().cached_tokens


def batched(
    engine: Engine, prompts: list[str], salt: str | None = None, budget: TokenBudget | None = None
) -> list[tuple[list[int], int]]:
    batch = BatchEngine(engine, max_batch=4, prefill_chunk=16, budget=budget)
    rows = [batch.add(prepare(engine, p, salt)) for p in prompts]
    tokens: dict[int, list[int]] = {row: [] for row in rows}
    cached: dict[int, int] = {}
    while batch.num_rows:
        for event in batch.step():
            if isinstance(event, RowOutput):
                tokens[event.row].extend(event.delta.token_ids)
                if event.stats is not None:
                    cached[event.row] = event.stats.cached_tokens
    while batch.step_ahead():  # idle work, as the engine thread does: the KV to the cache
        pass
    return [(tokens[row], cached[row]) for row in rows]


def reference(loaded, prompt: str) -> list[int]:
    return serial(Engine(loaded, prefill_step_size=16), prompt)[0]


def continuation(engine: Engine, prompt: str, answer_tokens: list[int]) -> str:
    return prompt + engine.decode(answer_tokens) + " And the second tallest?"


@pytest.mark.parametrize("lane", ["serial", "batch"])
def test_hits_give_the_same_greedy_output_as_no_cache(loaded, lane):
    engine = engine_with_cache(loaded)
    run = (lambda p: serial(engine, p)) if lane == "serial" else (lambda p: batched(engine, [p])[0])

    first, cached = run(FIRST)
    assert cached == 0 and first == reference(loaded, FIRST)

    exact, cached = run(FIRST)  # exact match: all but the last prompt token reused
    assert exact == first
    assert cached == len(engine.prepare(FIRST, GREEDY).prompt_tokens) - 1

    longer_prompt = continuation(engine, FIRST, first)  # a cached entry is a strict prefix
    longer, cached = run(longer_prompt)
    assert longer == reference(loaded, longer_prompt)
    assert cached >= len(engine.prepare(FIRST, GREEDY).prompt_tokens)

    shorter_prompt = SYSTEM + "Name a river."  # the cache holds longer entries: trimmed
    shorter, cached = run(shorter_prompt)
    assert shorter == reference(loaded, shorter_prompt)
    assert cached > 0
    stats = engine.prompt_cache.statistics()
    assert stats.hits == 3 and stats.misses == 1


@pytest.mark.parametrize("lane", ["serial", "batch"])
def test_a_salt_reuses_only_what_its_own_requests_left(loaded, lane):
    """vLLM's ``cache_salt``: a request of one salt never hits another salt's entries (nor the
    unsalted ones), so ``cached_tokens`` tells it nothing of the others' prompts."""
    engine = engine_with_cache(loaded)

    def run(salt: str | None) -> tuple[list[int], int]:
        if lane == "serial":
            return serial(engine, FIRST, salt)
        return batched(engine, [FIRST], salt)[0]

    first, cached = run("alice")
    assert cached == 0
    for other in ("bob", None):
        tokens, cached = run(other)
        assert tokens == first and cached == 0
    again, cached = run("alice")
    assert again == first and cached == len(engine.prepare(FIRST, GREEDY).prompt_tokens) - 1
    assert run("bob")[1] > 0 and run(None)[1] > 0  # each partition has its own entry now


def test_a_cancelled_salted_row_commits_under_its_salt(loaded):
    engine = engine_with_cache(loaded)
    long_prompt = SYSTEM * 4 + "Summarize all of that."
    batch = BatchEngine(engine, max_batch=4, prefill_chunk=16)
    row = batch.add(prepare(engine, long_prompt, "alice"))
    for _ in range(3):
        batch.step()
    batch.remove([row])
    assert batched(engine, [long_prompt], "bob")[0][1] == 0
    assert batched(engine, [long_prompt], "alice")[0][1] >= 32


def test_the_lanes_share_one_cache(loaded):
    engine = engine_with_cache(loaded)
    serial_tokens, _ = serial(engine, FIRST)
    ((batch_tokens, cached),) = batched(engine, [FIRST])
    assert batch_tokens == serial_tokens and cached > 0


def test_a_cancelled_row_commits_what_it_prefilled(loaded):
    engine = engine_with_cache(loaded)
    long_prompt = SYSTEM * 4 + "Summarize all of that."
    batch = BatchEngine(engine, max_batch=4, prefill_chunk=16)
    row = batch.add(engine.prepare(long_prompt, GREEDY))
    for _ in range(3):  # three prefill chunks of 16 tokens
        batch.step()
    batch.remove([row])
    assert engine.prompt_cache.statistics().entries == 1
    ((tokens, cached),) = batched(engine, [long_prompt])
    assert cached >= 32
    assert tokens == reference(loaded, long_prompt)


# Prompts of 8 tokens or more prefilled one row at a time, in chunks of 16 (the GPU's way).
ALONE = TokenBudget(max_preparation_tokens=64, max_iteration_tokens=16, max_chunk=16, alone_from=8)


def test_rows_prefilled_alone_start_from_the_cache_and_leave_their_kv_to_it(loaded):
    engine = engine_with_cache(loaded)
    long_prompt = SYSTEM * 4 + "Summarize all of that."
    batch = BatchEngine(engine, max_batch=4, prefill_chunk=16, budget=ALONE)
    first = batch.add(prepare(engine, long_prompt))
    batch.add(prepare(engine, "Name three rivers of Europe, please."))
    for _ in range(2):  # the first prompt's first two chunks: it goes first
        batch.step()
    assert batch.kv_bytes > 0
    batch.remove([first])
    while batch.num_rows:
        batch.step()
    assert batch.kv_bytes == 0
    ((tokens, cached),) = batched(engine, [long_prompt], budget=ALONE)
    assert cached == 32 and tokens == reference(loaded, long_prompt)
    batched(engine, [FIRST], budget=ALONE)
    ((answer, cached),) = batched(engine, [FIRST], budget=ALONE)
    assert cached == len(engine.prepare(FIRST, GREEDY).prompt_tokens) - 1
    assert answer == reference(loaded, FIRST)
    follow_up = continuation(engine, FIRST, answer)  # its rest past the hit is long: alone
    ((tokens, cached),) = batched(engine, [follow_up], budget=ALONE)
    assert cached > len(answer) and tokens == reference(loaded, follow_up)


def test_entries_never_exceed_the_budget_and_evictions_are_counted(loaded):
    probe = engine_with_cache(loaded)
    serial(probe, FIRST)
    one_entry = probe.prompt_cache.statistics().bytes
    engine = engine_with_cache(loaded, budget=int(one_entry * 2.5))
    for i in range(6):
        serial(engine, f"{i} unrelated prompt number {i} with enough tokens to be cached")
        assert engine.prompt_cache.statistics().bytes <= engine.prompt_cache.budget_bytes
    stats = engine.prompt_cache.statistics()
    assert stats.evictions >= 3 and stats.entries <= 2


def test_no_budget_means_no_cache(loaded):
    engine = Engine(loaded, prompt_cache_bytes=0)
    assert engine.prompt_cache is None
    assert serial(engine, FIRST)[1] == 0


@pytest.fixture
def mlx_limits():
    """Put MLX's memory and cache limits back after a test whose engine core set them."""
    memory = mx.get_memory_limit()
    cache = mx.set_cache_limit(0)
    mx.set_cache_limit(cache)
    yield
    mx.set_memory_limit(memory)
    mx.set_cache_limit(cache)


def test_under_a_memory_budget_the_cache_keeps_to_what_the_live_rows_leave(loaded, mlx_limits):
    def core_with(limit: int) -> EngineCore:
        engine = Engine(
            loaded,
            prefill_step_size=16,
            prompt_cache_bytes=64 << 20,
            memory_limit=MemoryLimit(bytes=limit),
        )
        return EngineCore(engine, max_batch=4, prefill_chunk=16)

    def prompt(i: int) -> str:
        return f"{i:02d} unrelated prompt number {i:02d} with enough tokens to be cached"

    probe = core_with(1 << 40)
    assert probe.memory is not None
    one = probe.memory.projected_bytes(
        len(probe.engine.prepare(prompt(0), GREEDY).prompt_tokens), 12
    )
    core = core_with(probe.memory.weights + probe.memory.headroom + 2 * one)  # two such rows
    assert core.memory is not None and core.memory.kv_pool == 2 * one
    cache = core.engine.prompt_cache
    assert cache is not None

    def run(prompts: list[str]) -> None:
        assert all(
            isinstance(r, int)
            for r in core.batch_add([core.engine.prepare(p, GREEDY) for p in prompts])
        )
        while core.num_rows:
            held = max(core.projected_kv_bytes(), core.kv_bytes)
            assert cache.statistics().bytes + held <= core.memory.kv_pool
            core.batch_step()
        while core.step_ahead():  # idle work: the ended rows' KV goes to the cache
            pass
        assert cache.statistics().bytes <= core.memory.kv_pool

    for i in range(12):  # a row at a time: each leaves its KV to the cache, which evicts
        run([prompt(i)])
    stats = cache.statistics()
    assert stats.entries > 0 and stats.evictions > 0
    run([prompt(20), prompt(21)])  # two rows project the whole pool
    assert cache.statistics().evictions >= stats.evictions + stats.entries
    assert 0 < cache.statistics().bytes <= core.memory.kv_pool
    for _ in range(2):  # the serial lane too; its KV is kept, and the second run hits it
        core.serial_start(core.engine.prepare(prompt(30), GREEDY))
        while core.num_rows:
            held = core.projected_kv_bytes()
            assert cache.statistics().bytes + held <= core.memory.kv_pool
            core.serial_step()
    assert cache.statistics().hits == stats.hits + 1
    core.close()


def test_a_prompt_sharing_a_prefix_with_a_longer_entry_reuses_it_and_leaves_it_whole(loaded):
    engine = engine_with_cache(loaded)
    ((first, _),) = batched(engine, [FIRST])
    other = SYSTEM + "Which river is the longest?"
    ((tokens, cached),) = batched(engine, [other], budget=ALONE)  # written past the shared part
    shared = len(engine.prepare(SYSTEM, GREEDY).prompt_tokens)
    assert shared - 2 <= cached <= shared + 2 and tokens == reference(loaded, other)  # "Wh"
    ((again, cached),) = batched(engine, [FIRST])
    assert again == first and cached == len(engine.prepare(FIRST, GREEDY).prompt_tokens) - 1


def test_rows_reach_the_cache_once_their_last_tokens_are_out(loaded):
    engine = engine_with_cache(loaded)
    cache = engine.prompt_cache
    assert cache is not None
    prompts = [SYSTEM + f"Name a river in country number {i}." for i in range(4)]
    batch = BatchEngine(engine, max_batch=4, prefill_chunk=16, solo=False)
    for prompt in prompts:
        batch.add(prepare(engine, prompt))
    ended = 0
    while batch.num_rows:
        ending = sum(1 for e in batch.step() if isinstance(e, RowOutput) and e.stats)
        assert cache.statistics().entries == ended  # not those whose tokens just went out
        ended += ending
    assert ended == len(prompts)
    assert batch.step_ahead() and not batch.step_ahead()  # then one piece of idle work
    assert cache.statistics().entries == len(prompts)
    again = batch.add(prepare(engine, prompts[2]))
    while batch.num_rows:
        for event in batch.step():
            if isinstance(event, RowOutput) and event.stats is not None:
                assert event.row == again
                prompt_tokens = len(engine.prepare(prompts[2], GREEDY).prompt_tokens)
                assert event.stats.cached_tokens == prompt_tokens - 1
