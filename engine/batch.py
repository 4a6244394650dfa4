"""The batch path: continuous batching over mlx-lm's ``BatchGenerator``, one step at a time.

:class:`BatchEngine` exposes the small operations the runtime drives: ``add`` rows, ``step``
(one decode step for every generating row plus one prefill chunk for rows still reading their
prompt, so a long prompt never stalls running rows), ``remove`` a row, ``park`` a row whose
consumer is not keeping up (its KV leaves the batch) and ``resume`` it later. Each row has its own
sampler and logits processors, and the same :class:`RowDecoder` as the single-request path.

Row ids are this class's own and stay the same across park and resume (mlx-lm gives a resumed
row a new uid).

A lone generating row leaves the ``BatchGenerator`` and is stepped by mlx-lm's ``generate_step``
instead, which runs one row faster (on an H200, 263 against 151 tok/s): the row goes "solo" with
its KV cache, the same way a parked row leaves, and goes back into the batch as a resumed row as
soon as another row arrives. A row added to an empty batch with a prompt of at most one prefill
chunk goes solo at once, prefilled by ``generate_step`` too, which reaches its first token
sooner; if another row arrives before its first step, it joins the batch with its prompt. A
solo row's logits processors (penalties) see the tokens it had before going solo too
(``with_history``), as they do in the batch.

A call's steps need not all run inside it: between calls, while the caller hands out the last
call's tokens, the engine thread runs up to ``steps - 1`` of the next call's steps ahead of it
(:meth:`BatchEngine.step_ahead`), and the call runs the rest. The rows it steps are the rows as
they are then; a row removed or parked meanwhile loses or keeps those tokens as it would any
other. Without this the engine waited out every hand-off: on an H200, where a step is mostly host
work and the GPU idles while the host waits, that was 3-5% of a wave (design/008, change 13).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Generator, Iterable
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
from mlx_lm.generate import BatchGenerator, StopSequences, generate_step
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.sample_utils import greedy_sampler

from mlx_trio.engine.generate import Engine
from mlx_trio.engine.outputs import RowEvent, RowFailed, RowOutput, RowProgress
from mlx_trio.engine.params import PreparedRequest, SamplingParams
from mlx_trio.engine.row import RowDecoder
from mlx_trio.engine.sampling import (
    LogitsProcessor,
    Sampler,
    make_row_processors,
    make_row_sampler,
    repair_random_state,
    with_history,
    with_injected_fault,
)

logger = logging.getLogger(__name__)

DEFAULT_PREFILL_CHUNK = 256


@dataclass(slots=True)
class _Row:
    id: int
    decoder: RowDecoder
    sampler: Sampler | None
    processors: list[LogitsProcessor]
    stops: StopSequences
    wants_logprobs: bool
    uid: int | None = None
    decoding: bool = False  # in mlx-lm's generation batch (not prefilling)
    parked: tuple[list[Any], list[int]] | None = None  # KV caches, tokens (last one not in them)
    # This engine call's tokens (and log-probability vectors, if asked for), decoded at its end.
    sampled: list[int] = field(default_factory=list)
    sampled_logprobs: list[mx.array] = field(default_factory=list)
    took_at: int = -1  # the step that gave it its last sampled token
    failure: str | None = None  # its sampler failed: it left the generator, fails at the end

    @property
    def num_sampled(self) -> int:
        """Tokens generated so far, this call's undecoded ones included."""
        return self.decoder.num_generated + len(self.sampled)


@dataclass(slots=True)
class _Solo:
    """The lone generating row, stepped by ``generate_step``; its caches hold a prefix of
    ``tokens`` (every token of the row so far)."""

    row_id: int
    steps: Generator[tuple[int, mx.array], None, None]
    caches: list[Any]
    tokens: list[int]
    # A row that went solo from its prompt, until its first step: the prompt left to prefill,
    # and the prompt cache's hit with the tokens it holds, to join the batch with instead.
    unstarted: tuple[list[int], list[Any] | None, list[int] | None] | None = None


class BatchEngine:
    """Rows generating together; every method must be called on the engine thread."""

    def __init__(
        self,
        engine: Engine,
        *,
        max_batch: int = 32,
        prefill_batch: int = 8,
        prefill_chunk: int = DEFAULT_PREFILL_CHUNK,
        sampler_factory: Callable[[SamplingParams], Sampler | None] = make_row_sampler,
        solo: bool = True,
    ) -> None:
        """``sampler_factory`` builds each row's sampler (None: greedy); it is the seam for
        injecting a failing sampler. ``solo``: step a lone row with ``generate_step``."""
        self._engine = engine
        self._sampler_factory = sampler_factory
        self._generator = BatchGenerator(
            engine.model,
            completion_batch_size=max_batch,
            prefill_batch_size=min(prefill_batch, max_batch),
            prefill_step_size=prefill_chunk,
        )
        self._rows: dict[int, _Row] = {}
        self._row_of_uid: dict[int, _Row] = {}  # the rows in mlx-lm's batch
        self._sampler_faults: dict[int, str] = {}
        self._next_row = 0
        self._solo_enabled = solo
        self._solo: _Solo | None = None
        self._prefill_chunk = prefill_chunk
        self._step_count = 0
        self._first_token = False  # a row got its first token in this call's steps
        # This call's steps so far (run ahead of it included): rows' latest progress, the rows
        # that got tokens; and how many steps ran ahead, of the most that may (the last
        # call's steps less one).
        self._progress: dict[int, RowProgress] = {}
        self._touched: dict[int, _Row] = {}
        self._ahead = 0
        self._ahead_limit = 0
        self._fault: Exception | None = None  # raised by a step run ahead; the next call raises
        self.max_batch = max_batch

    @property
    def num_rows(self) -> int:
        """Rows added and not yet finished or removed (prefilling, generating or parked)."""
        return len(self._rows)

    @property
    def num_active(self) -> int:
        """Rows being stepped (not parked)."""
        return len(self._row_of_uid) + (self._solo is not None)

    @property
    def steps_run(self) -> int:
        """Steps run so far (a call of several may stop short)."""
        return self._step_count

    @property
    def solo_row(self) -> int | None:
        """The row stepped by ``generate_step``, if one is."""
        return self._solo.row_id if self._solo is not None else None

    @property
    def kv_bytes(self) -> int:
        """Bytes held by the KV caches of every row, parked ones included."""
        parked = sum(c.nbytes for row in self._rows.values() if row.parked for c in row.parked[0])
        solo = sum(c.nbytes for c in self._solo.caches) if self._solo is not None else 0
        return self._generator.prompt_cache_nbytes + parked + solo

    def add(self, request: PreparedRequest) -> int:
        """Queue a row; it starts prefilling at the next step. Returns its row id."""
        self._raise_fault()
        self._end_solo()
        params = request.params
        decoder = RowDecoder(
            self._engine.tokenizer, params, num_prompt_tokens=len(request.prompt_tokens)
        )
        row_id = self._next_row
        self._next_row += 1
        sampler = with_injected_fault(self._sampler_factory(params), request)
        row = _Row(
            id=row_id,
            decoder=decoder,
            sampler=None if sampler is None else self._guard(row_id, sampler),
            processors=make_row_processors(params),
            stops=StopSequences([[t] for t in sorted(decoder.stop_token_ids)] or None),
            wants_logprobs=params.logprobs,
        )
        prompt = list(request.prompt_tokens)
        cache = self._engine.prompt_cache
        hit = cache.take(prompt) if cache is not None else None
        skip = 0 if hit is None else hit.num_tokens
        decoder.num_cached_tokens = skip
        hit_cache = None if hit is None else hit.cache
        context = None if hit is None else prompt[:skip]
        rest = prompt[skip:]
        if self._can_start_solo(row, len(rest)):
            self._start_solo_from_prompt(row_id, row, prompt, (rest, hit_cache, context))
        else:
            self._insert(row, rest, params.max_tokens, hit_cache, context)
        self._rows[row_id] = row  # only once mlx-lm took it: a failed add changes nothing
        return row_id

    def _insert(
        self,
        row: _Row,
        prompt: list[int],
        max_tokens: int,
        cache: list[Any] | None,
        context: list[int] | None,
    ) -> None:
        (uid,) = self._generator.insert(
            [prompt],
            max_tokens=[max_tokens],
            caches=[cache] if cache is not None else None,
            all_tokens=[context] if context is not None else None,
            samplers=[row.sampler],
            logits_processors=[row.processors],
            stop_sequences=[row.stops],
        )
        row.uid = uid
        row.decoding = False
        self._row_of_uid[uid] = row

    def _guard(self, row_id: int, sampler: Sampler) -> Sampler:
        """A sampler whose failure fails only its own row: it records the error, returns a
        placeholder token, and :meth:`step` then drops the row with a :class:`RowFailed`.
        Whatever shared state the failure broke (MLX's global random state) is repaired
        before the step's graph is evaluated, so the other rows' step goes on."""

        def guarded(logprobs: mx.array) -> mx.array:
            try:
                return sampler(logprobs)
            except Exception as exc:
                self._sampler_faults[row_id] = f"sampler failed: {type(exc).__name__}: {exc}"
                repair_random_state()
                return mx.argmax(logprobs, axis=-1)

        return guarded

    def remove(self, rows: Iterable[int]) -> None:
        """Drop rows (cancelled, failed or parked); unknown ids are ignored. Frees their KV,
        after giving the prompt cache what they had prefilled (a retry resumes from there)."""
        self._raise_fault()
        uids = []
        for row_id in rows:
            row = self._rows.pop(row_id, None)
            if row is not None and (uid := self._detach(row_id, row)) is not None:
                uids.append(uid)
        self._remove_uids(uids)

    def _detach(self, row_id: int, row: _Row) -> int | None:
        """Stop stepping a row: a solo or parked row gives its KV to the prompt cache; a row in
        mlx-lm's batch is unmapped and its uid returned, for :meth:`_remove_uids`."""
        if row_id == self.solo_row:
            if self._solo_unstarted():
                _, hit_cache, context = self._drop_unstarted_solo()
                self._commit(context or [], hit_cache)  # the prompt cache's hit goes back
            else:  # it goes as a parked row does
                row.parked = self._drop_solo()
        if row.uid is not None:
            uid, row.uid = row.uid, None
            del self._row_of_uid[uid]
            return uid
        if row.parked is not None:
            caches, tokens = row.parked
            row.parked = None
            self._commit(tokens[:-1], caches)
        return None

    def _remove_uids(self, uids: list[int]) -> None:
        if not uids:
            return
        if self._engine.prompt_cache is None:
            self._generator.remove(uids)
            return
        for caches, tokens in self._generator.remove(uids, return_prompt_caches=True).values():
            self._commit(list(tokens), caches)

    def _commit(self, tokens: list[int], caches: list[Any] | None) -> None:
        if self._engine.prompt_cache is not None and caches:
            self._engine.prompt_cache.put(tokens, caches)

    def can_park(self, row_id: int) -> bool:
        """Whether a row is decoding (in mlx-lm's generation batch, or solo): not prefilling,
        not parked."""
        row = self._rows.get(row_id)
        solo = row_id == self.solo_row and not self._solo_unstarted()
        # (A row that ended in a step run ahead is decoding no more: it left mlx-lm's batch.)
        return row is not None and ((row.decoding and row.uid is not None) or solo)

    def park(self, row_id: int) -> None:
        """Take a generating row out of the batch, keeping its KV cache for :meth:`resume`.

        The cache already holds the last emitted token (mlx-lm computes one step ahead), so it
        is trimmed by one and that token is fed again on resume: greedy output is unchanged.
        """
        self._raise_fault()
        assert self.can_park(row_id), "only a generating row can be parked"
        solo = row_id == self.solo_row
        self._rows[row_id].parked = self._drop_solo() if solo else self._take_out(row_id)

    def _take_out(self, row_id: int) -> tuple[list[Any], list[int]]:
        """Take a generating row out of mlx-lm's batch: its caches and tokens, parked-style."""
        row = self._rows[row_id]
        assert row.uid is not None
        caches, tokens = self._generator.extract_cache([row.uid])[row.uid]
        for cache in caches:
            cache.trim(1)
        self._generator.remove([row.uid])
        del self._row_of_uid[row.uid]
        row.uid = None
        row.decoding = False
        return caches, list(tokens)

    # -- a lone row ---------------------------------------------------------------------------

    def _start_solo(self) -> None:
        """Go solo if exactly one row is left, generating."""
        if not self._solo_enabled or self._solo is not None or len(self._rows) != 1:
            return
        ((row_id, row),) = self._rows.items()
        if not row.decoding or row.uid is None:
            return
        caches, tokens = self._take_out(row_id)
        steps = self._solo_steps(row, tokens[-1:], caches, history=tokens[:-1])
        self._solo = _Solo(row_id, steps, caches, tokens)

    def _solo_steps(
        self, row: _Row, prompt: list[int], caches: list[Any], *, history: list[int]
    ) -> Generator[tuple[int, mx.array], None, None]:
        """``generate_step`` for a solo row: ``prompt`` to prefill on top of ``caches`` (which
        hold ``history``), then the row's remaining tokens."""
        return generate_step(
            mx.array(prompt),
            self._engine.model,
            max_tokens=row.decoder.params.max_tokens - row.num_sampled,
            sampler=row.sampler or greedy_sampler,
            logits_processors=with_history(row.processors, history),
            prompt_cache=caches,
            prefill_step_size=self._prefill_chunk,
        )

    def _can_start_solo(self, row: _Row, prompt_tokens: int) -> bool:
        """Whether a new row can go solo from its prompt: the batch is empty and its prompt
        (past a prompt-cache hit) fits one prefill chunk, so a row arriving meanwhile waits no
        longer for it than for a chunk in the batch."""
        return (
            self._solo_enabled
            and self._solo is None
            and not self._rows
            and 0 < prompt_tokens <= self._prefill_chunk
        )

    def _start_solo_from_prompt(
        self,
        row_id: int,
        row: _Row,
        prompt: list[int],
        unstarted: tuple[list[int], list[Any] | None, list[int] | None],
    ) -> None:
        rest, hit_cache, context = unstarted
        caches = hit_cache if hit_cache is not None else make_prompt_cache(self._engine.model)
        steps = self._solo_steps(row, rest, caches, history=context or [])
        self._solo = _Solo(row_id, steps, caches, list(prompt), unstarted)

    def _solo_unstarted(self) -> bool:
        """Whether the solo row went solo from its prompt and has not had its first step."""
        return self._solo is not None and self._solo.unstarted is not None

    def _drop_unstarted_solo(self) -> tuple[list[int], list[Any] | None, list[int] | None]:
        """Stop a solo row before its first step: its prompt left to prefill, and the prompt
        cache's hit with the tokens it holds."""
        solo, self._solo = self._solo, None
        assert solo is not None and solo.unstarted is not None
        solo.steps.close()
        return solo.unstarted

    def _drop_solo(self) -> tuple[list[Any], list[int]]:
        """Stop stepping the solo row: its caches and tokens, parked-style."""
        solo, self._solo = self._solo, None
        assert solo is not None and solo.unstarted is None
        solo.steps.close()
        keep = len(solo.tokens) - 1  # the last token is fed again, as on resume
        for cache in solo.caches:
            cache.trim(cache.offset - keep)
        return solo.caches, solo.tokens

    def _end_solo(self) -> None:
        """Put the solo row, if any, back into the batch as a resumed row."""
        if self._solo is None:
            return
        row_id = self._solo.row_id
        if self._solo_unstarted():  # it has not run: it joins the batch with its prompt
            rest, hit_cache, context = self._drop_unstarted_solo()
            row = self._rows[row_id]
            self._insert(row, rest, row.decoder.params.max_tokens, hit_cache, context)
            return
        self._rows[row_id].parked = self._drop_solo()
        self.resume(row_id)

    def _solo_step(self, solo: _Solo) -> None:
        token, logprobs = next(solo.steps)
        if solo.unstarted:  # its prompt was prefilled in this step
            prefilled = len(solo.unstarted[0])
            self._progress[solo.row_id] = RowProgress(solo.row_id, prefilled, prefilled)
            solo.unstarted = None
        solo.tokens.append(token)
        row = self._rows[solo.row_id]
        self._take(row, token, logprobs)
        if token in row.decoder.stop_token_ids or row.num_sampled >= row.decoder.params.max_tokens:
            # The row ends here (generate_step knows no stop tokens): its KV goes now.
            self._solo = None
            solo.steps.close()
            self._commit(solo.tokens[: solo.caches[0].offset], solo.caches)

    def resume(self, row_id: int) -> None:
        """Put a parked row back into the batch; it continues where it stopped."""
        self._raise_fault()
        row = self._rows[row_id]
        assert row.parked is not None, "resume of a row that is not parked"
        caches, tokens = row.parked
        row.parked = None
        remaining = row.decoder.params.max_tokens - row.num_sampled
        self._insert(row, [tokens[-1]], remaining, caches, tokens[:-1])

    def step(self, steps: int = 1) -> list[RowEvent]:
        """Run ``steps`` batch steps, fewer once no row is left or a row got its first token
        (a first token never waits for the rest of a call). Returns each row's latest
        progress, one output per row with its tokens, then the rows that failed.

        Steps run ahead of the call (:meth:`step_ahead`) count among its ``steps``; the call
        runs the rest, at least one.

        A row's tokens come out once it has ``steps`` of them (so a call that a first token
        cut short does not cost an output for every other row), with its first token, and
        when it ends; until then it keeps them for a later call. They are decoded as they
        come out: a stop token or ``max_tokens`` ends a row in the step that reaches it, but a
        stop string is only seen then, so such a row may have stepped on; the decoder drops
        its extra tokens.

        If this raises, the generator's state is undefined: the caller fails the rows it
        holds and builds a new :class:`BatchEngine`.
        """
        self._raise_fault()
        for _ in range(max(1, steps - self._ahead)):
            if not self.num_active or self._first_token:
                break
            self._step_once()
        events = self._call_events(steps)
        self._ahead, self._ahead_limit = 0, steps - 1
        self._first_token = False
        self._progress, self._touched = {}, {}
        return events

    def step_ahead(self) -> bool:
        """Run one step of the next call before it comes, if it may: fewer than ``steps - 1``
        (the last call's) have run ahead, no row got its first token since (it goes out at
        once with the next call), and a row is being stepped. Returns whether it stepped.

        The engine thread calls this while no job waits. A step that raises here raises from
        the next call instead (whichever it is), and none runs ahead until then.
        """
        if (
            self._fault is not None
            or self._ahead >= self._ahead_limit
            or self._first_token
            or not self.num_active
        ):
            return False
        try:
            self._step_once()
        except Exception as exc:
            self._fault = exc
            return False
        self._ahead += 1
        return True

    def _raise_fault(self) -> None:
        if self._fault is not None:
            fault, self._fault = self._fault, None
            raise fault

    def _step_once(self) -> None:
        self._step_count += 1
        self._step()
        if self._sampler_faults:
            self._fail_faulted()

    def _call_events(self, steps: int) -> list[RowEvent]:
        """The call's events from its rows' tokens (rows with fewer than ``steps`` of them
        keep theirs, see :meth:`step`); finished rows leave."""
        outputs: list[RowEvent] = []
        failures: list[RowEvent] = []
        leaving: list[int] = []
        for row_id, row in self._touched.items():
            if self._rows.get(row_id) is not row:  # removed after a step run ahead
                continue
            if self._keeps_tokens(row, steps):
                continue
            output = self._decode(row)
            if output is not None and output.stats is not None:  # finished
                del self._rows[row_id]
                if (uid := self._detach(row_id, row)) is not None:
                    leaving.append(uid)
                outputs.append(output)
                continue
            if output is not None:
                outputs.append(output)
            if row.failure is not None:
                del self._rows[row_id]
                failures.append(RowFailed(row=row_id, message=row.failure))
            else:  # (a row parked after steps ran ahead of the call is not stepped)
                assert self._is_stepped(row) or row.parked is not None, (
                    "mlx-lm finished a row that its decoder did not"
                )
        self._remove_uids(leaving)
        return [*self._progress.values(), *outputs, *failures]

    def _keeps_tokens(self, row: _Row, steps: int) -> bool:
        """Whether a row keeps its tokens for a later call: it has fewer than ``steps``, none
        of them its first, and it is still being stepped (not ended, not failed)."""
        return (
            len(row.sampled) < steps
            and row.decoder.num_generated > 0
            and row.failure is None
            and self._is_stepped(row)
        )

    def _is_stepped(self, row: _Row) -> bool:
        """Whether a row is still being stepped: in mlx-lm's batch, or the solo row."""
        return row.uid is not None or row.id == self.solo_row

    def _step(self) -> None:
        self._start_solo()
        if self._solo is not None:
            self._solo_step(self._solo)
            return
        if not self._row_of_uid:
            return
        prompt_responses, generation_responses = self._generator.next()
        in_batch, touched = self._row_of_uid, self._touched
        for response in prompt_responses:
            if (row := in_batch.get(response.uid)) is not None:
                done, total = response.progress
                self._progress[row.id] = RowProgress(row=row.id, done=done, total=total)
        # This runs for every generating row in every step, on the thread that also builds the
        # next step: it is :meth:`_take` inlined, its first-token check done only where a first
        # token can be (a row's first step in the batch).
        step = self._step_count
        for response in generation_responses:
            if (row := in_batch.get(response.uid)) is None:
                continue
            if not row.decoding:
                row.decoding = True
                self._first_token |= row.num_sampled == 0
            row.sampled.append(response.token)
            if row.wants_logprobs:
                row.sampled_logprobs.append(response.logprobs)
            row.took_at = step
            touched[row.id] = row
            if response.finish_reason is not None:  # mlx-lm dropped the row, handed back its KV
                del in_batch[response.uid]
                row.uid = None
                self._commit(list(response.all_tokens or []), response.prompt_cache)

    def _take(self, row: _Row, token: int, logprobs: mx.array) -> None:
        """Keep a token the row sampled in this step (the solo row's; batch rows' are kept
        inline in :meth:`_step`)."""
        self._first_token |= row.num_sampled == 0
        row.sampled.append(token)
        if row.wants_logprobs:
            row.sampled_logprobs.append(logprobs)
        row.took_at = self._step_count
        self._touched[row.id] = row

    def _decode(self, row: _Row) -> RowOutput | None:
        """The row's output for this call's tokens (None if it got none); ``stats`` is set if
        the row finished."""
        if not row.sampled:
            return None
        tokens, row.sampled = row.sampled, []
        logprobs, row.sampled_logprobs = row.sampled_logprobs, []
        delta = row.decoder.feed_many(tokens, logprobs if row.wants_logprobs else None)
        if delta.finish_reason is None:
            return RowOutput(row=row.id, delta=delta)
        return RowOutput(row=row.id, delta=delta, stats=row.decoder.stats())

    def _fail_faulted(self) -> None:
        """Stop stepping the rows whose sampler failed in this step; the end of the call
        reports their earlier tokens and then their failure. The token a row got in the
        failing step is dropped: it may be the failed sampler's placeholder."""
        faults, self._sampler_faults = self._sampler_faults, {}
        uids = []
        for row_id, message in faults.items():
            row = self._rows.get(row_id)
            if row is None or row.failure is not None:
                continue
            row.failure = message
            if row.sampled and row.took_at == self._step_count:
                row.sampled.pop()
                if row.sampled_logprobs:
                    row.sampled_logprobs.pop()
            if (uid := self._detach(row_id, row)) is not None:
                uids.append(uid)
            self._touched[row_id] = row
        self._remove_uids(uids)

    def close(self) -> None:
        """Release every row and the generator."""
        if self._solo is not None:
            self._solo.steps.close()
            self._solo = None
        self._rows.clear()
        self._row_of_uid.clear()
        self._generator.close()
