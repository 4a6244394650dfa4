"""Speculative decoding (prompt lookup) on a tiny random llama: what a user sees is what plain
steps give, on the serial lane and the batch's lone row, with the drafts counted."""

from __future__ import annotations

import itertools
import re
from collections import Counter
from dataclasses import replace

import mlx.core as mx
import pytest

from mlx_trio.engine.batch.batch import BatchEngine
from mlx_trio.engine.errors import InvalidRequestError, UnsupportedModelError
from mlx_trio.engine.generate import Engine
from mlx_trio.engine.model.random_model import byte_level_tokenizer
from mlx_trio.engine.outputs import Delta, GenerationStats, RowOutput
from mlx_trio.engine.params import Grammar, SamplingParams, Speculation
from mlx_trio.engine.speculative.draft_model import check_same_tokenizer
from mlx_trio.engine.speculative.lookup import DraftCounts, NgramIndex
from mlx_trio.engine.speculative.steps import SpeculativeSteps
from mlx_trio.engine.vocabulary.sampling import RowSampler
from tests import families
from tests.tiny import SPECIALS, make_loaded, make_model, make_tokenizer

LOOKUP = Speculation("prompt_lookup", num_draft_tokens=4)
# Greedy decoding on the tiny model falls into loops: a prompt that repeats itself and then
# output that repeats, so drafts are taken whole, in part and not at all.
PROMPT = "the cat sat on the mat and the dog sat on the log; " * 3


def generate(
    engine: Engine, params: SamplingParams, prompt: str = PROMPT
) -> tuple[list[Delta], GenerationStats]:
    generation = engine.generate(engine.prepare(prompt, params))
    deltas = list(generation)
    return deltas, generation.stats()


def tokens_of(deltas: list[Delta]) -> list[int]:
    return [t for d in deltas for t in d.token_ids]


def text_of(deltas: list[Delta]) -> str:
    return "".join(d.text for d in deltas)


@pytest.mark.parametrize("max_tokens", [1, 2, 7, 23, 60])
def test_greedy_output_and_finish_equal_plain_steps_with_max_tokens_inside_a_draft(
    tiny_engine, max_tokens
):
    plain = SamplingParams(temperature=0, max_tokens=max_tokens)
    expected, _ = generate(tiny_engine, plain)
    got, stats = generate(tiny_engine, replace(plain, speculative=LOOKUP))
    assert tokens_of(got) == tokens_of(expected)
    assert text_of(got) == text_of(expected)
    assert got[-1].finish_reason == expected[-1].finish_reason == "length"
    assert stats.generated_tokens == max_tokens
    if max_tokens == 60:
        assert 0 < stats.accepted_tokens <= stats.drafted_tokens


def test_a_stop_string_inside_accepted_drafts_cuts_the_text_where_plain_steps_cut_it(
    tiny_engine,
):
    plain = SamplingParams(temperature=0, max_tokens=60)
    deltas = generate(tiny_engine, plain)[0]
    whole = text_of(deltas)
    # Output falls into a loop of 7 tokens from its 14th; drafts are taken from the 22nd: a
    # stop string longer than the loop first ends inside them.
    tokens = tokens_of(deltas)
    start, end = (len(tiny_engine.decode(tokens[:n])) for n in (13, 33))
    stop = whole[start:end]
    expected, _ = generate(tiny_engine, replace(plain, stop=(stop,)))
    got, stats = generate(tiny_engine, replace(plain, stop=(stop,), speculative=LOOKUP))
    assert text_of(got) == text_of(expected) == whole[: whole.index(stop)]
    assert got[-1].finish_reason == "stop"
    assert stats.drafted_tokens > 0


def test_logprobs_and_penalties_speculate_and_equal_plain_steps(tiny_engine):
    plain = SamplingParams(
        temperature=0, max_tokens=60, logprobs=True, top_logprobs=2, repetition_penalty=1.05
    )
    expected, _ = generate(tiny_engine, plain)
    got, stats = generate(tiny_engine, replace(plain, speculative=LOOKUP))
    assert tokens_of(got) == tokens_of(expected)
    want = [(r.token, [t for t, _ in r.top]) for d in expected for r in d.logprobs or ()]
    have = [(r.token, [t for t, _ in r.top]) for d in got for r in d.logprobs or ()]
    assert have == want and len(have) == 60
    values = [r.logprob for d in got for r in d.logprobs or ()]
    assert values == pytest.approx(
        [r.logprob for d in expected for r in d.logprobs or ()], abs=1e-4
    )
    assert stats.drafted_tokens > 0


def test_a_sampled_row_accepts_by_its_own_draws(tiny_engine):
    """top_k 1 draws the most likely token: the sampled path's acceptance gives greedy's output."""
    greedy = SamplingParams(temperature=0, max_tokens=40)
    drawn = SamplingParams(temperature=1.0, top_k=1, max_tokens=40, speculative=LOOKUP)
    got, stats = generate(tiny_engine, drawn)
    assert tokens_of(got) == tokens_of(generate(tiny_engine, greedy)[0])
    assert stats.accepted_tokens > 0


def test_a_grammar_row_steps_plain_and_still_matches(tiny_engine):
    grammar = Grammar("regex", r"(yes|no), [0-9]{2,4}")
    plain = SamplingParams(temperature=0, max_tokens=40, grammar=grammar)
    expected, _ = generate(tiny_engine, plain)
    got, stats = generate(tiny_engine, replace(plain, speculative=LOOKUP))
    assert text_of(got) == text_of(expected)
    assert stats.drafted_tokens == 0


def test_closing_mid_draft_leaves_a_prompt_cache_entry_that_repeats_exactly():
    """A consumer that leaves mid-draft: the row's KV is trimmed to the tokens handed out, so
    the prompt cache's entry serves the next request as a fresh run would."""
    engine = families.make_engine("llama", prompt_cache_bytes=1 << 24)
    params = SamplingParams(temperature=0, max_tokens=50)
    expected = tokens_of(generate(engine, params)[0])
    request = engine.prepare(PROMPT, replace(params, speculative=LOOKUP))
    generation = iter(engine.generate(request))
    taken: list[int] = []
    while len(taken) < 20:
        taken += next(generation).token_ids
    generation.close()  # type: ignore[attr-defined]
    assert taken == expected[: len(taken)]
    again, _ = generate(engine, replace(params, speculative=LOOKUP))
    assert tokens_of(again) == expected
    assert engine.prompt_cache is not None and engine.prompt_cache.statistics().hits >= 1


def test_a_model_whose_caches_cannot_be_trimmed_steps_plain():
    engine = families.make_engine("qwen3_5")
    plain = SamplingParams(temperature=0, max_tokens=20)
    expected, _ = generate(engine, plain)
    got, stats = generate(engine, replace(plain, speculative=LOOKUP))
    assert not engine.can_speculate
    assert tokens_of(got) == tokens_of(expected)
    assert stats.drafted_tokens == 0


class BatchRun:
    """A batch engine's rows' tokens and final stats, step by step."""

    def __init__(self, engine: Engine) -> None:
        self.batch = BatchEngine(engine, max_batch=4)
        self.tokens: dict[int, list[int]] = {}
        self.stats: dict[int, GenerationStats] = {}

    def step(self) -> None:
        for event in self.batch.step():
            if isinstance(event, RowOutput):
                self.tokens.setdefault(event.row, []).extend(event.delta.token_ids)
                if event.stats is not None:
                    self.stats[event.row] = event.stats


def test_the_batchs_lone_row_speculates_and_a_full_batch_equals_plain(tiny_engine):
    params = SamplingParams(temperature=0, max_tokens=40, speculative=LOOKUP)
    expected = tokens_of(generate(tiny_engine, replace(params, speculative=None))[0])
    for num_rows in (2, 1):
        run = BatchRun(tiny_engine)
        rows = [run.batch.add(tiny_engine.prepare(PROMPT, params)) for _ in range(num_rows)]
        while run.batch.num_rows:
            run.step()
        assert [run.tokens[r] for r in rows] == [expected] * num_rows
        drafted = [run.stats[r].drafted_tokens for r in rows]
        assert all(drafted) if num_rows == 1 else not any(drafted)


def test_the_engines_default_speculates_and_a_request_can_turn_it_off(tiny_engine):
    engine = Engine(tiny_engine.loaded, prefill_step_size=16, speculation=LOOKUP)
    plain = SamplingParams(temperature=0, max_tokens=30)
    _, on = generate(engine, plain)
    _, off = generate(engine, replace(plain, speculative=Speculation("none")))
    assert on.drafted_tokens > 0 and off.drafted_tokens == 0


@pytest.mark.parametrize(
    ("build", "message"),
    [
        (lambda: Speculation("medusa"), r"^speculative\.method must be one of prompt_lookup, "),
        (
            lambda: Speculation(num_draft_tokens=0),
            r"^speculative\.num_draft_tokens must be between 1 and 16, got 0$",
        ),
        (
            lambda: Speculation(ngram_size=1),
            r"^speculative\.ngram_size must be between 2 and 8, got 1$",
        ),
    ],
)
def test_bad_speculation_is_a_typed_error_naming_the_field(build, message):
    with pytest.raises(InvalidRequestError, match=message) as caught:
        build()
    assert caught.value.param.startswith("speculative.")


def draft_engine(*, same_weights: bool) -> Engine:
    """The tiny engine with a draft model: the model itself, or another random model of the
    same tokenizer."""
    loaded = make_loaded()
    other = make_model(len(loaded.tokenizer), seed=9)
    return Engine(
        loaded, prefill_step_size=16, draft=loaded if same_weights else replace(loaded, model=other)
    )


@pytest.mark.parametrize("same_weights", [True, False], ids=["same weights", "other weights"])
def test_a_draft_models_greedy_output_equals_plain_steps(same_weights):
    engine = draft_engine(same_weights=same_weights)
    params = SamplingParams(temperature=0, max_tokens=30, stop=("zz",))
    expected, _ = generate(engine, params)
    got, stats = generate(engine, replace(params, speculative=Speculation("draft_model")))
    assert tokens_of(got) == tokens_of(expected)
    assert got[-1].finish_reason == expected[-1].finish_reason
    assert stats.drafted_tokens > 0
    if same_weights:  # a draft that is the model is always right
        assert stats.accepted_tokens == stats.drafted_tokens


def test_a_draft_model_with_another_tokenizer_is_refused_in_one_line():
    other = byte_level_tokenizer(["ab"], SPECIALS, eos_token="<|im_end|>", merges=[("a", "b")])
    with pytest.raises(UnsupportedModelError) as caught:
        check_same_tokenizer(make_tokenizer(), other, "other/draft")
    assert re.fullmatch(
        r"--draft-model other/draft: its tokenizer is not the model's \(260 tokens against 263, "
        r"\d+ \(token, id\) pairs differ\); a draft must share the model's tokenizer",
        caught.value.message,
    )


def test_asking_for_a_draft_model_the_engine_lacks_is_a_400(tiny_engine):
    params = SamplingParams(speculative=Speculation("draft_model"))
    with pytest.raises(InvalidRequestError, match=r"^speculative.method draft_model needs a "):
        tiny_engine.prepare(PROMPT, params)


def test_a_draft_of_the_same_tokenizer_loads_and_one_of_another_is_refused(tmp_path):
    model = families.save("llama", tmp_path / "model")
    other = families.save("llama", tmp_path / "other")
    tokenizer = byte_level_tokenizer(["ab"], SPECIALS, eos_token="<|im_end|>", merges=[("a", "b")])
    tokenizer._tokenizer.save_pretrained(str(other))
    engine = Engine.load(str(model), device="cpu", draft_model=str(model))
    params = SamplingParams(temperature=0, max_tokens=12, speculative=Speculation("draft_model"))
    _, stats = generate(engine, params)
    assert stats.drafted_tokens > 0
    with pytest.raises(UnsupportedModelError, match=rf"^--draft-model {other}: its tokenizer is "):
        Engine.load(str(model), device="cpu", draft_model=str(other))


def test_a_speculating_lone_row_joined_mid_draft_goes_back_to_the_batch_intact(tiny_engine):
    """The lone row speculates; a second row arrives while it holds drafted tokens not yet
    handed out, so it goes back into mlx-lm's batch with its KV trimmed to what it handed out."""
    params = SamplingParams(temperature=0, max_tokens=60, speculative=LOOKUP)
    expected = tokens_of(generate(tiny_engine, replace(params, speculative=None))[0])
    run = BatchRun(tiny_engine)
    first = run.batch.add(tiny_engine.prepare(PROMPT, params))
    second = None
    while run.batch.num_rows:
        run.step()
        if second is None and len(run.tokens.get(first, [])) >= 30:
            second = run.batch.add(tiny_engine.prepare("in the beginning", params))
    assert run.tokens[first] == expected
    assert second is not None and run.stats[second].generated_tokens == 60
    assert run.stats[first].accepted_tokens > 0


def test_sampled_tokens_keep_the_models_distribution_under_drafts():
    """A model of known probabilities (the next token depends on the last only): the first
    three tokens drawn with prompt-lookup drafts (taken and refused) are distributed as the
    model says, within sampling noise of 6,000 seeded draws."""
    chain = [[0.1, 0.6, 0.2, 0.1], [0.3, 0.1, 0.4, 0.2], [0.5, 0.2, 0.1, 0.2], [0.25] * 4]
    log_chain = mx.log(mx.array(chain))
    prompt = [0, 1, 2, 0, 1, 2, 0, 1]  # its last 3-gram drafts [2, 0]
    counts = DraftCounts()
    drawn: Counter[tuple[int, ...]] = Counter()
    num_draws = 6000
    for seed in range(num_draws):
        steps = SpeculativeSteps(
            lambda tokens, cache: log_chain[tokens],
            prompt,
            caches=[],
            max_tokens=3,
            num_draft_tokens=2,
            drafter=NgramIndex(prompt, max_n=3),
            sampler=RowSampler(SamplingParams(temperature=1.0, seed=seed)),
            counts=counts,
        )
        drawn[tuple(token for token, _ in steps)] += 1
    exact = {
        (a, b, c): chain[1][a] * chain[a][b] * chain[b][c]
        for a, b, c in itertools.product(range(4), repeat=3)
    }
    distance = 0.5 * sum(abs(drawn[seq] / num_draws - p) for seq, p in exact.items())
    assert distance < 0.08  # 0.04 measured; drafts always taken would give 0.6
    assert counts.drafted >= 2 * num_draws and 0 < counts.accepted < counts.drafted
