"""The batch path: continuous batching over mlx-lm's ``BatchGenerator``, one step at a time.

:class:`BatchEngine` exposes the small operations the runtime drives: ``add`` rows, ``step``
(one decode step for every generating row plus one prefill chunk for rows still reading their
prompt, so a long prompt never stalls running rows), ``remove`` a row, ``park`` a row whose
consumer is not keeping up (its KV leaves the batch) and ``resume`` it later. Each row has its own
sampler and logits processors, and the same :class:`RowDecoder` as the single-request path.

Row ids are this class's own and stay the same across park and resume (mlx-lm gives a resumed
row a new uid).

The rows are ``engine/batch/batch_row.py``'s, and mlx-lm's batch of them is in
``engine/batch/batch_rows.py``. A lone generating row leaves the ``BatchGenerator`` and is
stepped by mlx-lm's ``generate_step`` instead, which runs one row faster: the batch engine's
:class:`SoloRow` (``engine/batch/solo.py``).

A call's steps need not all run inside it: between calls, while the caller hands out the last
call's tokens, the engine thread runs up to ``steps - 1`` of the next call's steps ahead of it
(:meth:`BatchEngine.step_ahead`), and the call runs the rest. The rows it steps are the rows as
they are then; a row removed or parked meanwhile loses or keeps those tokens as it would any
other. Without this the engine waited out every hand-off: on an H200, where a step is mostly host
work and the GPU idles while the host waits, that was 3-5% of a wave (design/008, change 13).
A small batch's calls run one step and let the engine run several ahead: each call then hands
out whatever was sampled since the last, at once, and the engine never waits (design/017).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from concurrent import futures
from typing import Any

from ..generate import Engine
from ..outputs import RowEvent, RowFailed, RowProgress
from ..params import PreparedRequest, SamplingParams
from ..threads import Shape, shape
from ..vocabulary.grammar import grammar_failure, request_matcher, rewind
from ..vocabulary.sampling import Sampler, make_row_sampler, with_injected_fault
from .batch_row import BatchRow, PromptStart, guard_sampler
from .batch_rows import GeneratorRows, commit
from .schedule import TokenBudget
from .solo import SoloRow

DEFAULT_PREFILL_CHUNK = 256
PREFILL_BATCH = 8  # prompts prefilled together, without a budget
MATCHER_WAIT_S = 0.05  # how long a step with nothing else to do waits for a grammar's matcher


class BatchEngine:
    """Rows generating together; every method must be called on the engine thread."""

    def __init__(
        self,
        engine: Engine,
        *,
        max_batch: int = 32,
        prefill_chunk: int = DEFAULT_PREFILL_CHUNK,
        budget: TokenBudget | None = None,
        sampler_factory: Callable[[SamplingParams], Sampler | None] = make_row_sampler,
        solo: bool = True,
    ) -> None:
        """``budget``: how much prompt a step prefills beside its decoding rows
        (``engine/batch/schedule.py``; None: ``prefill_chunk`` tokens for each of up to
        ``PREFILL_BATCH`` prompts, as before the budget); ``prefill_chunk`` also bounds the
        prompt a lone row prefills with ``generate_step``. ``sampler_factory`` builds each
        row's sampler (None: greedy); it is the seam for injecting a failing sampler. ``solo``:
        step a lone row with ``generate_step``."""
        self._engine = engine
        self._sampler_factory = sampler_factory
        if budget is None:
            budget = TokenBudget(
                PREFILL_BATCH * prefill_chunk, PREFILL_BATCH * prefill_chunk, prefill_chunk
            )
        self._batch = GeneratorRows(engine, max_batch=max_batch, budget=budget)
        self._rows: dict[int, BatchRow] = {}
        # Rows held to a grammar whose matcher is still being built (off the step: a large
        # schema's takes seconds); they join at the first step after it is.
        self._waiting: dict[int, tuple[PreparedRequest, futures.Future[Any]]] = {}
        self._held: dict[int, BatchRow] = {}  # rows held to a grammar
        self._failed_to_join: list[RowEvent] = []
        self._faults: dict[int, str] = {}  # sampler failures of this step, by row
        self._next_row = 0
        # A lone row leaves mlx-lm's batch with its last token taken back out of its cache:
        # only where every cache can rewind (engine/batch/caches.py).
        self._solo = SoloRow(
            engine, prefill_chunk=prefill_chunk, enabled=solo and engine.caches.rewind
        )
        self._step_count = 0
        self._first_token = False  # a row got its first token in this call's steps
        # This call's steps so far (run ahead of it included): rows' latest progress, the rows
        # that got tokens; and how many steps ran ahead, of the most that may (the last
        # call's steps less one).
        self._progress: dict[int, RowProgress] = {}
        self._touched: dict[int, BatchRow] = {}
        self._ahead = 0
        self._ahead_limit = 0
        self._fault: Exception | None = None  # raised by a step run ahead; the next call raises
        self.max_batch = max_batch

    @property
    def num_rows(self) -> int:
        """Rows added and not yet finished or removed (waiting for their grammar's matcher,
        prefilling, generating or parked)."""
        return len(self._rows) + len(self._waiting)

    @property
    def num_active(self) -> int:
        """Rows being stepped (not parked)."""
        return len(self._batch) + (self._solo.row_id is not None)

    @property
    def steps_run(self) -> int:
        """Steps run so far (a call of several may stop short)."""
        return self._step_count

    def shape(self) -> Shape:
        """What the next step runs: ``prefill`` while some row has prompt left (and how many
        such rows), else ``decode`` (and how many rows); the thread count is chosen by it."""
        if self._solo.row_id is not None:
            return shape("prefill" if self._solo.is_unstarted else "decode", 1)
        if preparing := self._batch.num_preparing:
            return shape("prefill", preparing)
        return shape("decode", self._batch.num_decoding)

    @property
    def solo_row(self) -> int | None:
        """The row stepped by ``generate_step``, if one is."""
        return self._solo.row_id

    @property
    def kv_bytes(self) -> int:
        """Bytes held by the KV caches of every row, parked ones included."""
        parked = sum(c.nbytes for row in self._rows.values() if row.parked for c in row.parked[0])
        return self._batch.kv_bytes + parked + self._solo.kv_bytes

    def row_sizes(self) -> list[tuple[int, int]]:
        """Each row's prompt tokens and ``max_tokens`` (what its KV can grow to), for the rows
        that hold KV: in mlx-lm's batch, parked or solo; not a row that ended in this call's
        steps (its KV went to the prompt cache, or was freed)."""
        solo = self._solo.row_id
        return [
            (r.num_prompt_tokens, r.decoder.params.max_tokens)
            for r in self._rows.values()
            if self._batch.holds(r) or r.parked is not None or r.id == solo
        ]

    def add(self, request: PreparedRequest) -> int:
        """Queue a row; it starts prefilling at the next step (a row held to a grammar, once
        its matcher is built). Returns its row id."""
        self._raise_fault()
        row_id = self._next_row
        self._next_row += 1
        if (grammar := request.params.grammar) is not None:
            matcher = request_matcher(grammar, self._engine.tokenizer)
            if not matcher.done():
                self._waiting[row_id] = (request, matcher)
                return row_id
        self._add_now(row_id, request)
        return row_id

    def _add_now(self, row_id: int, request: PreparedRequest) -> None:
        self._end_solo()
        self._batch.flush_ended()  # the prompt may reuse what rows just ended with
        sampler = with_injected_fault(self._sampler_factory(request.params), request)
        if sampler is not None:
            sampler = guard_sampler(row_id, sampler, self._faults)
        slot = self._engine.adapter_slot(request.adapter)
        row = BatchRow.new(row_id, self._engine.tokenizer, request, sampler, slot)
        prompt = list(request.prompt_tokens)
        start = PromptStart.take(self._engine.prompt_cache, prompt, request.cache_partition)
        row.decoder.num_cached_tokens = start.num_cached
        if self._solo.can_start_from_prompt(len(self._rows), len(start.rest)):
            self._solo.start_from_prompt(row, prompt, start)
        else:
            self._batch.insert_from(row, start)
        self._rows[row_id] = row  # only once mlx-lm took it: a failed add changes nothing
        if request.params.grammar is not None:
            self._held[row_id] = row

    def _admit_waiting(self) -> None:
        """Rows whose matcher is now built join the batch (a step with no other row waits a
        moment for one); a row whose grammar failed to build fails."""
        if not self._waiting:
            return
        if not self.num_active:
            pending = [matcher for _, matcher in self._waiting.values()]
            futures.wait(pending, MATCHER_WAIT_S, return_when=futures.FIRST_COMPLETED)
        for row_id, (request, matcher) in list(self._waiting.items()):
            if not matcher.done():
                continue
            del self._waiting[row_id]
            try:
                self._add_now(row_id, request)
            except Exception as exc:  # its grammar's InvalidRequestError, say
                self._failed_to_join.append(RowFailed(row=row_id, message=str(exc)))

    def remove(self, rows: Iterable[int]) -> None:
        """Drop rows (cancelled, failed or parked); unknown ids are ignored. Frees their KV,
        after giving the prompt cache what they had prefilled (a retry resumes from there)."""
        self._raise_fault()
        uids = []
        for row_id in rows:
            self._waiting.pop(row_id, None)
            self._held.pop(row_id, None)
            row = self._rows.pop(row_id, None)
            if row is not None and (uid := self._detach(row_id, row)) is not None:
                uids.append(uid)
        self._batch.remove(uids)
        self._batch.flush_ended()

    def _detach(self, row_id: int, row: BatchRow) -> int | None:
        """Stop stepping a row: a solo or parked row gives its KV to the prompt cache; a row in
        mlx-lm's batch is unmapped and its uid returned, to remove from there."""
        if row_id == self._solo.row_id:
            if self._solo.is_unstarted:  # the prompt cache's hit goes back
                start = self._solo.drop_unstarted()
                commit(self._engine, start.context or [], start.hit_cache, row.cache_salt)
            else:  # it goes as a parked row does
                row.parked = self._solo.drop()
        if (uid := self._batch.detach(row)) is not None:
            return uid
        if row.parked is not None:
            caches, tokens = row.parked
            row.parked = None
            commit(self._engine, tokens[:-1], caches, row.cache_salt)
        return None

    def can_park(self, row_id: int) -> bool:
        """Whether a row is decoding (in mlx-lm's generation batch, or solo): not prefilling,
        not parked; and the model's caches can give back its last token (a recurrent state
        cannot: such a row stays in the batch, engine/batch/caches.py)."""
        if not self._engine.caches.rewind:
            return False
        row = self._rows.get(row_id)
        solo = row_id == self._solo.row_id and not self._solo.is_unstarted
        # (A row that ended in a step run ahead is decoding no more: it left mlx-lm's batch.)
        return row is not None and ((row.decoding and row.uid is not None) or solo)

    def park(self, row_id: int) -> None:
        """Take a generating row out of the batch, keeping its KV cache for :meth:`resume`.

        The cache already holds the last emitted token (mlx-lm computes one step ahead), so it
        is trimmed by one and that token is fed again on resume: greedy output is unchanged.
        """
        self._raise_fault()
        assert self.can_park(row_id), "only a generating row can be parked"
        solo = row_id == self._solo.row_id
        row = self._rows[row_id]
        row.parked = self._solo_drop(row) if solo else self._batch.take_out(row)

    def resume(self, row_id: int) -> None:
        """Put a parked row back into the batch; it continues where it stopped."""
        self._raise_fault()
        row = self._rows[row_id]
        assert row.parked is not None, "resume of a row that is not parked"
        caches, tokens = row.parked
        row.parked = None
        self._batch.insert(row, [tokens[-1]], row.remaining_tokens, caches, tokens[:-1])

    # -- the solo row -------------------------------------------------------------------------

    def _start_solo(self) -> None:
        """Go solo if exactly one row is left, generating."""
        if not self._solo.enabled or self._solo.row_id is not None or len(self._rows) != 1:
            return
        (row,) = self._rows.values()
        if row.decoding and row.uid is not None:
            self._solo.start(row, *self._batch.take_out(row))

    def _end_solo(self) -> None:
        """Put the solo row, if any, back into the batch as a resumed row."""
        if (row_id := self._solo.row_id) is None:
            return
        row = self._rows[row_id]
        if self._solo.is_unstarted:  # it has not run: it joins the batch with its prompt
            start = self._solo.drop_unstarted()
            self._batch.insert_from(row, start)
            return
        row.parked = self._solo_drop(row)
        self.resume(row_id)

    def _solo_drop(self, row: BatchRow) -> tuple[list[Any], list[int]]:
        """The solo row's caches and tokens, parked-style; its grammar forgets the token fed
        in ``generate_step``'s step ahead (``grammar.rewind``)."""
        parked = self._solo.drop()
        rewind(row.processors)
        return parked

    def _solo_step(self, row: BatchRow) -> None:
        token, logprobs, prefilled = self._solo.step()
        if prefilled is not None:  # its prompt was prefilled in this step
            self._progress[row.id] = RowProgress(row.id, prefilled, prefilled)
        self._first_token |= row.take(token, logprobs, self._step_count)
        self._touched[row.id] = row
        if row.ends_with(token):  # the row ends here: its KV goes now
            commit(self._engine, *self._solo.end(), row.cache_salt)

    # -- steps --------------------------------------------------------------------------------

    def step(self, steps: int = 1, ahead: int = 0) -> list[RowEvent]:
        """Run ``steps`` batch steps, fewer once no row is left or a row got its first token
        (a first token never waits for the rest of a call). Returns each row's latest
        progress, one output per row with its tokens, then the rows that failed.

        Steps run ahead of the call (:meth:`step_ahead`) count among its ``steps``; the call
        runs the rest, at least one if none ran ahead. Until the next call up to ``steps - 1``
        steps may run ahead of it, or ``ahead`` if more: with ``steps`` 1 and ``ahead``, the
        engine keeps stepping while the caller hands tokens out, and each call returns every
        token sampled since the last (a small batch's smooth streams, design/017).

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
        self._batch.flush_ended()
        self._admit_waiting()
        for _ in range(max(0 if self._ahead else 1, steps - self._ahead)):
            if not self.num_active or self._first_token:
                break
            self._step_once()
        events = self._call_events(steps)
        self._ahead, self._ahead_limit = 0, max(steps - 1, ahead)
        self._first_token = False
        self._progress, self._touched = {}, {}
        return events

    def may_step_ahead(self) -> bool:
        """Whether there is idle work (no step ahead failed): rows that ended wait to give
        their KV to the prompt cache, or a step may run ahead of the next call (fewer than
        the last call allowed have, no row got its first token since: it goes out at once
        with the next call; and a row is being stepped)."""
        if self._fault is not None:
            return False
        return self._batch.has_ended or not (
            self._ahead >= self._ahead_limit or self._first_token or not self.num_active
        )

    def step_ahead(self) -> bool:
        """Idle work, a piece a call: the KV of rows that ended goes to the prompt cache
        (their tokens are out by now), else one step of the next call runs before it comes
        (:meth:`may_step_ahead`). Returns whether it did either.

        The engine thread calls this while no job waits. A piece that raises here raises from
        the next call instead (whichever it is), and none runs ahead until then.
        """
        if not self.may_step_ahead():
            return False
        try:
            if not self._batch.flush_ended():
                self._step_once()
                self._ahead += 1
        except Exception as exc:
            self._fault = exc
            return False
        return True

    def _raise_fault(self) -> None:
        if self._fault is not None:
            fault, self._fault = self._fault, None
            raise fault

    def _step_once(self) -> None:
        self._step_count += 1
        self._step()
        for row_id, row in self._held.items():  # a grammar that could not go on fails its row
            if (failure := grammar_failure(row.processors)) is not None:
                self._faults.setdefault(row_id, failure)
        if self._faults:
            self._fail_faulted()

    def _call_events(self, steps: int) -> list[RowEvent]:
        """The call's events from its rows' tokens (rows with fewer than ``steps`` of them
        keep theirs, see :meth:`step`); finished rows leave."""
        outputs: list[RowEvent] = []
        failures: list[RowEvent] = []
        leaving: list[int] = []
        leaving_ids: list[int] = []
        for row_id, row in self._touched.items():
            if self._rows.get(row_id) is not row:  # removed after a step run ahead
                continue
            if self._keeps_tokens(row, steps):
                continue
            if (output := row.decode()) is not None:
                outputs.append(output)
            if output is not None and output.stats is not None:  # finished
                del self._rows[row_id]
                leaving_ids.append(row_id)
                if (uid := self._detach(row_id, row)) is not None:
                    leaving.append(uid)
            elif row.failure is not None:
                del self._rows[row_id]
                leaving_ids.append(row_id)
                failures.append(RowFailed(row=row_id, message=row.failure))
            else:  # (a row parked after steps ran ahead of the call is not stepped)
                assert self._is_stepped(row) or row.parked is not None, (
                    "mlx-lm finished a row that its decoder did not"
                )
        self._batch.remove(leaving)
        for row_id in leaving_ids:
            self._held.pop(row_id, None)
        failures.extend(self._failed_to_join)
        self._failed_to_join = []
        return [*self._progress.values(), *outputs, *failures]

    def _keeps_tokens(self, row: BatchRow, steps: int) -> bool:
        """Whether a row keeps its tokens for a later call: it has fewer than ``steps``, none
        of them its first, and it is still being stepped (not ended, not failed)."""
        return (
            len(row.sampled) < steps
            and row.decoder.num_generated > 0
            and row.failure is None
            and self._is_stepped(row)
        )

    def _is_stepped(self, row: BatchRow) -> bool:
        """Whether a row is still being stepped: in mlx-lm's batch, or the solo row."""
        return row.uid is not None or row.id == self._solo.row_id

    def _step(self) -> None:
        self._start_solo()
        if (solo := self._solo.row_id) is not None:
            self._solo_step(self._rows[solo])
            return
        if self._batch:
            self._first_token |= self._batch.step(self._step_count, self._progress, self._touched)

    def _fail_faulted(self) -> None:
        """Stop stepping the rows whose sampler failed in this step; the end of the call
        reports their earlier tokens and then their failure. The token a row got in the
        failing step is dropped: it may be the failed sampler's placeholder."""
        faults, self._faults = self._faults, {}
        uids = []
        for row_id, message in faults.items():
            row = self._rows.get(row_id)
            if row is None or row.failure is not None:
                continue
            row.fail(message, self._step_count)
            if (uid := self._detach(row_id, row)) is not None:
                uids.append(uid)
            self._touched[row_id] = row
        self._batch.remove(uids)

    def close(self) -> None:
        """Release every row and the generator."""
        self._solo.close()
        self._rows.clear()
        self._waiting.clear()
        self._held.clear()
        self._batch.close()
