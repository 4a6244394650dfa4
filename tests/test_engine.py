"""The engine on a tiny random llama: finish reasons, logprobs, context checks, batching."""

from __future__ import annotations

import math
from dataclasses import replace

import mlx.core as mx
import pytest

from mlx_trio.engine.batch.batch import BatchEngine
from mlx_trio.engine.batch.schedule import TokenBudget
from mlx_trio.engine.errors import ContextLengthExceededError, InvalidRequestError
from mlx_trio.engine.generate import Engine
from mlx_trio.engine.outputs import RowFailed, RowOutput, RowProgress
from mlx_trio.engine.params import SamplingParams
from mlx_trio.engine.vocabulary.sampling import make_row_processors, make_row_sampler

TINY_VOCAB = 263  # tests/tiny.py: 256 bytes, 4 merges, 3 special tokens

PROMPTS = [
    "the cat sat on the mat",
    "in the beginning",
    "a much longer prompt that takes several prefill chunks to read in full, "
    "so that rows join the batch while others are still decoding",
    "x",
    "then",
]


def solo_tokens(engine: Engine, prompt: str, params: SamplingParams) -> list[int]:
    generation = engine.generate(engine.prepare(prompt, params))
    return [t for delta in generation for t in delta.token_ids]


def run_batch(batch: BatchEngine, until_empty: bool = True) -> dict[int, list[int]]:
    tokens: dict[int, list[int]] = {}
    while batch.num_rows:
        for event in batch.step():
            if isinstance(event, RowOutput):
                tokens.setdefault(event.row, []).extend(event.delta.token_ids)
    return tokens


def test_max_tokens_ends_with_length_and_exact_count(tiny_engine):
    params = SamplingParams(temperature=0, max_tokens=7)
    generation = tiny_engine.generate(tiny_engine.prepare(PROMPTS[0], params))
    deltas = list(generation)
    assert deltas[-1].finish_reason == "length"
    assert all(d.finish_reason is None for d in deltas[:-1])
    stats = generation.stats()
    assert stats.generated_tokens == 7
    assert stats.prompt_tokens == len(tiny_engine.prepare(PROMPTS[0], params).prompt_tokens)


def test_stop_token_id_ends_with_stop_and_is_not_emitted(tiny_engine):
    greedy = SamplingParams(temperature=0, max_tokens=12)
    tokens = solo_tokens(tiny_engine, PROMPTS[1], greedy)
    stop_at = tokens[4]
    first = tokens.index(stop_at)
    params = SamplingParams(temperature=0, max_tokens=12, stop_token_ids=(stop_at,))
    deltas = list(tiny_engine.generate(tiny_engine.prepare(PROMPTS[1], params)))
    assert deltas[-1].finish_reason == "stop"
    assert [t for d in deltas for t in d.token_ids] == tokens[:first]


def test_stop_string_cuts_text_at_the_match(tiny_engine):
    greedy = SamplingParams(temperature=0, max_tokens=24)
    full = "".join(d.text for d in tiny_engine.generate(tiny_engine.prepare(PROMPTS[0], greedy)))
    assert len(full) >= 6, full
    stop = full[3:6]
    params = SamplingParams(temperature=0, max_tokens=24, stop=(stop,))
    deltas = list(tiny_engine.generate(tiny_engine.prepare(PROMPTS[0], params)))
    assert deltas[-1].finish_reason == "stop"
    assert "".join(d.text for d in deltas) == full[: full.index(stop)]


def test_logprobs_align_with_tokens_and_rank_the_greedy_choice_first(tiny_engine):
    params = SamplingParams(temperature=0, max_tokens=10, logprobs=True, top_logprobs=5)
    deltas = list(tiny_engine.generate(tiny_engine.prepare(PROMPTS[2], params)))
    records = [r for d in deltas for r in (d.logprobs or ())]
    assert [r.token for r in records] == [t for d in deltas for t in d.token_ids]
    for delta in deltas:
        assert len(delta.logprobs or ()) == len(delta.token_ids)
    for record in records:
        assert len(record.top) == 5
        values = [v for _, v in record.top]
        assert values == sorted(values, reverse=True)
        assert record.top[0][0] == record.token
        assert math.isclose(record.top[0][1], record.logprob, rel_tol=1e-6)
        assert sum(math.exp(v) for v in values) <= 1.0 + 1e-5


def test_prompt_over_the_context_is_refused(tiny_engine):
    long_prompt = "word " * 600
    with pytest.raises(ContextLengthExceededError, match=r"maximum context length is 512"):
        tiny_engine.prepare(long_prompt, SamplingParams(max_tokens=1))
    with pytest.raises(ContextLengthExceededError):
        tiny_engine.prepare("short", SamplingParams(max_tokens=600))


def test_bad_prompts_are_refused_with_param(tiny_engine):
    with pytest.raises(InvalidRequestError, match=r"^prompt must not be empty$"):
        tiny_engine.prepare("", SamplingParams())
    # A chat's messages are the engine's prompt too; the chat endpoint names them messages.
    with pytest.raises(InvalidRequestError, match=r"^prompt must not be empty$"):
        tiny_engine.prepare([], SamplingParams())
    with pytest.raises(InvalidRequestError) as info:
        tiny_engine.prepare([{"role": "wizard", "content": "hi"}], SamplingParams())
    assert info.value.param == "prompt[0].role"
    as_chat = info.value.renamed({"prompt": "messages"})
    assert as_chat.param == "messages[0].role"
    assert as_chat.message.startswith("messages[0].role must be one of")
    with pytest.raises(InvalidRequestError, match=r"outside the vocabulary") as info:
        tiny_engine.prepare("hi", SamplingParams(logit_bias={10**6: 1.0}))
    assert info.value.param == "logit_bias"


@pytest.mark.parametrize(
    ("params", "param", "message"),
    [
        (
            SamplingParams(temperature=1.0, top_k=TINY_VOCAB),
            "top_k",
            rf"^top_k must be below the vocabulary size \({TINY_VOCAB}\), or 0 to turn it off; "
            rf"got {TINY_VOCAB}$",
        ),
        (
            SamplingParams(temperature=0.0, top_k=10**9),
            "top_k",
            r"^top_k must be below the vocabulary size",
        ),
        (
            SamplingParams(stop_token_ids=(TINY_VOCAB,)),
            "stop_token_ids",
            rf"^stop_token_ids token id {TINY_VOCAB} is outside the vocabulary",
        ),
    ],
)
def test_sampling_bounds_past_the_model_are_refused(tiny_engine, params, param, message):
    assert tiny_engine.vocab_size == TINY_VOCAB
    with pytest.raises(InvalidRequestError, match=message) as info:
        tiny_engine.prepare("hi", params)
    assert info.value.param == param
    tiny_engine.prepare("hi", replace(params, top_k=TINY_VOCAB - 1, stop_token_ids=()))


def finish_reasons(batch: BatchEngine) -> dict[int, str]:
    """Run a batch until it is empty: how each row ended (a finish reason, or "failed")."""
    ended: dict[int, str] = {}
    while batch.num_rows:
        for event in batch.step():
            if isinstance(event, RowFailed):
                ended[event.row] = "failed"
            elif isinstance(event, RowOutput) and event.stats is not None:
                ended[event.row] = event.delta.finish_reason or "?"
    return ended


def test_a_sampler_failing_inside_mlx_fails_only_its_row_and_breaks_no_later_draw(tiny_engine):
    """The red team's request: mlx-lm's compiled top-k raising mid-trace broke MLX's global
    random state, and every later unseeded draw failed, in a batch the whole step."""
    greedy = SamplingParams(temperature=0, max_tokens=8)
    sampled = SamplingParams(temperature=0.8, top_p=0.9, top_k=20, min_p=0.01, max_tokens=8)
    expected = solo_tokens(tiny_engine, PROMPTS[0], greedy)
    batch = BatchEngine(tiny_engine, max_batch=4)
    doomed = batch.add(replace(tiny_engine.prepare(PROMPTS[1], sampled), fail_sampler_at=2))
    plain = batch.add(tiny_engine.prepare(PROMPTS[0], greedy))
    drawn = [batch.add(tiny_engine.prepare(p, sampled)) for p in PROMPTS[2:4]]
    failures: list[RowFailed] = []
    got: dict[int, list[int]] = {}
    finished: set[int] = set()
    while batch.num_rows:
        for event in batch.step():
            if isinstance(event, RowFailed):
                failures.append(event)
            elif isinstance(event, RowOutput):
                got.setdefault(event.row, []).extend(event.delta.token_ids)
                if event.stats is not None:
                    finished.add(event.row)
    assert [f.row for f in failures] == [doomed]
    assert "sampler failed: ValueError: `top_k` has to be an integer" in failures[0].message
    assert len(got.get(doomed, [])) <= 2  # at most the tokens of its draws before the failing one
    assert got[plain] == expected
    assert finished == {plain, *drawn}
    # Later unseeded draws, in a batch and alone, and MLX's own global draws, all work.
    batch = BatchEngine(tiny_engine, max_batch=4)
    later = [batch.add(tiny_engine.prepare(p, sampled)) for p in PROMPTS[:3]]
    ended = finish_reasons(batch)
    assert set(ended) == set(later)
    assert set(ended.values()) <= {"stop", "length"}
    assert list(tiny_engine.generate(tiny_engine.prepare(PROMPTS[2], sampled)))[-1].finish_reason
    mx.eval(mx.random.uniform())


def test_a_sampler_failing_on_the_serial_path_breaks_no_later_draw(tiny_engine):
    sampled = SamplingParams(temperature=0.8, max_tokens=6)
    doomed = replace(tiny_engine.prepare(PROMPTS[0], sampled), fail_sampler_at=0)
    with pytest.raises(ValueError, match=r"`top_k` has to be an integer"):
        list(tiny_engine.generate(doomed))
    assert list(tiny_engine.generate(tiny_engine.prepare(PROMPTS[0], sampled)))[-1].finish_reason
    mx.eval(mx.random.uniform())


def test_unseeded_rows_draw_differently_and_seeded_ones_alike(tiny_engine):
    sampled = SamplingParams(temperature=1.0, max_tokens=16)
    runs = {tuple(solo_tokens(tiny_engine, PROMPTS[0], sampled)) for _ in range(4)}
    assert len(runs) > 1
    seeded = replace(sampled, seed=5)
    assert solo_tokens(tiny_engine, PROMPTS[0], seeded) == solo_tokens(
        tiny_engine, PROMPTS[0], seeded
    )


def test_a_temperature_too_small_to_divide_by_decodes_greedily(tiny_engine):
    greedy = solo_tokens(tiny_engine, PROMPTS[1], SamplingParams(temperature=0, max_tokens=10))
    tiny = SamplingParams(temperature=1e-30, top_k=5, max_tokens=10)
    assert tiny.is_greedy
    assert solo_tokens(tiny_engine, PROMPTS[1], tiny) == greedy


def test_logit_bias_forces_a_token(tiny_engine):
    forced = 200
    params = SamplingParams(temperature=0, max_tokens=4, logit_bias={forced: 100.0})
    assert solo_tokens(tiny_engine, PROMPTS[0], params) == [forced] * 4


def test_batch_rows_added_and_removed_mid_flight_match_solo_runs(tiny_engine):
    params = SamplingParams(temperature=0, max_tokens=16)
    expected = [solo_tokens(tiny_engine, p, params) for p in PROMPTS]

    batch = BatchEngine(tiny_engine, max_batch=4, prefill_chunk=8)
    rows = [batch.add(tiny_engine.prepare(p, params)) for p in PROMPTS[:3]]
    got: dict[int, list[int]] = {}
    progress_seen = False
    for step in range(200):
        if step == 3:
            rows.append(batch.add(tiny_engine.prepare(PROMPTS[3], params)))
        if step == 5:
            batch.remove([rows[1]])
            got.pop(rows[1], None)
        if step == 6:
            rows.append(batch.add(tiny_engine.prepare(PROMPTS[4], params)))
        if step > 6 and batch.num_rows == 0:
            break
        for event in batch.step():
            if isinstance(event, RowProgress):
                progress_seen = True
                assert 0 < event.done <= event.total
            elif event.row != rows[1] or step < 5:
                got.setdefault(event.row, []).extend(event.delta.token_ids)
    assert batch.num_rows == 0
    assert progress_seen
    for i in (0, 2, 3, 4):
        assert got[rows[i]] == expected[i], f"row {i} differs from its solo run"
    assert rows[1] not in got
    batch.close()


@pytest.mark.parametrize(
    "budget",
    [
        TokenBudget(24, 12, 8),
        TokenBudget(1, 6, 4),
        TokenBudget(4096, 4096, 64),
        TokenBudget(24, 12, 8, alone_from=6),
    ],
    ids=["tight", "one prompt at a time, tiny chunks", "everything at once", "long ones alone"],
)
def test_greedy_rows_under_any_token_budget_match_solo_runs(tiny_engine, budget):
    params = SamplingParams(temperature=0, max_tokens=12)
    expected = [solo_tokens(tiny_engine, p, params) for p in PROMPTS]
    batch = BatchEngine(tiny_engine, max_batch=8, prefill_chunk=8, budget=budget)
    rows = [batch.add(tiny_engine.prepare(p, params)) for p in PROMPTS[:2]]
    batch.step()
    batch.step()  # two rows decode while the rest are prepared beside them
    rows += [batch.add(tiny_engine.prepare(p, params)) for p in PROMPTS[2:]]
    got = run_batch(batch)
    assert [got[row] for row in rows] == expected
    batch.close()


def test_seeded_sampling_is_the_same_alone_and_in_a_batch(tiny_engine):
    seeded = SamplingParams(temperature=1.0, top_k=50, seed=1234, max_tokens=12)
    alone = solo_tokens(tiny_engine, PROMPTS[0], seeded)
    assert alone == solo_tokens(tiny_engine, PROMPTS[0], seeded)
    other_seed = SamplingParams(temperature=1.0, top_k=50, seed=99, max_tokens=12)
    assert alone != solo_tokens(tiny_engine, PROMPTS[0], other_seed)

    batch = BatchEngine(tiny_engine, max_batch=4)
    row = batch.add(tiny_engine.prepare(PROMPTS[0], seeded))
    batch.add(tiny_engine.prepare(PROMPTS[1], SamplingParams(temperature=0.8, max_tokens=12)))
    batch.add(tiny_engine.prepare(PROMPTS[2], SamplingParams(temperature=0, max_tokens=12)))
    assert run_batch(batch)[row] == alone


def test_finished_rows_report_stats_and_free_their_kv(tiny_engine):
    batch = BatchEngine(tiny_engine, max_batch=4)
    params = SamplingParams(temperature=0, max_tokens=5)
    for p in PROMPTS[:3]:
        batch.add(tiny_engine.prepare(p, params))
    finals = []
    while batch.num_rows:
        finals += [e for e in batch.step() if isinstance(e, RowOutput) and e.stats]
    assert [f.stats.generated_tokens for f in finals] == [5, 5, 5]
    assert all(f.delta.finish_reason == "length" for f in finals)
    assert batch.kv_bytes == 0


def test_a_parked_row_resumes_with_the_same_greedy_tokens(tiny_engine):
    params = SamplingParams(temperature=0, max_tokens=20)
    expected = [solo_tokens(tiny_engine, p, params) for p in PROMPTS[:3]]
    batch = BatchEngine(tiny_engine, max_batch=4)
    rows = [batch.add(tiny_engine.prepare(p, params)) for p in PROMPTS[:3]]
    got: dict[int, list[int]] = {row: [] for row in rows}
    steps = 0
    while batch.num_rows:
        steps += 1
        if steps == 6:
            assert batch.can_park(rows[1])
            batch.park(rows[1])
            assert batch.num_active == 2 and batch.num_rows == 3
            assert batch.kv_bytes > 0
        if steps == 11:
            batch.resume(rows[1])
        for event in batch.step():
            if isinstance(event, RowOutput):
                got[event.row].extend(event.delta.token_ids)
    assert [got[row] for row in rows] == expected
    assert batch.kv_bytes == 0


def test_a_failing_sampler_fails_only_its_own_row(tiny_engine):
    def sampler_factory(params: SamplingParams):
        if params.seed != 666:
            return make_row_sampler(params)

        def explode(logprobs):
            raise RuntimeError("boom")

        return explode

    greedy = SamplingParams(temperature=0, max_tokens=8)
    expected = [solo_tokens(tiny_engine, p, greedy) for p in PROMPTS[:2]]
    batch = BatchEngine(tiny_engine, max_batch=4, sampler_factory=sampler_factory)
    rows = [batch.add(tiny_engine.prepare(p, greedy)) for p in PROMPTS[:2]]
    doomed = batch.add(
        tiny_engine.prepare(PROMPTS[2], SamplingParams(temperature=1.0, seed=666, max_tokens=8))
    )
    got: dict[int, list[int]] = {row: [] for row in rows}
    failures = []
    while batch.num_rows:
        for event in batch.step():
            if isinstance(event, RowFailed):
                failures.append(event)
            elif isinstance(event, RowOutput):
                assert event.row != doomed
                got[event.row].extend(event.delta.token_ids)
    assert [(f.row, f.message) for f in failures] == [
        (doomed, "sampler failed: RuntimeError: boom")
    ]
    assert [got[row] for row in rows] == expected


def test_several_steps_a_call_give_each_row_its_tokens_in_one_event(tiny_engine):
    params = SamplingParams(temperature=0, max_tokens=9, logprobs=True, top_logprobs=2)
    expected = [solo_tokens(tiny_engine, p, params) for p in PROMPTS[:3]]
    batch = BatchEngine(tiny_engine, max_batch=4)
    rows = [batch.add(tiny_engine.prepare(p, params)) for p in PROMPTS[:3]]
    got: dict[int, list[int]] = {row: [] for row in rows}
    finals = {}
    while batch.num_rows:
        events = batch.step(4)
        outputs = [e for e in events if isinstance(e, RowOutput)]
        assert len({e.row for e in outputs}) == len(outputs), "one output per row a call"
        for event in outputs:
            assert len(event.delta.logprobs) == len(event.delta.token_ids)
            got[event.row].extend(event.delta.token_ids)
            if event.stats is not None:
                finals[event.row] = event
    assert [got[row] for row in rows] == expected
    assert all(
        f.stats.generated_tokens == 9 and f.delta.finish_reason == "length" for f in finals.values()
    )
    assert batch.kv_bytes == 0


def solo_deltas(engine: Engine, prompt: str, params: SamplingParams) -> tuple[str, list[int], str]:
    deltas = list(engine.generate(engine.prepare(prompt, params)))
    text = "".join(d.text for d in deltas)
    return text, [t for d in deltas for t in d.token_ids], deltas[-1].finish_reason


@pytest.mark.parametrize("steps", [3, 8])
def test_rows_that_end_part_way_through_a_call_match_the_serial_path(tiny_engine, steps):
    # A stop string is seen only when the call's tokens are decoded, so that row steps past
    # it; a stop token or max_tokens ends a row in its step, solo or batched.
    greedy = SamplingParams(temperature=0, max_tokens=24)
    text, tokens, _ = solo_deltas(tiny_engine, PROMPTS[0], greedy)
    assert len(text) >= 6 and len(tokens) >= 8, text
    wanted = [
        (PROMPTS[0], SamplingParams(temperature=0, max_tokens=24, stop=(text[3:6],))),
        (PROMPTS[0], SamplingParams(temperature=0, max_tokens=24, stop_token_ids=(tokens[5],))),
        (PROMPTS[1], SamplingParams(temperature=0, max_tokens=5)),
    ]
    expected = [solo_deltas(tiny_engine, p, params) for p, params in wanted]
    assert expected[0][2] == expected[1][2] == "stop" and expected[2][2] == "length"
    for together in (wanted, wanted[1:2]):  # in the batch; then a lone row, solo
        batch = BatchEngine(tiny_engine, max_batch=4)
        rows = [batch.add(tiny_engine.prepare(p, params)) for p, params in together]
        got = {row: ("", [], None) for row in rows}
        while batch.num_rows:
            for event in batch.step(steps):
                if isinstance(event, RowOutput):
                    text, ids, _ = got[event.row]
                    delta = event.delta
                    got[event.row] = (text + delta.text, ids + list(delta.token_ids), None)
                    if event.stats is not None:
                        got[event.row] = (*got[event.row][:2], delta.finish_reason)
        want = expected if together is wanted else expected[1:2]
        assert [got[row] for row in rows] == want
        assert batch.kv_bytes == 0


def test_a_first_token_ends_the_call_and_the_other_rows_keep_its_tokens(tiny_engine):
    params = SamplingParams(temperature=0, max_tokens=40)
    expected = solo_tokens(tiny_engine, PROMPTS[0], params)
    batch = BatchEngine(tiny_engine, max_batch=4)
    running = batch.add(tiny_engine.prepare(PROMPTS[0], params))
    got: list[int] = []
    while not got:
        got += [t for e in batch.step() if isinstance(e, RowOutput) for t in e.delta.token_ids]
    (output,) = [e for e in batch.step(8) if isinstance(e, RowOutput)]
    assert len(output.delta.token_ids) == 8
    got += output.delta.token_ids
    arriving = batch.add(tiny_engine.prepare(PROMPTS[1], params))
    outputs: dict[int, RowOutput] = {}
    while arriving not in outputs:
        steps_before = batch.steps_run
        outputs = {e.row: e for e in batch.step(8) if isinstance(e, RowOutput)}
        got += outputs[running].delta.token_ids if running in outputs else ()
    assert batch.steps_run - steps_before < 8  # the arriving row's first token ended it
    assert len(outputs[arriving].delta.token_ids) == 1
    assert running not in outputs  # its tokens of that short call wait for the next call
    (output,) = [e for e in batch.step(8) if e.row == running and isinstance(e, RowOutput)]
    assert len(output.delta.token_ids) > 8
    got += output.delta.token_ids
    assert got == expected[: len(got)]
    batch.remove([running, arriving])


def test_a_lone_row_goes_solo_and_rejoins_the_batch_when_another_arrives(tiny_engine):
    params = SamplingParams(temperature=0, max_tokens=16)
    expected = [solo_tokens(tiny_engine, p, params) for p in PROMPTS[:2]]
    batch = BatchEngine(tiny_engine, max_batch=4)
    first = batch.add(tiny_engine.prepare(PROMPTS[0], params))
    got: dict[int, list[int]] = {first: []}
    second = None
    steps = 0
    while batch.num_rows:
        steps += 1
        if steps == 6:
            assert batch.solo_row == first and batch.num_active == 1 and batch.kv_bytes > 0
            second = batch.add(tiny_engine.prepare(PROMPTS[1], params))
            got[second] = []
            assert batch.solo_row is None
        for event in batch.step():
            if isinstance(event, RowOutput):
                got[event.row].extend(event.delta.token_ids)
    assert [got[first], got[second]] == expected
    assert batch.kv_bytes == 0


def test_a_row_on_an_empty_batch_goes_solo_from_its_prompt_unless_another_comes_first(
    tiny_engine,
):
    # A short prompt on an empty batch is prefilled by generate_step (sooner to its first
    # token than mlx-lm's BatchGenerator at one row); a long one, or a row joined by another
    # before its first step, goes through the batch. The tokens are the same either way.
    params = SamplingParams(temperature=0, max_tokens=8)
    expected = [solo_tokens(tiny_engine, p, params) for p in PROMPTS[:3]]
    requests = [tiny_engine.prepare(p, params) for p in PROMPTS[:3]]
    batch = BatchEngine(tiny_engine, max_batch=4, prefill_chunk=32)
    assert len(requests[0].prompt_tokens) <= 32 < len(requests[2].prompt_tokens)

    row = batch.add(requests[0])
    assert batch.solo_row == row
    first = batch.step()
    assert isinstance(first[0], RowProgress) and first[0].done == first[0].total
    assert list(first[1].delta.token_ids) == expected[0][:1]
    assert run_batch(batch)[row] == expected[0][1:]

    first, second = batch.add(requests[0]), batch.add(requests[1])  # no step between
    assert batch.solo_row is None
    assert run_batch(batch) == {first: expected[0], second: expected[1]}

    long = batch.add(requests[2])
    assert batch.solo_row is None
    assert run_batch(batch) == {long: expected[2]}

    gone = batch.add(requests[1])
    batch.remove([gone])  # before its first step
    assert batch.num_rows == 0 and batch.kv_bytes == 0 and batch.step() == []
    batch.close()


def test_a_solo_row_parks_resumes_and_is_removed_like_any_other(tiny_engine):
    params = SamplingParams(temperature=0, max_tokens=20)
    expected = solo_tokens(tiny_engine, PROMPTS[0], params)
    batch = BatchEngine(tiny_engine, max_batch=4)
    row = batch.add(tiny_engine.prepare(PROMPTS[0], params))
    got: list[int] = []
    steps = 0
    while batch.num_rows:
        steps += 1
        if steps == 5:
            assert batch.solo_row == row and batch.can_park(row)
            batch.park(row)
            assert batch.solo_row is None and batch.num_active == 0 and batch.kv_bytes > 0
            assert batch.step() == []
            batch.resume(row)
        for event in batch.step():
            if isinstance(event, RowOutput):
                got.extend(event.delta.token_ids)
    assert got == expected

    other = batch.add(tiny_engine.prepare(PROMPTS[1], params))
    for _ in range(4):
        batch.step()
    assert batch.solo_row == other
    batch.remove([other])
    assert batch.num_rows == 0 and batch.kv_bytes == 0


def test_a_row_with_penalties_goes_solo_and_its_penalties_see_its_whole_history(
    tiny_engine, monkeypatch
):
    penalized = SamplingParams(
        temperature=0, max_tokens=24, repetition_penalty=1.8, presence_penalty=1.5
    )
    short = SamplingParams(temperature=0, max_tokens=3)
    seen: list[int] = []  # how many tokens the penalized row's processors saw at each step

    def processors(params: SamplingParams, tokenizer: object = None):
        def record(tokens: mx.array, logits: mx.array) -> mx.array:
            seen.append(tokens.size)
            return logits

        made = make_row_processors(params, tokenizer)
        return [*made, record] if params is penalized else made

    monkeypatch.setattr("mlx_trio.engine.batch.batch_row.make_row_processors", processors)

    def run(solo: bool) -> tuple[list[int], bool]:
        seen.clear()
        batch = BatchEngine(tiny_engine, max_batch=4, solo=solo)
        row = batch.add(tiny_engine.prepare(PROMPTS[0], penalized))
        batch.add(tiny_engine.prepare(PROMPTS[1], short))  # it leaves; the first goes solo
        tokens, went_solo = [], False
        while batch.num_rows:
            for event in batch.step():
                if isinstance(event, RowOutput) and event.row == row:
                    tokens += event.delta.token_ids
            went_solo |= batch.solo_row == row
        return tokens, went_solo

    prompt = len(tiny_engine.prepare(PROMPTS[0], penalized).prompt_tokens)
    in_batch, _ = run(solo=False)
    solo, went_solo = run(solo=True)
    assert went_solo
    assert solo == in_batch
    # Every step, solo ones included, showed the processors the whole prompt and the tokens
    # so far (without its history a solo step would show only those since it went solo).
    assert seen == sorted(seen) and seen[0] == prompt
    assert seen[-1] >= prompt + len(in_batch) - 1
    assert solo_tokens(tiny_engine, PROMPTS[0], penalized) == in_batch  # solo from its prompt


def run_ahead(batch: BatchEngine) -> int:
    """Idle work as the engine thread does it while no job waits (the ended rows' KV to the
    prompt cache, steps ahead); returns the steps run."""
    before = batch.steps_run
    while batch.step_ahead():
        pass
    return batch.steps_run - before


def test_steps_run_ahead_of_a_call_count_as_its_own_and_change_no_token(tiny_engine):
    params = SamplingParams(temperature=0, max_tokens=20)
    expected = [solo_tokens(tiny_engine, p, params) for p in PROMPTS[:3]]
    batch = BatchEngine(tiny_engine, max_batch=4)
    rows = [batch.add(tiny_engine.prepare(p, params)) for p in PROMPTS[:3]]
    removed = batch.add(tiny_engine.prepare(PROMPTS[3], params))
    got: dict[int, list[int]] = {row: [] for row in rows}
    calls = 0
    while batch.num_rows:
        calls += 1
        if calls == 3:  # after steps ran ahead: the row keeps those tokens while parked
            batch.park(rows[1])
        if calls == 4:
            batch.resume(rows[1])
            batch.remove([removed])  # ... or loses them with the row
        steps_before = batch.steps_run
        outputs = [e for e in batch.step(4) if isinstance(e, RowOutput)]
        steps_in_call = batch.steps_run - steps_before
        for event in outputs:
            assert event.row != removed or calls < 4
            if event.row != removed:
                got[event.row].extend(event.delta.token_ids)
        if calls == 5:  # three steps ran ahead of this call: it ran the fourth
            assert steps_in_call == 1
            assert [len(e.delta.token_ids) for e in outputs] == [4, 4, 4]
        assert run_ahead(batch) <= 3
    assert [got[row] for row in rows] == expected
    assert batch.kv_bytes == 0


def test_a_row_that_ends_in_a_step_run_ahead_cannot_be_parked_and_ends_with_the_next_call(
    tiny_engine,
):
    params = SamplingParams(temperature=0, max_tokens=6)
    expected = solo_tokens(tiny_engine, PROMPTS[0], params)
    batch = BatchEngine(tiny_engine, max_batch=4)
    row = batch.add(tiny_engine.prepare(PROMPTS[0], params))
    (first,) = [e for e in batch.step(4) if isinstance(e, RowOutput)]  # its first token
    assert len(first.delta.token_ids) == 1 and batch.solo_row == row
    assert run_ahead(batch) == 3
    (middle,) = [e for e in batch.step(4) if isinstance(e, RowOutput)]
    assert len(middle.delta.token_ids) == 4 and middle.stats is None
    assert run_ahead(batch) == 1  # its sixth token ends it
    assert not batch.can_park(row)
    (last,) = [e for e in batch.step(4) if isinstance(e, RowOutput)]
    assert last.stats is not None and last.delta.finish_reason == "length"
    assert [*first.delta.token_ids, *middle.delta.token_ids, *last.delta.token_ids] == expected
    assert batch.num_rows == 0 and batch.kv_bytes == 0


def test_one_step_calls_hand_out_what_ran_ahead_and_run_no_step_of_their_own(tiny_engine):
    # A small batch's calls (steps 1, ahead 4): the engine runs up to 4 steps between calls;
    # a call returns their tokens at once and runs a step only when none ran ahead.
    params = SamplingParams(temperature=0, max_tokens=12)
    expected = [solo_tokens(tiny_engine, p, params) for p in PROMPTS[:2]]
    batch = BatchEngine(tiny_engine, max_batch=4)
    rows = [batch.add(tiny_engine.prepare(p, params)) for p in PROMPTS[:2]]
    got: dict[int, list[int]] = {row: [] for row in rows}
    calls: list[tuple[int, list[int]]] = []  # each call's own steps, and its outputs' tokens
    while batch.num_rows:
        before = batch.steps_run
        events = batch.step(1, ahead=4)
        outputs = [e for e in events if isinstance(e, RowOutput)]
        calls.append((batch.steps_run - before, [len(e.delta.token_ids) for e in outputs]))
        for event in outputs:
            got[event.row].extend(event.delta.token_ids)
        assert run_ahead(batch) <= 4
    assert [got[row] for row in rows] == expected  # greedy output unchanged
    # A first token goes out with the next call at once (no step runs ahead after it); every
    # later call ran none of its own and handed out the 4 steps run ahead of it (the last,
    # what was left).
    first = next(i for i, (_, sizes) in enumerate(calls) if sizes)
    assert calls[first][1] == [1, 1]
    assert calls[first + 1 :] == [(0, [4, 4]), (0, [4, 4]), (0, [3, 3])]


def test_a_step_that_fails_ahead_of_a_call_raises_from_the_next_call(tiny_engine, monkeypatch):
    params = SamplingParams(temperature=0, max_tokens=20)
    batch = BatchEngine(tiny_engine, max_batch=4)
    rows = [batch.add(tiny_engine.prepare(p, params)) for p in PROMPTS[:2]]
    while not any(isinstance(e, RowOutput) for e in batch.step(4)):
        pass

    def broken(*_: object) -> None:
        raise RuntimeError("the device went away")

    monkeypatch.setattr(batch, "_step", broken)
    assert not batch.step_ahead()
    assert not batch.step_ahead()  # none runs ahead after a fault
    with pytest.raises(RuntimeError, match="the device went away"):
        batch.remove(rows[:1])
    batch.close()


def test_log_probabilities_are_normalized_for_the_rows_that_ask_beside_rows_that_do_not(
    tiny_engine,
):
    # The batch skips the normalization while no row asks for log-probabilities
    # (engine/batch/lean_step.py): a row that asks still gets them normalized, whoever joined first,
    # and nobody's greedy tokens change.
    free = SamplingParams(temperature=0, max_tokens=12)
    asks = SamplingParams(temperature=0, max_tokens=8, logprobs=True, top_logprobs=3)
    expected = {p: solo_tokens(tiny_engine, p, free) for p in PROMPTS[:2]}
    expected[PROMPTS[2]] = solo_tokens(tiny_engine, PROMPTS[2], asks)
    batch = BatchEngine(tiny_engine, max_batch=4)
    rows = {batch.add(tiny_engine.prepare(p, free)): p for p in PROMPTS[:2]}
    got: dict[int, list[int]] = {}
    for call in range(60):
        if call == 3:  # it joins rows already decoding without log-probabilities
            rows[batch.add(tiny_engine.prepare(PROMPTS[2], asks))] = PROMPTS[2]
        if not batch.num_rows:
            break
        for event in batch.step(1):
            if isinstance(event, RowOutput):
                got.setdefault(event.row, []).extend(event.delta.token_ids)
                if rows[event.row] == PROMPTS[2]:
                    for entry in event.delta.logprobs:
                        top = [math.exp(value) for _, value in entry.top]
                        assert entry.logprob <= 0 and 0 < sum(top) <= 1 + 1e-4
                        assert math.isclose(entry.logprob, entry.top[0][1], abs_tol=1e-5)
    assert {rows[row]: tokens for row, tokens in got.items()} == expected
