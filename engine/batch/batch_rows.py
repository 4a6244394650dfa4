"""mlx-lm's ``BatchGenerator`` stepping the batch path's rows.

:class:`GeneratorRows` is mlx-lm's batch: the ``BatchGenerator`` and the row
(``engine/batch/batch_row.py``: :class:`BatchRow`) of each of its uids (mlx-lm gives a resumed
row a new uid; row ids stay the batch engine's own), and the long prompts prefilled one row at a
time before they join it (``engine/batch/alone.py``). A row that leaves it gives its KV to the
prompt cache (:func:`commit`, :func:`commit_many`).
"""

from __future__ import annotations

from collections.abc import Iterable
from contextlib import AbstractContextManager
from functools import partial
from typing import Any

from .. import _blas  # noqa: F401  (loads OpenBLAS: before MLX below)

# isort: split
from mlx_lm.generate import BatchGenerator

from ..generate import Engine
from ..outputs import RowProgress
from ..vocabulary.grammar import rewind
from . import decode_attention, lean_step, masked_attention
from .alone import AlonePrefill, AloneRow
from .batch_row import BatchRow, PromptStart
from .schedule import TokenBudget

# A row that left mlx-lm's batch: the tokens its KV caches hold, the caches, its salt.
Ended = tuple[list[int], list[Any], str | None]


def commit(engine: Engine, tokens: list[int], caches: list[Any] | None, salt: str | None) -> None:
    """Give the prompt cache, if any, KV ``caches`` that hold exactly ``tokens``, under
    ``salt``."""
    if engine.prompt_cache is not None and caches:
        engine.prompt_cache.put(tokens, caches, salt)


def commit_many(engine: Engine, entries: list[Ended]) -> None:
    """:func:`commit` for several rows' KV, evaluated together (one wait for the device)."""
    if engine.prompt_cache is not None and entries:
        engine.prompt_cache.put_many(entries)


class GeneratorRows:
    """The rows in mlx-lm's ``BatchGenerator``, by uid; called on the engine thread only."""

    def __init__(self, engine: Engine, *, max_batch: int, budget: TokenBudget) -> None:
        self._engine = engine
        self._budget = budget
        self._generator = BatchGenerator(
            engine.model,
            completion_batch_size=max_batch,
            prefill_batch_size=max_batch,
            prefill_step_size=budget.max_chunk,
        )
        self._row_of_uid: dict[int, BatchRow] = {}
        self._detached: dict[int, str | None] = {}  # uids to remove, with their rows' salts
        # Rows that left the batch, their KV not yet given to the prompt cache: that waits
        # until their last tokens are out (flush_ended), and is evaluated for all at once.
        self._ended: list[Ended] = []
        # Caches that cannot rewind (or stop when a window fills) are reused from their exact
        # end only: each prompt but its last token goes to the prompt cache as it is reached
        # (engine/batch/caches.py).
        self._checkpoints = engine.prompt_cache is not None and engine.caches.checkpoints
        # Log-probabilities only while a row wants them (engine/batch/lean_step.py).
        lean_step.install(
            self._generator,
            self._wants_logprobs,
            self._select_adapters,
            plain_masked=masked_attention.wanted(engine.loaded.device),
            decode_kernel=decode_attention.wanted(engine.loaded.device, model=engine.model),
        )
        self._alone = AlonePrefill(
            engine.model,
            max_chunk=budget.max_chunk,
            checkpoints=self._checkpoints,
            pad=budget.alone_from is not None,
            select=engine.select_adapters,
            make_caches=lambda _model: engine.new_caches(),
        )

    def _wants_logprobs(self, uids: Iterable[int]) -> bool:
        """Whether a row of ``uids`` wants log-probabilities (one not ours, to be safe)."""
        rows = self._row_of_uid
        return any((row := rows.get(uid)) is None or row.wants_logprobs for uid in uids)

    def _select_adapters(self, uids: Iterable[int]) -> AbstractContextManager[None]:
        """The forward of the rows ``uids`` with each row's adapter (one not ours: the base)."""
        rows = self._row_of_uid
        return self._engine.select_adapters(
            [row.adapter_slot if (row := rows.get(uid)) is not None else 0 for uid in uids]
        )

    def __len__(self) -> int:
        return len(self._row_of_uid) + len(self._alone)

    def holds(self, row: BatchRow) -> bool:
        """Whether the row's KV is here: in mlx-lm's batch, or being prefilled alone."""
        return row.uid is not None or row.id in self._alone

    @property
    def kv_bytes(self) -> int:
        return self._generator.prompt_cache_nbytes + self._alone.kv_bytes

    @property
    def num_decoding(self) -> int:
        """Rows past their prompt, each stepped one token a step."""
        return len(self._generator._generation_batch)

    @property
    def num_preparing(self) -> int:
        """Rows with prompt left to prefill, being prefilled or waiting to be."""
        generator = self._generator
        in_generator = len(generator._currently_processing) + len(generator._unprocessed_sequences)
        return in_generator + len(self._alone)

    def insert(
        self,
        row: BatchRow,
        prompt: list[int],
        max_tokens: int,
        cache: list[Any] | None,
        context: list[int] | None,
    ) -> None:
        """Add a row to prefill ``prompt`` on top of ``cache`` (which holds ``context``; None:
        fresh caches of the engine's KV scheme)."""
        if cache is None:
            cache, context = self._engine.new_caches(), None
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

    def insert_from(self, row: BatchRow, start: PromptStart) -> None:
        """Add a row that has generated nothing yet, to prefill its prompt past the hit: alone
        first if that is long (``TokenBudget.prefills_alone``)."""
        if self._budget.prefills_alone(len(start.rest)):
            self._alone.add(row, start.rest, start.hit_cache, start.context)
            row.uid, row.decoding = None, False
            return
        self.insert(row, start.rest, row.remaining_tokens, start.hit_cache, start.context)

    def take_out(self, row: BatchRow) -> tuple[list[Any], list[int]]:
        """Take a generating row out: its caches and tokens, parked-style (the caches hold
        every token but the last: mlx-lm computes one step ahead)."""
        assert row.uid is not None
        caches, tokens = self._generator.extract_cache([row.uid])[row.uid]
        for cache in caches:
            cache.trim(1)
        rewind(row.processors)
        self._generator.remove([row.uid])
        del self._row_of_uid[row.uid]
        row.uid = None
        row.decoding = False
        return caches, list(tokens)

    def detach(self, row: BatchRow) -> int | None:
        """Stop mapping a row, if it is in the batch: its uid, for :meth:`remove`. A row being
        prefilled alone leaves at once, what it prefilled to the prompt cache."""
        if (entry := self._alone.drop(row.id)) is not None:
            commit(self._engine, entry.held_tokens(), entry.caches, row.cache_salt)
            return None
        if row.uid is None:
            return None
        uid, row.uid = row.uid, None
        del self._row_of_uid[uid]
        self._detached[uid] = row.cache_salt
        return uid

    def remove(self, uids: Iterable[int]) -> None:
        """Drop detached rows; what they had prefilled goes to the prompt cache (at the next
        :meth:`flush_ended`)."""
        if not (uids := list(uids)):
            return
        salts = [self._detached.pop(uid, None) for uid in uids]
        if self._engine.prompt_cache is None:
            self._generator.remove(uids)
            return
        held = self._generator.remove(uids, return_prompt_caches=True)
        for uid, salt in zip(uids, salts, strict=True):
            if (found := held.get(uid)) is not None:
                caches, tokens = found
                self._ended.append((list(tokens), caches, salt))

    @property
    def has_ended(self) -> bool:
        """Whether rows that left the batch wait to give their KV to the prompt cache."""
        return bool(self._ended)

    def flush_ended(self) -> bool:
        """Give the prompt cache the KV of the rows that left the batch since the last flush;
        whether there were any.

        A step where many rows end (a burst's rows reaching ``max_tokens`` together) would
        otherwise wait for the device once per row (``PromptCache.put`` evaluates each row's
        slice of the batch's KV) before its tokens go out: 128 rows on a GPU, 128 waits.
        The batch engine flushes as idle work, once the step's tokens are out, and before a
        row is added (whose prompt may reuse them)."""
        if not self._ended:
            return False
        ended, self._ended = self._ended, []
        commit_many(self._engine, ended)
        return True

    def step(
        self, step: int, progress: dict[int, RowProgress], touched: dict[int, BatchRow]
    ) -> bool:
        """One ``BatchGenerator.next()``: prefilling rows' ``progress``, and each generating
        row's token kept (the row then in ``touched``); whether a row got its first token. A
        row that mlx-lm ends (stop token, ``max_tokens``) leaves, its KV to the prompt cache
        at the next :meth:`flush_ended`. Rows prefilled alone take their chunks first; those
        done join mlx-lm's batch."""
        if self._alone:
            self._step_alone(progress)
        self._apply_budget()
        prompt_responses, generation_responses = self._generator.next()
        in_batch = self._row_of_uid
        checkpoints = []
        for response in prompt_responses:
            if (row := in_batch.get(response.uid)) is not None:
                done, total = response.progress
                before = row.prefilled_alone
                progress[row.id] = RowProgress(row=row.id, done=before + done, total=before + total)
                if self._checkpoints and response.end_of_segment and not response.end_of_prompt:
                    checkpoints.append(response.uid)
        if checkpoints:
            self._keep_checkpoints(checkpoints)
        # This runs for every generating row in every step, on the thread that also builds the
        # next step: its first-token check is done only where a first token can be (a row's
        # first step in the batch).
        first_token = False
        for response in generation_responses:
            if (row := in_batch.get(response.uid)) is None:
                continue
            if not row.decoding:
                row.decoding = True
                first_token |= row.num_sampled == 0
            row.sampled.append(response.token)
            if row.wants_logprobs:
                row.sampled_logprobs.append(response.logprobs)
            row.took_at = step
            touched[row.id] = row
            if response.finish_reason is not None:  # mlx-lm dropped the row, handed back its KV
                del in_batch[response.uid]
                row.uid = None
                if response.prompt_cache:
                    tokens = list(response.all_tokens or [])
                    self._ended.append((tokens, response.prompt_cache, row.cache_salt))
        return first_token

    def _step_alone(self, progress: dict[int, RowProgress]) -> None:
        """Prefill the rows waiting alone within the iteration's budget; those done join
        mlx-lm's batch with their prompt's last token and their caches."""
        tokens = self._budget.alone_tokens(len(self._generator._generation_batch))
        stepped, ready = self._alone.step(tokens, partial(commit, self._engine))
        for entry in stepped:
            progress[entry.row.id] = RowProgress(entry.row.id, entry.done, len(entry.rest))
        for entry in ready:
            self._join(entry)

    def _join(self, entry: AloneRow) -> None:
        row = entry.row
        row.prefilled_alone = entry.done
        context = entry.held_tokens()
        self.insert(row, entry.rest[-1:], row.remaining_tokens, entry.caches, context)

    def _keep_checkpoints(self, uids: list[int]) -> None:
        """Give the prompt cache what the rows ``uids`` hold at the end of their prompt but
        its last token (mlx-lm feeds that one with the first decode step)."""
        for uid, (caches, tokens) in self._generator.extract_cache(uids).items():
            commit(self._engine, list(tokens), caches, self._row_of_uid[uid].cache_salt)

    def _apply_budget(self) -> None:
        """Set the next ``BatchGenerator.next()``'s prompts and chunk by the token budget:
        mlx-lm takes up to ``prefill_batch_size`` rows into its prompt batch, in order, and
        prefills ``prefill_step_size`` tokens of each per step (mlx-lm 0.32's fields: its
        ``_next`` reads them every step)."""
        generator = self._generator
        preparing = [_tokens_left(entry[0]) for entry in generator._currently_processing]
        waiting = [_tokens_left(entry[1]) for entry in generator._unprocessed_sequences]
        joining = self._budget.prompts_to_prepare(preparing, waiting) if waiting else 0
        rows = len(preparing) + joining
        chunk = self._budget.chunk(len(generator._generation_batch), rows)
        generator.prefill_batch_size = rows
        generator.prefill_step_size = chunk
        generator._prompt_batch.prefill_step_size = chunk

    def close(self) -> None:
        self._alone.close()
        self._row_of_uid.clear()
        self._detached.clear()
        self._ended.clear()
        self._generator.close()


def _tokens_left(segments: list[list[int]]) -> int:
    return sum(len(segment) for segment in segments)
