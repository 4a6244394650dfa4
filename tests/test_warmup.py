"""Kernel warm-up runs the runtime's own paths and leaves nothing behind."""

from __future__ import annotations

from dataclasses import replace

from mlx_trio.engine import warmup
from mlx_trio.engine.batch.prompt_cache import PromptCache
from mlx_trio.engine.batch.schedule import TokenBudget
from mlx_trio.engine.generate import Engine
from mlx_trio.engine.params import SamplingParams
from mlx_trio.engine.warmup import warm_up
from tests.tiny import make_loaded


def test_warm_up_runs_every_batch_size_and_leaves_the_prompt_cache_empty():
    engine = Engine(make_loaded(), prompt_cache_bytes=16 << 20)
    report = warm_up(engine, max_batch=8, prefill_chunk=32, force=True)
    rows = {shape.rows for shape in report.shapes if shape.lane == "batch"}
    assert {1, 2, 4, 8} <= rows
    # A large batch's runs stop at WARM_BATCH_ROWS: more rows are the same kernels.
    plan = warmup.plan(max_batch=256, prefill_chunk=32)
    assert [run.rows for run in plan if run.lane == "batch"] == [1, 2, 4, 8, 16]
    assert any(shape.lane == "serial" for shape in report.shapes)
    assert report.seconds >= sum(shape.seconds for shape in report.shapes) * 0.99
    assert engine.prompt_cache is not None and engine.prompt_cache.statistics().entries == 0
    # The engine still generates normally afterwards, cache included.
    request = engine.prepare("after the warm-up " * 4, SamplingParams(temperature=0, max_tokens=3))
    assert len([t for d in engine.generate(request) for t in d.token_ids]) == 3


def test_warm_up_returns_at_once_on_cpu():
    engine = Engine(make_loaded())
    report = warm_up(engine, max_batch=8, prefill_chunk=32)
    assert report.shapes == () and report.device == "cpu"


def test_warm_up_runs_a_burst_of_long_prompts_as_the_token_budget_prepares_them():
    budget = TokenBudget(max_preparation_tokens=64, max_iteration_tokens=32, max_chunk=16)
    engine = Engine(make_loaded(), token_budget=budget)
    report = warm_up(engine, max_batch=8, prefill_chunk=32, force=True)
    burst = [s for s in report.shapes if s.lane == "burst" and s.prompt_tokens == 17]
    assert 4 in [s.rows for s in burst]  # 64 // 16 prompts of the largest chunk, and one more


def test_where_long_prompts_go_alone_their_burst_is_two_rows():
    """Prefilled one row at a time, a burst's rows repeat one row's shapes: two rows (of
    unequal lengths, a padded decode) cover them."""
    budget = TokenBudget(max_preparation_tokens=64, max_iteration_tokens=32, max_chunk=16)
    engine = Engine(make_loaded(), token_budget=replace(budget, alone_from=8))
    report = warm_up(engine, max_batch=8, prefill_chunk=32, force=True)
    assert [s.rows for s in report.shapes if s.lane == "burst"] == [2]


def test_warm_up_prefills_every_padded_last_chunk_where_long_prompts_go_alone():
    budget = TokenBudget(max_preparation_tokens=512, max_iteration_tokens=256, max_chunk=256)
    engine = Engine(make_loaded(), token_budget=replace(budget, alone_from=64))
    report = warm_up(engine, max_batch=8, prefill_chunk=32, force=True)
    alone = [(s.rows, s.prompt_tokens) for s in report.shapes if s.lane == "alone"]
    # Rows of 128 and 256 tokens past the start: a prompt's first chunk.
    assert alone == [(2, 1)]
    unwarmed = Engine(make_loaded(), token_budget=budget)
    assert not [s for s in warm_up(unwarmed, max_batch=8, prefill_chunk=32, force=True).shapes
                if s.lane == "alone"]  # fmt: skip


def test_warm_up_runs_a_second_chat_burst_from_prompt_cache_hits(monkeypatch):
    """A server's second burst of chat prompts starts from hits on the template's tokens; the
    warm-up runs that path too (over a cache of its own: the server's stays empty)."""
    hits: list[int] = []
    take = PromptCache.take

    def counting_take(self: PromptCache, tokens: list[int], salt: str | None = None):
        hit = take(self, tokens, salt)
        hits.append(0 if hit is None else hit.num_tokens)
        return hit

    monkeypatch.setattr(PromptCache, "take", counting_take)
    engine = Engine(make_loaded(), prompt_cache_bytes=16 << 20)
    report = warm_up(engine, max_batch=8, prefill_chunk=32, force=True)
    assert [(s.rows, s.prompt_tokens) for s in report.shapes if s.lane == "cached"] == [(8, 64)]
    # The first burst misses, each row of the second reuses the shared 32 tokens.
    assert hits[:8] == [0] * 8 and len(hits) == 16 and min(hits[8:]) >= 32
    assert engine.prompt_cache is not None and engine.prompt_cache.statistics().entries == 0
    without_cache = warm_up(Engine(make_loaded()), max_batch=8, prefill_chunk=32, force=True)
    assert "cached" not in {s.lane for s in without_cache.shapes}


def test_a_vision_models_warm_up_runs_an_image_through_its_tower(tmp_path):
    """On a GPU the tower's kernels would otherwise compile in a first image request's call."""
    from mlx_trio.engine.model.loader import load_model
    from mlx_trio.engine.model.random_vlm import save_random_vlm

    engine = Engine(load_model(str(save_random_vlm(tmp_path / "vlm")), device="cpu"))
    report = warm_up(engine, max_batch=2, prefill_chunk=32, force=True)
    assert [(s.lane, s.rows) for s in report.shapes if s.lane == "image"] == [("image", 1)]
    assert not [s for s in warm_up(Engine(make_loaded()), max_batch=2, prefill_chunk=32,
                                   force=True).shapes if s.lane == "image"]  # fmt: skip
